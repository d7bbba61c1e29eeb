"""A replica's --dp-rank reaches its rank processes: their rank keys (checksums, audits, logs) say dp{I}."""

from __future__ import annotations

from inference.engine.llm import LLM
from inference.models.tiny import default_model_dir
from sidecar.config import build_config
from sidecar.ranks.pool import RankPool


def test_launch_dp_rank_is_in_every_rank_spec() -> None:
    cfg = build_config({"dp_rank": 3, "tp": 2, "device": "cpu"}, env={})
    pool = RankPool(cfg, str(default_model_dir()), "cpu")
    try:
        assert [spec.dp_rank for spec in pool._specs] == [3, 3]
    finally:
        pool.close()


def test_an_engine_built_with_a_dp_rank_keys_its_checksums_with_it() -> None:
    llm = LLM(None, dp_rank=2)
    try:
        assert llm.worker.rank_key == "dp2:pp0:tp0"
    finally:
        llm.worker.shutdown()
