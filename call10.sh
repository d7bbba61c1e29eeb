mkdir -p $OUT
B="--batch 1 128 --new-tokens 32"
T=80 TAIL=3 step "python3 dbg_b128.py -- $B --peers 2>$OUT/s1.err; grep -E 'Error' $OUT/s1.err | head -2"
T=120 TAIL=3 step "python3 dbg_b128.py -- $B --peers static 2>$OUT/s2.err; grep -E 'Error' $OUT/s2.err | head -2"
T=120 TAIL=3 step "python3 dbg_b128.py rowsN -- $B --peers static 2>$OUT/s3.err; grep -E 'Error' $OUT/s3.err | head -2"
