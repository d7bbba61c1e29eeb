"""The replica rule of an audit, shared by POST /audit and `sidecar audit --url` (no HTTP here).

"received" manifests (what a sync delivered: full tensors, trainer names) must be identical on every
rank. "held" manifests (the parameters a rank holds: its shards, engine names) must be identical
across ranks that hold the same shard: the same pp and tp index, different dp.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from checksum import Manifest, Report, compare_each, parse_rank_key

SOURCES = ("held", "received")


def replica_report(actual: Sequence[Manifest], source: str) -> Report:
    assert source in SOURCES, source
    if not actual:
        return Report.build([], [], 0)
    if source == "received":
        return compare_each(actual[0], list(actual))
    groups: dict[tuple[str, int, int], list[Manifest]] = defaultdict(list)
    for m in actual:
        _, pp, tp = parse_rank_key(m.rank)
        groups[(m.model, pp, tp)].append(m)
    return Report.merge(compare_each(g[0], g) for g in groups.values())
