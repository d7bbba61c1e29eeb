#!/usr/bin/env bash
# One device call, unattended: install the carried wheels (.whl/*.whl, if any), then the cuda tests or the
# kept benchmarks. Logs and JSON lines go to OUTDIR.
#
#   scripts/tools/device_check.sh OUTDIR tests [PYTEST ARGS...]   # the cuda tests (all of them, or these)
#   scripts/tools/device_check.sh OUTDIR bench [NAMES...]         # the benchmarks below (default: DEFAULT_BENCH)
#
# tests: pytest -m cuda, its whole output in OUTDIR/pytest.log, the summary and failures printed (TEST_TIMEOUT,
#        default 520 s). bench: each named benchmark under its own time limit, one JSON line per case into
#        OUTDIR/bench.jsonl, stderr into OUTDIR/bench.log. The default set fits one 10-minute call; name the others
#        (generate, rl_step, rl_step_7b, rl_step_7b_recompute, rl_step_oversample, first_batch, creep, fp8, lora, delta, moe,
#        invariance, rollout_invariant, rollout_invariant_7b; sync_nccl on 2+ GPUs) in a call of
#        their own. Exit status 1 if any step failed.
# moe: every GPU figure of the MoE work (docs/moe.md "Benchmarks"): moe_layer (one A3B layer against its
#      active-weight roofline), moe_generate (the A3B shape cut to 16 layers, batch 1 and 64, against
#      transformers' generate and the decode step's active-weight roofline), moe_rollout (the GRPO batch on 8
#      A3B layers against its active-weight roofline, timed without and with return_routing, A B B A). With
#      its cuda tests it fits one call (~8 min on an H100, docs/dev/status.md):
#        TEST_TIMEOUT=200 scripts/tools/device_check.sh $OUT tests tests/test_moe_cuda.py tests/test_routing_cuda.py
#        scripts/tools/device_check.sh $OUT bench moe
#      moe_generate_static (transformers' static cache + torch.compile as the peer) compiles the MoE model:
#      a call of its own.
set -uo pipefail
out="${1:-${OUT:-./check-out}}"; what="${2:-}"
cd "$(dirname "$0")/../.."
mkdir -p "$out"
# NVLink multicast stays off on shared hosts (it can take every GPU of the host out of service).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >/dev/null 2>&1 && export PYTHONPATH=$PWD:/tmp/site
fi
DEFAULT_BENCH=(sampler sync client_sync rollout rollout_7b)
status=0

run_tests() {
    timeout "${TEST_TIMEOUT:-520}" python3 -m pytest -q -m cuda -p no:cacheprovider "$@" >"$out/pytest.log" 2>&1 \
        || status=1
    grep -E "passed|failed|error" "$out/pytest.log" | tail -n 3
    grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -n 20
}

bench() {  # seconds, module, args...: one benchmark, its JSON lines appended to bench.jsonl
    local limit=$1 module=$2; shift 2
    echo "== $module $*" >>"$out/bench.log"
    timeout "$limit" python3 -m "scripts.bench.$module" "$@" 2>>"$out/bench.log" | tee -a "$out/bench.jsonl"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "$module${*:+ $*}: failed (bench.log)" >&2; }
}

