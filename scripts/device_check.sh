#!/usr/bin/env bash
# One H200 call, unattended: install the carried wheels, then the cuda tests of the paths this
# session touched (tests) and/or the benchmarks (bench). Logs and JSON lines go to OUTDIR.
#
#   scripts/device_check.sh OUTDIR tests FILES...|bench|draft|sync|invariance|verify|verify_rollout
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

# Issue 24's draft on the tail: the 7B rollout with the 2-layer draft (verify programs a SM 4, then 2) and
# without one, in one call; each 7B run with a draft needs about 150 s (setup captures the verify ladder).
run_draft() {
    : >"$out/draft.jsonl"
    local r="python3 -m scripts.bench_rollout --shapes qwen2.5-7b --modes seeded"
    for ppsm in 4 2; do
        SIDECAR_VERIFY_PROGRAMS_PER_SM=$ppsm timeout 200 $r --draft-layers 2 --tail-scale 0.1 2>>"$out/draft.log" \
            | sed "s/^{/{\"verify_programs_per_sm\": $ppsm, /" | tee -a "$out/draft.jsonl"
    done
    timeout 120 $r 2>>"$out/draft.log" | tee -a "$out/draft.jsonl"
}

# Issue 24's verify attention that reads each key once (SIDECAR_VERIFY_KEYS_ONCE, off by default): its cuda
# tests (its cases of the verify rows racing over NaN caches and of the rotation; greedy with a draft equal
# to without, the switch on), then the kernel against today's verify kernel and the same sequences' plain
# decode (7B and 0.5B heads, 5 rows a sequence). `verify_rollout`: the 7B rollout with the 2-layer draft
# with it on and off (about 5 minutes: a call of its own).
run_verify() {
    SIDECAR_VERIFY_KEYS_ONCE=1 TEST_TIMEOUT=300 run_tests tests/test_triton_attention_rows.py \
        tests/test_attention_rope.py tests/test_spec_cuda.py -k "keys_once or spec or greedy or draft"
    : >"$out/verify.jsonl"
    for shape in 28,4,128 14,2,64; do
        timeout 120 python3 scripts/bench_decode_parts.py --parts attention --shape $shape --verify-rows 5 \
            --variants auto w8 keys_once keys_once_w4 --batches 4 8 16 32 --contexts 640 2048 --max-model-len 4096 \
            2>>"$out/verify.log" | tee -a "$out/verify.jsonl"
    done
}

run_verify_rollout() {
    : >"$out/verify_rollout.jsonl"
    local r="python3 -m scripts.bench_rollout --shapes qwen2.5-7b --modes seeded --draft-layers 2 --tail-scale 0.1"
    for once in 1 0; do
        SIDECAR_VERIFY_KEYS_ONCE=$once timeout 200 $r 2>>"$out/verify.log" \
            | sed "s/^{/{\"verify_keys_once\": $once, /" | tee -a "$out/verify_rollout.jsonl"
    done
}

# Issue 19: the weight path's cuda tests, then the client's sync (one request against two, in the same
# run; with HotRoutes, without, with again), the in-process sync of both shapes and the demo's median step.
run_sync() {
    TEST_TIMEOUT=300 run_tests tests/test_weight_update_device_rule_cuda.py tests/test_sidecar_cuda.py \
        tests/test_weight_update_cuda.py tests/test_checksum_digest_cuda.py
    : >"$out/sync.jsonl"
    for hot in 1 0 1; do  # the sync's request through HotRoutes (default), through FastAPI's route, again
        SIDECAR_HOT_ROUTES=$hot timeout 90 python3 scripts/bench_client_sync.py --model qwen2-0.5b --backend ipc \
            --device cuda --iters 20 2>>"$out/sync.log" | sed "s/^{/{\"hot_routes\": $hot, /" | tee -a "$out/sync.jsonl"
    done
    timeout 100 python3 scripts/bench_sync.py --shape all --backend ipc 2>>"$out/sync.log" | tee -a "$out/sync.jsonl"
    timeout 150 python3 -m sidecar.cli.main demo --model qwen2-0.5b --device cuda --backend ipc --sleep-level 2 --steps 4 \
        >"$out/demo.log" 2>&1
    tail -n 1 "$out/demo.log" | tee -a "$out/sync.jsonl"
}

# Issue 23's batch-1 cost: the invariant mode's decode step (0.5B, graph, batch 1 and 128) with PDL's
# dependents scheduled early (default) or late, with the fused prologues and with the rotation inside
# decode attention, against the default mode. Then the cuda tests that hold those knobs to the same bits.
run_invariance() {
    : >"$out/invariance.log"
    local p="python3 scripts/profile_decode.py --graph --steps 16 --pdl"
    for b in 1 128; do
        echo "== default b=$b" >>"$out/invariance.log"; timeout 90 $p --batch $b >>"$out/invariance.log" 2>&1
        for env in "" SIDECAR_PDL_EARLY_INVARIANT=0 SIDECAR_INVARIANT_FUSE_PROLOGUES=1 SIDECAR_INVARIANT_FUSED_ROPE=1 \
                "SIDECAR_PDL_EARLY_INVARIANT=0 SIDECAR_INVARIANT_FUSE_PROLOGUES=1 SIDECAR_INVARIANT_FUSED_ROPE=1"; do
            echo "== invariant b=$b $env" >>"$out/invariance.log"
            env $env timeout 90 $p --batch $b --batch-invariant >>"$out/invariance.log" 2>&1
        done
    done
    TEST_TIMEOUT=240 run_tests tests/test_pdl_cuda.py tests/test_batch_invariant.py tests/test_attention_rope.py \
        -k "late_dependents or exact_rounding or fused_rotation or on_the_gpu"
}

case "$what" in
    tests) shift 2; run_tests "$@" ;;
    bench) run_bench ;;
    draft) run_draft ;;
    sync) run_sync ;;
    invariance) run_invariance ;;
    verify) run_verify ;;
    verify_rollout) run_verify_rollout ;;
    *) echo "usage: $0 OUTDIR tests FILES...|bench|draft|sync|invariance|verify|verify_rollout"; exit 2 ;;
esac
