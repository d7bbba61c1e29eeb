#!/usr/bin/env bash
# Issue #4 on one H200, unattended, in one 10-minute call: what the landed decode path gives and costs.
#
#   scripts/engine_speed_check.sh [OUTDIR] [tests|bench|ab|all]   (OUTDIR default: $OUT, else ./speed-out)
#
# tests: the cuda tests of the decode kernels (attention, rotary, GEMV, PDL), of speculative decoding and of
#        the engine's paths, with full failure output in OUTDIR/pytest.log (a summary line alone cannot
#        tell a mismatch from an exception).
# bench: the issue's figures: bench_generate for Qwen2-0.5B at batch 1 and 128 beside transformers (static
#        cache + compile, plain generate), Qwen2.5-7B at batch 64, and the batch-1 graph profile.
# ab:    bench_generate at batch 1 (ours) with the GEMV weight prefetch and PDL each on and off, and
#        bench_decode_parts for the attention tilings (single / rows1 / auto).
# One JSON line per case goes to OUTDIR/bench.jsonl (ab: OUTDIR/ab.jsonl); paste the figures into docs/benchmarks.md.
set -uo pipefail

out="${1:-${OUT:-./speed-out}}"
what="${2:-all}"
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

run_tests() {
    timeout 420 python3 -m pytest -q -m cuda tests/test_triton_attention.py tests/test_triton_attention_rows.py \
        tests/test_attention_rope.py tests/test_gemv.py tests/test_norm_gemv.py tests/test_fused.py \
        tests/test_pdl_cuda.py tests/test_spec_cuda.py tests/test_engine_cuda.py tests/test_engine_paths_cuda.py \
        >"$out/pytest.log" 2>&1 || status=1
    tail -n 5 "$out/pytest.log"
}

run_bench() {
    : >"$out/bench.jsonl"
    echo "== bench_generate qwen2-0.5b, batch 1 and 128, beside transformers"
    timeout 260 python3 -m scripts.bench_generate --batch 1 128 --peers static plain 2>>"$out/bench.log" \
        | tee -a "$out/bench.jsonl" || status=1
    echo "== bench_generate qwen2.5-7b, batch 64"
    timeout 150 python3 -m scripts.bench_generate --shape qwen2.5-7b --batch 64 --peers 2>>"$out/bench.log" \
        | tee -a "$out/bench.jsonl" || status=1
    echo "== profile_decode --graph (PDL off)"
    timeout 90 python3 -m scripts.profile_decode --graph --batch 1 --steps 20 2>>"$out/bench.log" | tail -n 1 \
        | tee -a "$out/bench.jsonl" || status=1
}

run_ab() {
    : >"$out/ab.jsonl"
    for pdl in 1 0; do
        for prefetch in 1 0; do
            echo "== bench_generate batch 1, SIDECAR_PDL=$pdl SIDECAR_GEMV_PREFETCH=$prefetch"
            SIDECAR_PDL=$pdl SIDECAR_GEMV_PREFETCH=$prefetch timeout 90 python3 -m scripts.bench_generate \
                --batch 1 --peers 2>>"$out/bench.log" | sed "s/^{/{\"pdl\": $pdl, \"prefetch\": $prefetch, /" \
                | tee -a "$out/ab.jsonl" || status=1
        done
    done
    echo "== bench_decode_parts (attention tilings)"
    timeout 120 python3 scripts/bench_decode_parts.py --parts attention --batches 1 128 --contexts 256 1024 \
        --max-model-len 4096 2>>"$out/bench.log" | tee -a "$out/ab.jsonl" || status=1
}

case "$what" in
    tests) run_tests ;;
    bench) run_bench ;;
    ab) run_ab ;;
    all) run_tests; run_bench ;;
    *) echo "engine_speed_check.sh: unknown step '$what' (tests|bench|ab|all)" >&2; exit 2 ;;
esac
exit $status
