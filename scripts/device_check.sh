#!/usr/bin/env bash
# One H200 call, unattended: install the carried wheels, then the cuda tests of the paths this
# session touched (tests) and/or the benchmarks (bench). Logs and JSON lines go to OUTDIR.
#
#   scripts/device_check.sh OUTDIR tests|bench|all
set -uo pipefail
out="${1:-${OUT:-./check-out}}"; what="${2:-all}"
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >/dev/null 2>&1 && export PYTHONPATH=$PWD:/tmp/site
fi

run_tests() {
    timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -m cuda -p no:cacheprovider "$@" >"$out/pytest.log" 2>&1
    grep -E "passed|failed|error" "$out/pytest.log" | tail -n 3
    grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -n 20
}

run_bench() {
    : >"$out/bench.jsonl"
    timeout 60 python3 scripts/bench_sampler.py 2>>"$out/bench.log" | tee -a "$out/bench.jsonl"
    timeout 100 python3 scripts/bench_sync.py --shape all --backend ipc 2>>"$out/bench.log" | tee -a "$out/bench.jsonl"
    timeout 60 python3 scripts/bench_client_sync.py --model qwen2-0.5b --backend ipc --device cuda 2>>"$out/bench.log" \
        | tee -a "$out/bench.jsonl"
    timeout 170 python3 -m scripts.bench_rollout --shapes qwen2-0.5b 2>>"$out/bench.log" | tee -a "$out/bench.jsonl"
    timeout 110 python3 -m scripts.bench_rollout --shapes qwen2.5-7b --modes seeded 2>>"$out/bench.log" \
        | tee -a "$out/bench.jsonl"
}

case "$what" in
    tests) shift 2; run_tests "$@" ;;
    bench) run_bench ;;
    *) echo "usage: $0 OUTDIR tests FILES...|bench"; exit 2 ;;
esac