bench_named() {  # one name of the list: its benchmarks
    case "$1" in
        sampler) bench 60 sampler ;;
        sync) bench 100 sync --shape all --backend ipc ;;
        client_sync) bench 60 client_sync --model qwen2-0.5b --backend ipc --device cuda ;;
        rollout) bench 170 rollout --shapes qwen2-0.5b ;;
        rollout_7b) bench 110 rollout --shapes qwen2.5-7b --modes seeded ;;
        generate) bench 150 generate --batch 1 128 --peers ;;
        rl_step) bench 300 rl_step --shape qwen2-0.5b --steps 4 ;;
        rl_step_7b) bench 560 rl_step --shape qwen2.5-7b --steps 2 --modes sync,partial_keep,disagg_keep ;;
        rl_step_7b_recompute) bench 420 rl_step --shape qwen2.5-7b --steps 2 --modes sync,partial_recompute ;;
        rl_step_oversample) for over in 2 3; do bench 200 rl_step --shape qwen2-0.5b --steps 2 \
                                --modes sync,partial_recompute --oversample "$over"; done ;;
        first_batch) bench 120 first_batch ;;
        creep) # issue 40: 1,000 RL cycles against `sidecar launch` on a random bf16 model of the 0.5B shape
            python3 -m sidecar.cli.main make-model /tmp/creep-0.5b --overwrite --hidden-size 896 --layers 24 \
                --heads 14 --kv-heads 2 --intermediate-size 4864 --vocab-size 151936 --dtype bfloat16 >/dev/null
            echo "== creep" >>"$out/bench.log"
            timeout "${CREEP_TIMEOUT:-440}" python3 scripts/tools/creep.py --cycles "${CREEP_CYCLES:-1000}" \
                --device cuda --model /tmp/creep-0.5b --dtype bfloat16 --progress 100 \
                2>>"$out/bench.log" | tee -a "$out/bench.jsonl"
            [ "${PIPESTATUS[0]}" -eq 0 ] || { status=1; echo "creep: failed or grew (bench.log)" >&2; } ;;
        invariance) bench 300 invariance --shape qwen2-0.5b --cases alone,batch,shuffled --speed-batches 1,8,32,128
                    bench 280 invariance --shape qwen2.5-7b --prompts 16 --cases alone,batch --speed-batches 1,16,64 ;;
        rollout_invariant) local flags  # the default, the mode a token a step, the mode with its own draft (k, bound)
            for flags in "--no-batch-invariant" "--batch-invariant --no-self-draft" \
                         "--batch-invariant --self-draft --k 4 --spec-max-batch 16" \
                         "--batch-invariant --self-draft --k 8 --spec-max-batch 16" \
                         "--batch-invariant --self-draft --k 4 --spec-max-batch 64"; do
                # shellcheck disable=SC2086
                bench 100 rollout --shapes qwen2-0.5b --modes seeded,greedy $flags
            done ;;
        rollout_invariant_7b) local flags
            for flags in "--no-batch-invariant" "--batch-invariant --no-self-draft" "--batch-invariant --self-draft"; do
                # shellcheck disable=SC2086
                bench 180 rollout --shapes qwen2.5-7b --modes seeded $flags
            done ;;
        fp8) bench 200 rollout --shapes qwen2-0.5b,qwen2.5-7b --modes seeded --quantization bf16,fp8
             bench 150 sync --shape qwen2.5-7b --backend ipc --quantization bf16,fp8,fp8-send
             bench 120 fp8 ;;
        lora) bench 150 rollout --shapes qwen2-0.5b --lora-rank 16
              bench 120 delta --skip-changed --skip-delta --lr 1e-6 --lora-rank 16 --device cuda --backend ipc ;;
        delta) bench 200 delta --device cuda --backend ipc --iters 3
               bench 200 delta --device cuda --backend gloo --iters 3 --skip-changed ;;
        moe) local part; for part in moe_layer moe_generate moe_rollout; do bench_named "$part"; done ;;
        moe_layer) bench 90 moe ;;
        moe_generate) bench 180 generate --shape qwen3-30b-a3b --layers 16 --batch 1 64 --peers plain ;;
        moe_generate_static) bench 540 generate --shape qwen3-30b-a3b --layers 16 --batch 1 64 --peers static ;;
        moe_rollout) bench 240 rollout --shapes qwen3-30b-a3b --layers 8 --modes seeded --routing-repeats 2 ;;
        sync_nccl) for shape in qwen2-0.5b qwen2.5-7b; do  # trainer on GPU 0, receiver on GPU 1
                       bench 280 sync --backend nccl --device cuda:1 --sender-device cuda:0 --shape "$shape" --iters 5
                   done ;;
        *) echo "device_check.sh: unknown benchmark '$1'" >&2; status=2 ;;
    esac
}

run_bench() {
    : >"$out/bench.jsonl"
    for name in "$@"; do bench_named "$name"; done
}

case "$what" in
    tests) shift 2; run_tests "$@" ;;
    bench) shift 2; if [ $# -eq 0 ]; then run_bench "${DEFAULT_BENCH[@]}"; else run_bench "$@"; fi ;;
    *) echo "usage: $0 OUTDIR tests [PYTEST ARGS...] | bench [NAMES...]"; exit 2 ;;
esac
exit "$status"
