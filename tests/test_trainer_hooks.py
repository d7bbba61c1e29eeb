"""trainer_hooks: weight sources (plain, wrapped, FSDP2, DeepSpeed), the hook's counting and failure rules
(with a fake client), the HF callback, and one real sync through a sidecar checked against transformers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checksum import Manifest, manifest_from_tensors
from inference.core import SamplingParams, SidecarError
from inference.models.tiny import TinyModelSpec, default_model_dir, random_weights
from tests.helpers_tp import free_port
from trainer_hooks import AuditError, SidecarGoneError, WeightSyncHook, collect_weights, normalize_name
from trainer_hooks.toy_policy import ToyPolicy

RANK = "dp0:pp0:tp0"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_model_dir()


def _manifest(named: list[tuple[str, torch.Tensor]]) -> Manifest:
    return manifest_from_tensors(named, model="target", weight_version=1, rank=RANK)


# ---- sources ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_toy_policy_logits_equal_transformers(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    policy = ToyPolicy.from_dir(model_dir).eval()
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(policy(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert [n for n, _ in collect_weights(policy)] == [n for n, _ in collect_weights(ref)]


def test_names_are_normalized_through_wrappers_and_tied_head_is_sent_once(model_dir: Path) -> None:
    policy = ToyPolicy.from_dir(model_dir)
    plain = collect_weights(policy)
    names = [n for n, _ in plain]
    assert "lm_head.weight" not in names and names[0] == "model.embed_tokens.weight"  # tied: once, as embedding

    class DDPLike(nn.Module):  # DDP and DeepSpeed keep the model as `.module`
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    for wrapped in (DDPLike(policy), torch.compile(policy), DDPLike(torch.compile(policy))):
        assert _manifest(collect_weights(wrapped)) == _manifest(plain)
    assert normalize_name("module._orig_mod.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module."
                          "mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"


def _fsdp2_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        policy = ToyPolicy.from_dir(model_dir)
        mesh = init_device_mesh("cpu", (2,))
        for layer in policy.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(policy, mesh=mesh)
        assert type(policy.model.embed_tokens.weight).__name__ == "DTensor"
        named = collect_weights(policy, keep=rank == 0)
        if rank == 0:
            _manifest(named).save(out)
        else:
            assert named == []  # took part in every all-gather, kept nothing
        torch.distributed.barrier()  # leave together: a rank exiting alone can abort in gloo's teardown
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_source_matches_the_plain_module(model_dir: Path, tmp_path: Path) -> None:
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not in this torch")
    out = tmp_path / "fsdp2.json"
    torch.multiprocessing.spawn(_fsdp2_worker, args=(free_port(), str(model_dir), str(out)), nprocs=2)
    assert Manifest.load(out) == _manifest(collect_weights(ToyPolicy.from_dir(model_dir)))


def test_deepspeed_zero3_source_matches_the_plain_module(model_dir: Path) -> None:
    deepspeed = pytest.importorskip("deepspeed")
    policy = ToyPolicy.from_dir(model_dir)
    want = _manifest(collect_weights(policy))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3},
              # torch_adam: no fused op to JIT-compile (the wheel is built without ops)
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=config)
    assert _manifest(collect_weights(engine, group_bytes=100_000)) == want


# ---- the hook with a fake client ---------------------------------------------------------------------


class FakeClient:
    """Records calls; sync_weights answers from `reports` (default: ok)."""

    def __init__(self, reports: list[Any] | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.reports = list(reports or [])

    def state(self) -> dict[str, Any]:
        return {"weight_versions": {"target": 4}, "transfer": {"num_receivers": 1, "bucket_bytes": 1 << 20}}

    def sleep(self, level: int) -> dict[str, Any]:
        self.calls.append(("sleep", level))
        return {}

    def wake_up(self, tags: list[str] | None) -> dict[str, Any]:
        self.calls.append(("wake_up", tags))
        return {}

    def sync_weights(self, sender: Any, named: Any, version: int, model: str = "target", **kw: Any) -> dict[str, Any]:
        self.calls.append(("sync", (model, version)))
        report = self.reports.pop(0) if self.reports else {"ok": True, "table": ""}
        if isinstance(report, Exception):
            raise report
        return report

    def generate(self, prompts: Any, sampling: Any) -> list[Any]:
        self.calls.append(("generate", len(prompts)))
        return []

    def syncs(self) -> list[tuple[str, int]]:
        return [c[1] for c in self.calls if c[0] == "sync"]


@pytest.fixture
def tiny() -> nn.Module:
    return nn.Linear(4, 3)


def test_grad_accum_and_sync_every_decide_when_to_sync(tiny: nn.Module) -> None:
    client = FakeClient()
    hook = WeightSyncHook(client, tiny, grad_accum_steps=2, sync_every=3)
    hook._sender = object()  # type: ignore[assignment]  # the fake client never uses it
    synced_at = [i for i in range(1, 13) if hook.after_optimizer_step() is not None]
    assert synced_at == [6, 12]  # optimizer steps at calls 2,4,..; every 3rd of those syncs
    assert hook.optimizer_steps == 6 and client.syncs() == [("target", 5), ("target", 6)]
    assert hook.version == 6


def test_training_context_sleeps_syncs_then_rollouts_wake_the_kv_cache(tiny: nn.Module) -> None:
    client = FakeClient()
    hook = WeightSyncHook(client, tiny, draft_model=nn.Linear(2, 2), sleep_level=2)
    hook._sender = object()  # type: ignore[assignment]
    with hook.training():
        pass
    hook.rollouts([[1, 2]], SamplingParams(max_tokens=2))
    assert client.calls == [("sleep", 2), ("wake_up", ["weights"]), ("sync", ("target", 5)),
                            ("sync", ("draft", 5)), ("wake_up", ["kv_cache"]), ("generate", 1)]


def test_audit_mismatch_raises_with_the_table_or_retries_once(tiny: nn.Module) -> None:
    bad = {"ok": False, "summary": "1 mismatch", "table": "rank dp0:pp0:tp0  weight  digest differs"}
    hook = WeightSyncHook(FakeClient([bad]), tiny)
    hook._sender = object()  # type: ignore[assignment]
    with pytest.raises(AuditError) as e:
        hook.after_optimizer_step()
    assert "digest differs" in str(e.value) and e.value.table == bad["table"]

    client = FakeClient([bad, {"ok": True}])
    hook = WeightSyncHook(client, tiny, retry_on_mismatch=True)
    hook._sender = object()  # type: ignore[assignment]
    assert hook.after_optimizer_step() == {"ok": True}
    assert client.syncs() == [("target", 5), ("target", 6)] and hook.version == 6


def test_only_the_sending_rank_talks_to_the_sidecar(tiny: nn.Module) -> None:
    client = FakeClient()
    hook = WeightSyncHook(client, tiny, rank=1)
    with hook.training():
        pass
    assert hook.rollouts([[1]]) == [] and client.calls == [] and hook.syncs == 1


def test_a_dead_sidecar_is_reported_with_its_log_tail(tiny: nn.Module, tmp_path: Path) -> None:
    from trainer_hooks.client import SidecarConnectionError

    log = tmp_path / "sidecar.log"
    log.write_text("starting\nrank 0 died: CUDA error: out of memory\n")

    class Dead(FakeClient):
        def sleep(self, level: int) -> dict[str, Any]:
            raise SidecarConnectionError("POST http://127.0.0.1:1/sleep: ConnectError")

    with pytest.raises(SidecarGoneError) as e:
        WeightSyncHook(Dead(), tiny, log_path=log).before_training()
    assert "ConnectError" in str(e.value) and "rank 0 died" in str(e.value)
    assert isinstance(e.value, SidecarError)


def test_the_hook_tells_the_clients_errors_apart_by_class(tiny: nn.Module) -> None:
    from trainer_hooks.client import SidecarChecksumError, SidecarStateError, SidecarUnavailableError

    mismatch = SidecarChecksumError(409, "ChecksumMismatch", "rank dp0:pp0:tp0: tensor 'weight' differs")
    client = FakeClient([mismatch, {"ok": True}])  # the per-rank audit at finish fails once
    hook = WeightSyncHook(client, tiny, retry_on_mismatch=True)
    hook._sender = object()  # type: ignore[assignment]
    assert hook.after_optimizer_step() == {"ok": True} and client.syncs() == [("target", 5), ("target", 6)]
    hook = WeightSyncHook(FakeClient([mismatch]), tiny)
    hook._sender = object()  # type: ignore[assignment]
    with pytest.raises(AuditError) as audit:
        hook.after_optimizer_step()
    assert "tensor 'weight' differs" in audit.value.table

    # Any other 409 is not a mismatch (even one whose type string says so), and a 503 is a dead sidecar.
    for error, raised in ((SidecarStateError(409, "ChecksumMismatch", "asleep"), SidecarStateError),
                          (SidecarUnavailableError(503, "RankFailure", "rank 1 died"), SidecarGoneError)):
        hook = WeightSyncHook(FakeClient([error]), tiny, retry_on_mismatch=True)
        hook._sender = object()  # type: ignore[assignment]
        with pytest.raises(raised):
            hook.after_optimizer_step()


def test_hf_callback_drives_the_hook(tiny: nn.Module) -> None:
    pytest.importorskip("transformers")
    from trainer_hooks.hf_callback import sidecar_callback

    client = FakeClient()
    hook = WeightSyncHook(client, tiny, sync_every=2)
    hook._sender = object()  # type: ignore[assignment]
    cb = sidecar_callback(hook)
    cb.on_train_begin(None, None, None)
    for _ in range(3):
        cb.on_step_end(None, None, None)
    cb.on_train_end(None, None, None)
    assert client.syncs() == [("target", 5), ("target", 6)]  # step 2, then the final step 3
    assert client.calls[0] == ("sleep", 1) and client.calls[-1] == ("wake_up", ["kv_cache"])


# ---- a real sidecar ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from tests.helpers_sidecar import launch

    proc = launch()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.slow
def test_sync_through_the_hook_matches_transformers_greedy(server: Any, model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from trainer_hooks.client import SidecarClient

    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    new = random_weights(TinyModelSpec(seed=7))
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.copy_(new[name])
    prompt = [11, 12, 13, 14, 15]
    want = _greedy(trainer, prompt, 8)
    with SidecarClient(server.url, timeout=60) as client, \
            WeightSyncHook(client, torch.compile(trainer), log_path=server.log_path) as hook:
        with hook.training():
            pass  # the "training" already happened: the new weights above
        assert hook.stats["audit"] == "ok" and hook.stats["audit_ms"] > 0  # the ranks' part of the sync
        out = hook.rollouts([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert out[0].outputs[0].token_ids == want
        assert out[0].weight_version == hook.version == client.state()["weight_versions"]["target"]


def _greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()
