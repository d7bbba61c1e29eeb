#!/usr/bin/env bash
# Issue 24 on one H200: an A/B of one engine switch on the rollout workload, in A B B A order in one call
# (the first run on a fresh machine is the slowest: docs/status.md), one JSON line per run.
#
#   scripts/rollout_ab.sh OUTDIR SHAPE MODE "A_ENV" "B_ENV" [bench_rollout flags...]
#   scripts/rollout_ab.sh $OUT qwen2.5-7b seeded "SIDECAR_GEMV_MAX_ROWS=1" "SIDECAR_GEMV_MAX_ROWS=8"
#
# Writes OUTDIR/ab.jsonl (each line gains "ab": "A" or "B" and "env") and prints tok/s, ms per step and
# the by-batch times per run; OUTDIR/ab.log holds stderr. About 90 s per 7B run, 25 s per 0.5B run,
# 150 s per 7B run with a draft; ROLLOUT_TIMEOUT (default 200) bounds each run.
set -uo pipefail

out="${1:?OUTDIR}"; shape="${2:?SHAPE}"; mode="${3:?MODE}"; a_env="${4:?A_ENV}"; b_env="${5:?B_ENV}"
extra=("${@:6}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

one() {  # label, env assignments
    env $2 timeout "${ROLLOUT_TIMEOUT:-200}" python3 -m scripts.bench_rollout --shapes "$shape" --modes "$mode" "${extra[@]}" 2>>"$out/ab.log" \
        | python3 -c '
import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        row = json.loads(line)
        row.update(ab=sys.argv[1], env=sys.argv[2])
        print(json.dumps(row))
        print(sys.argv[1], sys.argv[2], row["tok_s"], row["ms_per_step"], row["by_batch"], file=sys.stderr)
' "$1" "$2" >>"$out/ab.jsonl"
}

: >"$out/ab.jsonl"
one A "$a_env"; one B "$b_env"; one B "$b_env"; one A "$a_env"
