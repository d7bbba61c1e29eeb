"""Three sidecar processes (TP=2, TP=1, TP=1) take one sync from one trainer over gloo: every rank
received the sender's bytes, every rank holds what loading the new checkpoint gives its shard (so
replicas of one layout agree rank by rank), and all generate what a fresh load generates. The nccl
twin is in tests/test_multigpu_cuda.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from checksum import digest_tensors
from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import TinyModelSpec, random_weights, write_model_dir
from inference.transfer.sender import WeightSender
from sidecar.client import SidecarClient
from tests.helpers_sidecar import (
    KV_BYTES,
    Sidecar,
    connect_replicas,
    digests_by_rank,
    launched,
    loader_digests,
    sync_replicas,
)

pytestmark = pytest.mark.slow  # every test here starts real processes or runs for seconds

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["Two mills on one river", [21, 22, 23, 24, 25]]
RANK = "dp0:pp0:tp0"


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[Sidecar]]:
    with launched(("--tp", "2"), (), ()) as servers:
        yield servers


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_one_sync_reaches_every_replica_and_their_checksums_agree(replicas: list[Sidecar], tmp_path: Path) -> None:
    spec = TinyModelSpec(seed=4)
    new = random_weights(spec)
    model_dir = write_model_dir(spec, tmp_path / "v1")
    want = _tokens(LLM(model_dir, device="cpu", kv_cache_bytes=KV_BYTES).generate(PROMPTS, GREEDY))
    clients = [SidecarClient(s.url, timeout=60) for s in replicas]
    sender = WeightSender("gloo", num_receivers=4, timeout_s=60)
    try:
        assert all(_tokens(c.generate(PROMPTS, GREEDY)) != want for c in clients)  # the sync must show
        connect_replicas(clients, sender)
        audits = sync_replicas(clients, sender, new, version=1)
        assert [a["ok"] for a in audits] == [True] * 3, [a["table"] for a in audits]
        assert [a["ranks"] for a in audits] == [[RANK, "dp0:pp0:tp1"], [RANK], [RANK]]
        sent = {r.name: r.digest for r in digest_tensors(list(new.items()))}
        received = [digests_by_rank(c, "received") for c in clients]
        assert all(per_tensor == sent for r in received for per_tensor in r.values())
        held = [digests_by_rank(c, "held") for c in clients]
        assert held[1] == held[2] == loader_digests(model_dir)
        assert held[0] == loader_digests(model_dir, tp_size=2)
        assert held[0][RANK] != held[0]["dp0:pp0:tp1"]
        for c in clients:
            got = c.generate(PROMPTS, GREEDY)
            assert _tokens(got) == want and {o.weight_version for o in got} == {1}
    finally:
        sender.close()
        for c in clients:
            c.close()
