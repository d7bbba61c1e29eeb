mkdir -p $OUT
B="--batch 128 --peers --new-tokens 32"
T=100 TAIL=4 step "python3 dbg_b128.py -- $B 2>$OUT/a.err; grep -E 'Error|error' $OUT/a.err | head -3"
T=100 TAIL=4 step "python3 dbg_b128.py rowsN -- $B 2>$OUT/b.err; grep -E 'Error|error' $OUT/b.err | head -3"
T=100 TAIL=4 step "python3 dbg_b128.py fusion -- $B 2>$OUT/c.err; grep -E 'Error|error' $OUT/c.err | head -3"
T=120 TAIL=4 step "CUDA_LAUNCH_BLOCKING=1 python3 dbg_b128.py -- $B --enforce-eager 2>$OUT/d.err; grep -B30 -E 'AcceleratorError|Error' $OUT/d.err | grep -E 'File|Error' | tail -12"
