"""The kept benchmarks: each prints JSON lines (one per case: our figure and, where there is one, the
ceiling or peer measured in the same run and the ratio). docs/benchmarks.md indexes them with their
command lines and keeps their history. Each runs as `python -m scripts.bench.<name>` or as a file from
the checkout; the modules without a main (rollout_cost, experts_touched, sleep_peer, sync_peers,
invariance_fp32) are parts of the benchmarks that import them."""
