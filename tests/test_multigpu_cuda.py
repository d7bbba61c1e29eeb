"""Several GPUs (issue #10): the trainer on cuda:0 of this process, sidecars placed on the other GPUs
with `--devices`, weights over nccl.

- a TP=1 sidecar on GPU 1 takes a sync and serves what a fresh load of the new weights serves;
- TP=2 on GPUs 1 and 2: each rank holds what loading gives its shard, greedy output equals TP=1;
- replicas on the remaining GPUs take one sync and hold the same digests;
- a sender SIGKILLed mid-update leaves the sidecar alive and torn; a new init and sync recover it.
The gloo twins run on the CPU: tests/test_client.py, tests/test_replicas.py (TP=2 and TP=1 replicas),
tests/test_sidecar_dead_sender.py (the same killed-sender check) and tests/test_weight_update.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checksum import DEVICE_ALGORITHM, digest_tensors
from inference.core import SamplingParams
from inference.engine.llm import LLM
from inference.models.tiny import TinyModelSpec, random_weights, write_model_dir
from inference.transfer.sender import WeightSender
from sidecar.client import SidecarClient
from tests.helpers_sidecar import (
    KV_BYTES,
    check_killed_sender_recovers,
    connect_replicas,
    digests_by_rank,
    launch,
    launched,
    loader_digests,
    sync_replicas,
)

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The river ran slowly past the old mill", [7, 8, 9, 10, 11]]
BUCKET = 256 << 10  # the tiny model's 2 MB travel in 8 buckets
DEAD_SENDER_TIMEOUT_S = 20.0  # how long the sidecar waits for a silent sender's next bucket
ONE_RANK_MIB = 64  # a rank's CUDA context alone takes several times this on the GPU it runs on


def needs(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


def sidecar_args(devices: str) -> tuple[str, ...]:
    tp = str(len(devices.split(",")))
    return ("--device", "cuda", "--devices", devices, "--tp", tp, "--dtype", "float32", "--transfer", "nccl")


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _on_gpu0(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to("cuda:0") for k, v in named.items()}


def _reference(spec: TinyModelSpec, out: Path) -> tuple[Path, list[list[int]]]:
    """The checkpoint of `spec` and what a fresh TP=1 load of it generates (in this process, cuda:0)."""
    model_dir = write_model_dir(spec, out)
    llm = LLM(model_dir, device="cuda", dtype="float32", kv_cache_bytes=KV_BYTES)
    want = _tokens(llm.generate(PROMPTS, GREEDY))
    del llm
    torch.cuda.empty_cache()
    return model_dir, want


def _used_mib(indices: list[int]) -> list[float]:
    """Device-wide memory in use on each GPU, every process counted (cudaMemGetInfo)."""
    used = []
    for i in indices:
        free, total = torch.cuda.mem_get_info(i)
        used.append((total - free) / 2**20)
    return used


def _assert_placed(indices: list[int], before: list[float]) -> None:
    grown = [after - b for after, b in zip(_used_mib(indices), before)]
    assert all(g > ONE_RANK_MIB for g in grown), f"GPUs {indices} grew by {grown} MiB: a rank is missing"


@needs(2)
def test_nccl_sync_into_a_sidecar_on_gpu1_serves_the_new_weights(tmp_path: Path) -> None:
    spec = TinyModelSpec(seed=1)
    model_dir, want = _reference(spec, tmp_path / "v1")
    before = _used_mib([1])
    server = launch(*sidecar_args("1"))
    sender = WeightSender("nccl", num_receivers=1, bucket_bytes=BUCKET, timeout_s=120, device="cuda:0")
    try:
        _assert_placed([1], before)
        with SidecarClient(server.url, timeout=120) as c:
            assert _tokens(c.generate(PROMPTS, GREEDY)) != want  # the sync must show
            c.connect_sender(sender)
            result = c.sync_weights(sender, _on_gpu0(random_weights(spec)), version=1)
            assert result["ok"], result["table"]
            got = c.generate(PROMPTS, GREEDY)
            assert _tokens(got) == want and {o.weight_version for o in got} == {1}
            assert digests_by_rank(c) == loader_digests(model_dir)
            again = c.sync_weights(sender, _on_gpu0(random_weights(TinyModelSpec(seed=5))), version=2)
            assert again["ok"] and c.state()["weight_versions"] == {"target": 2}  # the group is reused
    finally:
        sender.close()
        assert server.stop() == 0, server.log


@needs(3)
def test_tp2_on_gpus_1_2_over_nccl_holds_each_shard_and_equals_tp1(tmp_path: Path) -> None:
    spec = TinyModelSpec(seed=2)
    model_dir, want = _reference(spec, tmp_path / "v1")
    before = _used_mib([1, 2])
    server = launch(*sidecar_args("1,2"))
    sender = WeightSender("nccl", num_receivers=2, bucket_bytes=BUCKET, timeout_s=120, device="cuda:0")
    try:
        _assert_placed([1, 2], before)
        with SidecarClient(server.url, timeout=120) as c:
            c.connect_sender(sender)
            result = c.sync_weights(sender, _on_gpu0(random_weights(spec)), version=1)
            assert result["ok"], result["table"]
            assert result["ranks"] == ["dp0:pp0:tp0", "dp0:pp0:tp1"]
            held = digests_by_rank(c)
            assert held == loader_digests(model_dir, tp_size=2)
            assert held["dp0:pp0:tp0"] != held["dp0:pp0:tp1"]
            assert _tokens(c.generate(PROMPTS, GREEDY)) == want
    finally:
        sender.close()
        assert server.stop() == 0, server.log


@pytest.mark.parametrize("layout", [
    pytest.param(("1", "2"), marks=needs(3), id="tp1+tp1"),
    pytest.param(("1,2", "3"), marks=needs(4), id="tp2+tp1"),
    pytest.param(("1,2", "3,4"), marks=needs(5), id="tp2+tp2"),
])
def test_replicas_take_one_nccl_sync_and_agree(layout: tuple[str, ...], tmp_path: Path) -> None:
    spec = TinyModelSpec(seed=3)
    model_dir, want = _reference(spec, tmp_path / "v1")
    new = random_weights(spec)
    sizes = [len(d.split(",")) for d in layout]
    with launched(*(sidecar_args(d) for d in layout)) as servers:
        clients = [SidecarClient(s.url, timeout=120) for s in servers]
        sender = WeightSender("nccl", num_receivers=sum(sizes), bucket_bytes=BUCKET, timeout_s=120, device="cuda:0")
        try:
            connect_replicas(clients, sender)
            audits = sync_replicas(clients, sender, _on_gpu0(new), version=1)
            assert all(a["ok"] for a in audits), [a["table"] for a in audits]
            sent = {r.name: r.digest for r in digest_tensors(list(new.items()), algorithm=DEVICE_ALGORITHM)}  # cuda:0
            for c in clients:
                assert all(per_tensor == sent for per_tensor in digests_by_rank(c, "received").values())
            held = [digests_by_rank(c) for c in clients]
            for size, digests in zip(sizes, held):
                assert digests == loader_digests(model_dir, tp_size=size)
            for i in range(len(held)):
                for j in range(i):
                    if sizes[i] == sizes[j]:
                        assert held[i] == held[j]
            for c in clients:
                assert _tokens(c.generate(PROMPTS, GREEDY)) == want
        finally:
            sender.close()
            for c in clients:
                c.close()


@needs(2)
def test_sender_killed_mid_update_over_nccl_leaves_the_sidecar_torn_and_a_new_init_recovers(tmp_path: Path) -> None:
    spec = TinyModelSpec(seed=6)
    _, want = _reference(spec, tmp_path / "v2")
    server = launch(*sidecar_args("1"))
    try:
        check_killed_sender_recovers(server, "nccl", "cuda:0", PROMPTS, GREEDY, random_weights(spec), want,
                                     BUCKET, DEAD_SENDER_TIMEOUT_S)
    finally:
        assert server.stop() == 0, server.log
