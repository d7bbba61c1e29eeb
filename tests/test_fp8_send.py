"""FP8 on send (WeightSender(send_fp8=True)): the trainer quantizes the linears and sends values and row
scales. A rank installs exactly the bytes a rank that quantizes on receive installs; the linears take about
half of bf16's bytes on the wire; a flipped payload byte fails the audit naming tensor and rank; a model
not in FP8 refuses a payload; a delta of the payload composes. In a sync that delivers its digests the
sender also delivers what every FP8 rank must have installed (the rule applied to its own tensors, on
send and on receive alike): a good rank checks every installed tensor before it goes live, and a rank
whose installed bytes are not the rule's never goes live, even though its own audits pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checksum import ChecksumMismatch
from inference.config import EngineConfig
from inference.core import InvalidRequestError, SamplingParams, StateError
from inference.engine.worker import Worker
from inference.quant.installed import is_fp8_linear
from inference.transfer.fp8_payload import payload_specs
from inference.transfer.plan import TensorSpec
from inference.transfer.sender import WeightSender
from inference.weights.installed import fp8_layers
from tests.helpers_fault import flipped_on_arrival, skew_installed
from tests.helpers_weight_update import Q1, RANK, Link, perturbed, tiny_model_dirs
from trainer_hooks import WeightSyncHook
from trainer_hooks.toy_policy import ToyPolicy

D0 = "model.layers.0.mlp.down_proj.weight"  # a row-parallel linear (its scales whole on every TP rank)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_model_dirs(tmp_path_factory.mktemp("fp8_send_models"))


def worker_of(dirs: dict[str, Path], dtype: str = "float32", quantization: str = "fp8",
              draft_quantization: str | None = None) -> Worker:
    worker = Worker(EngineConfig(model=str(dirs["target"]), draft_model=str(dirs["draft"]), device="cpu",
                                 dtype=dtype, quantization=quantization, draft_quantization=draft_quantization))
    worker.init_device()
    worker.load_model()
    return worker


def installed_bytes(worker: Worker, which: str = "target") -> dict[str, bytes]:
    """Every tensor the model computes with, FP8 weights and their scales included, as raw bytes."""
    model = worker.models[which]
    out = {name: p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
           for name, p in model.named_parameters()}
    for name, layer in fp8_layers(model).items():
        out[name + "_scale"] = layer.weight_scale.cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_send_side_and_receive_side_quantization_install_the_same_bytes(dirs: dict[str, Path], dtype: str) -> None:
    state = perturbed(dirs["target"], 80, getattr(torch, dtype))
    on_send, on_receive = worker_of(dirs, dtype), worker_of(dirs, dtype)
    sent = Link(on_send, send_fp8=True).sync(state, 1)
    received = Link(on_receive).sync(state, 1)
    assert sent.report.ok and received.report.ok
    assert installed_bytes(on_send) == installed_bytes(on_receive)
    # what the sender's digests covered is the FP8 payload itself, and the rank reports what it installed
    assert Q1 + ":fp8" in {r.name for r in sent.received.records} and Q1 not in {r.name for r in sent.received.records}
    assert sorted(sent.installed, key=lambda r: r.name) == sorted(received.installed, key=lambda r: r.name)
    linears = [n for n in state if is_fp8_linear(n)]
    assert len(sent.installed) == 2 * len(linears) > 0


def test_fp8_on_send_halves_the_linears_bytes_on_the_wire(dirs: dict[str, Path]) -> None:
    state = perturbed(dirs["target"], 81, torch.bfloat16)
    link = Link(worker_of(dirs, "bfloat16"), send_fp8=True)
    assert link.sync(state, 1, fp8=False).report.ok
    bf16 = dict(link.sender.last_sync)
    assert link.sync(state, 2).report.ok
    fp8 = dict(link.sender.last_sync)
    assert (bf16["fp8"], fp8["fp8"]) == (False, True)
    assert bf16["source_bytes"] == fp8["source_bytes"] == bf16["wire_bytes"]
    linears = {n: t.shape for n, t in state.items() if is_fp8_linear(n)}
    bf16_linears = sum(2 * n * k for n, k in linears.values())
    fp8_linears = sum(n * k + 4 * n for n, k in linears.values())  # the values, then one fp32 scale per row
    assert fp8["wire_bytes"] == bf16["wire_bytes"] - bf16_linears + fp8_linears
    assert 0.5 < fp8_linears / bf16_linears < 0.55  # K = 64 or 96 here: (K + 4) / 2K


@pytest.mark.parametrize("part", ["fp8", "scale"])
def test_a_flipped_payload_byte_on_the_wire_fails_the_audit_naming_tensor_and_rank(
        dirs: dict[str, Path], part: str) -> None:
    worker = worker_of(dirs)
    link = Link(worker, send_fp8=True)
    with flipped_on_arrival(f"{Q1}:{part}"), pytest.raises(ChecksumMismatch) as err:
        link.sync(perturbed(dirs["target"], 82), 1)
    first = err.value.report.first_tensor
    assert (first.kind, first.tensor, first.rank) == ("digest", f"{Q1}:{part}", RANK)
    assert worker.weights.torn["target"] and worker.weights.versions["target"] == 0
    assert link.sync(perturbed(dirs["target"], 83), 2).report.ok  # a good sync heals it


@pytest.mark.parametrize("send_fp8", [False, True])
def test_every_fp8_rank_checks_its_installed_bytes_against_the_senders_rule_before_going_live(
        dirs: dict[str, Path], send_fp8: bool) -> None:
    """The sender applies the rule to its own tensors (quantizing them once more on receive's behalf, or
    taking its payload) and delivers the rank's expected installed digests in the sync: every installed
    tensor is checked before the version goes live. A sender made with check_installed=False delivers
    none: the rank then goes live on its own two audits."""
    state = perturbed(dirs["target"], 84)
    worker = worker_of(dirs)
    link = Link(worker, send_fp8=send_fp8)
    linears = [n for n in state if is_fp8_linear(n)]
    for version in (1, 2):  # the second sync reuses the parsed manifest and the routing
        result = link.sync(state, version, deliver=True)
        assert result.report.ok and result.installed_checked == 2 * len(linears) == len(result.installed)
    assert link.sync(state, 3).installed_checked == 0  # the two-call way: finish takes the records alone
    link.sender.close()
    opted_out = Link(worker, send_fp8=send_fp8, check_installed=False).sync(state, 4, deliver=True)
    assert opted_out.report.ok and opted_out.installed_checked == 0


def test_a_rank_that_installs_other_bytes_never_goes_live(dirs: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank quantizes D0 from a skewed copy: its own audits pass (it received the true bytes and holds
    what it computed), the sender's expected installed digests do not. The sync fails naming the tensor and
    the rank, the model is torn from then on (no rollout is served from it), and a good sync heals it."""
    from inference.engine.llm import LLM

    llm = LLM(dirs["target"], quantization="fp8", device="cpu", dtype="float32", block_size=4, kv_cache_bytes=2 << 20)
    link = Link(llm.worker)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert link.sync(perturbed(dirs["target"], 95), 1, deliver=True).report.ok
    assert llm.generate([[5, 17, 33]], greedy)[0].weight_version == 1
    skew_installed(monkeypatch, D0)
    with pytest.raises(ChecksumMismatch) as err:
        link.sync(perturbed(dirs["target"], 96), 2, deliver=True)
    first = err.value.report.first_tensor
    assert (first.kind, first.rank) == ("digest", RANK) and first.tensor in (D0 + ":fp8", D0 + ":scale")
    assert D0 in str(err.value) and RANK in str(err.value)
    weights = llm.worker.weights
    assert weights.torn["target"] and weights.versions["target"] == 1 and not weights.is_servable("target")
    with pytest.raises(StateError, match="sync the weights first"):
        llm.generate([[5, 17, 33]], greedy)
    monkeypatch.undo()
    assert link.sync(perturbed(dirs["target"], 97), 3, deliver=True).installed_checked > 0
    assert llm.generate([[5, 17, 33]], greedy)[0].weight_version == 3


def test_a_sender_that_cannot_compute_the_expected_digests_leaves_the_rank_torn(
        dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's computation fails (here: injected): its section says so, the rank that asked for it
    fails its audit naming itself and goes live with nothing, and send() raises the sender's error."""
    from concurrent.futures import ThreadPoolExecutor

    worker = worker_of(dirs)
    link = Link(worker)
    state = perturbed(dirs["target"], 98)

    def boom(*args: object) -> bytes:
        raise RuntimeError("quantization failed on the trainer")

    monkeypatch.setattr(link.sender._expected, "_section", boom)
    worker.weights.start("target", 1, link.sender.manifest(state, 1))
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(link.sender.send, state, deliver_digests=True)
        delivered = worker.weights.update(digests_follow=True)
        with pytest.raises(RuntimeError, match="quantization failed on the trainer"):
            sending.result(timeout=60)
    with pytest.raises(StateError, match=f"rank {RANK}: the sender could not compute the installed FP8 digests"):
        worker.weights.finish(delivered)
    assert worker.weights.torn["target"] and worker.weights.versions["target"] == 0
    monkeypatch.undo()
    assert link.sync(state, 2, deliver=True).installed_checked > 0  # the group is still usable


def test_a_payload_into_a_model_not_in_fp8_is_refused_naming_the_tensor(dirs: dict[str, Path]) -> None:
    """Target in FP8, draft in the model dtype: the draft refuses a payload before any byte moves and takes
    its tensors unquantized; the target takes the payload. And the other way round."""
    for quantization, draft_quantization, fp8_model in (("fp8", "none", "target"), ("none", "fp8", "draft")):
        worker = worker_of(dirs, quantization=quantization, draft_quantization=draft_quantization)
        link = Link(worker, send_fp8=True)
        other = "draft" if fp8_model == "target" else "target"
        state = perturbed(dirs[other], 85)
        first_linear = next(n for n in state if is_fp8_linear(n))
        with pytest.raises(InvalidRequestError) as err:
            link.sync(state, 1, which=other)
        assert err.value.field == first_linear + ":fp8"
        assert RANK in str(err.value) and f"the {other} model is not in fp8 mode" in str(err.value)
        assert not worker.weights.torn[other] and worker.weights.versions[other] == 0  # nothing written
        assert link.sync(state, 1, which=other, fp8=False, deliver=True).installed_checked == 0  # none installed
        assert link.sync(perturbed(dirs[fp8_model], 86), 1, which=fp8_model, deliver=True).installed_checked > 0


def test_fp8_on_send_is_negotiated_at_init(dirs: dict[str, Path]) -> None:
    """A sidecar holding no FP8 model refuses a sender that quantizes on send; a session that did not
    negotiate it refuses a payload; a sender made without it will not make one."""
    plain = worker_of(dirs, quantization="none")
    sender = WeightSender("gloo", timeout_s=5, send_fp8=True)
    try:
        with pytest.raises(InvalidRequestError) as err:
            plain.weights.init_transfer(sender.init_info())
        assert err.value.field == "init_info.send_fp8" and RANK in str(err.value)
    finally:
        sender.close()
    worker = worker_of(dirs)
    link = Link(worker)
    state = perturbed(dirs["target"], 87)
    with pytest.raises(InvalidRequestError) as err:
        link.sender.manifest(state, 1, fp8=True)
    assert err.value.field == "fp8"
    specs = payload_specs([TensorSpec.of(n, t) for n, t in state.items()])
    with pytest.raises(InvalidRequestError) as err:
        worker.weights.start("target", 1, {"version": 1, "tensors": [s.to_dict() for s in specs]})
    assert err.value.field.endswith(":fp8") and "send_fp8=True" in str(err.value)


def test_a_manifest_with_half_a_payload_or_a_misshapen_one_is_refused_naming_the_tensor(dirs: dict[str, Path]) -> None:
    worker = worker_of(dirs)
    Link(worker, send_fp8=True)
    specs = payload_specs([TensorSpec.of(n, t) for n, t in perturbed(dirs["target"], 88).items()])
    half = [s for s in specs if s.name != Q1 + ":scale"]
    with pytest.raises(InvalidRequestError) as err:
        worker.weights.start("target", 1, {"version": 1, "tensors": [s.to_dict() for s in half]})
    assert err.value.field == Q1 + ":scale" and "missing" in str(err.value)
    fp16_scales = [TensorSpec(s.name, "float16", s.shape) if s.name == Q1 + ":scale" else s for s in specs]
    with pytest.raises(InvalidRequestError) as err:
        worker.weights.start("target", 1, {"version": 1, "tensors": [s.to_dict() for s in fp16_scales]})
    assert err.value.field == Q1 + ":scale" and "float32" in str(err.value) and RANK in str(err.value)
    assert not worker.weights.torn["target"]


def test_a_delta_of_the_fp8_payload_installs_what_a_full_sync_installs(dirs: dict[str, Path]) -> None:
    """A delta compares the payload bitwise (values and scales) against the sender's copy of the last one:
    a row whose scale moved sends its changed values, the rest only what the rule's rounding moved. The
    result is the receive-side rank's bytes, proven by the full digests as any delta is."""
    state = perturbed(dirs["target"], 89)
    gen = torch.Generator().manual_seed(90)
    stepped = {n: t + 1e-4 * (torch.rand(t.shape, generator=gen) < 0.02) * torch.randn(t.shape, generator=gen)
               for n, t in state.items()}
    delta_worker, full_worker = worker_of(dirs), worker_of(dirs)
    link = Link(delta_worker, send_fp8=True, delta=True)
    assert link.sync(state, 1, deliver=True).report.ok and link.sender.last_sync["mode"] == "full"
    assert link.sync(stepped, 2, deliver=True).installed_checked > 0  # the full payload's expected digests
    sync = link.sender.last_sync
    assert (sync["mode"], sync["fp8"]) == ("delta", True) and sync["wire_bytes"] < sync["full_bytes"] / 4
    assert Link(full_worker).sync(stepped, 1).report.ok
    assert installed_bytes(delta_worker) == installed_bytes(full_worker)


# ---- a real sidecar, synced by WeightSyncHook ------------------------------------------------------------
def trained_policy(model_dir: Path, seed: int) -> ToyPolicy:
    """The checkpoint's policy after a 'training step': every weight moved by seeded noise."""
    policy = ToyPolicy.from_dir(model_dir).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return policy


@pytest.mark.slow
def test_a_hook_sends_fp8_for_the_fp8_target_and_unquantized_for_the_draft(dirs: dict[str, Path]) -> None:
    """--quantization fp8 --draft-quantization none: the init answers that only the target takes FP8, so
    the hook's sender quantizes the target's linears and sends the draft as it is; both audits pass, and
    the rank checks the target's installed digests against the sender's before going live."""
    from tests.helpers_sidecar import launch
    from trainer_hooks.client import SidecarClient

    target, draft = trained_policy(dirs["target"], 91), trained_policy(dirs["draft"], 92)
    server = launch("--model", str(dirs["target"]), "--draft-model", str(dirs["draft"]), "--dtype", "float32",
                    "--quantization", "fp8", "--draft-quantization", "none")
    try:
        with SidecarClient(server.url, timeout=60) as client, \
                WeightSyncHook(client, target, draft_model=draft, send_fp8=True, log_path=server.log_path) as hook:
            with hook.training():
                pass
            assert hook.stats["audit"] == "ok" and hook.stats["installed_checked"] > 0
            assert client.weights.fp8_models == {"target"}
            received = {m: {r["name"] for man in client.checksums(m, "received") for r in man["tensors"]}
                        for m in ("target", "draft")}
            assert Q1 + ":fp8" in received["target"] and Q1 not in received["target"]
            assert not any(":" in name for name in received["draft"])
            out = hook.rollouts([[5, 17, 33], [100, 3]], SamplingParams(temperature=0.0, max_tokens=6))
            assert all(o.weight_version == hook.version for o in out)
            synced = hook.version
        # a trainer that comes back attaches without a sync: what the target received was the FP8 payload
        # of these weights, and the new hook's check says so
        with SidecarClient(server.url, timeout=60) as client, \
                WeightSyncHook(client, target, sync_on_attach=False, send_fp8=True) as hook:
            assert hook.rollouts([[5, 17, 33]], SamplingParams(temperature=0.0, max_tokens=2))
            assert hook.version == synced and hook.syncs == 0
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_sent_by_a_hook_generates_what_the_offline_quantized_engine_does(tmp_path: Path, tp: int) -> None:
    """At TP=2 each rank installs its rows or columns of the payload and checks them, before going live,
    against the sender's shares of the rule's output: both pass."""
    from safetensors.torch import save_file

    from inference.engine.llm import LLM
    from inference.models.tiny import default_model_dir
    from tests.helpers_sidecar import launch
    from tests.test_fp8_engine import dequantized_copy
    from trainer_hooks import collect_weights
    from trainer_hooks.client import SidecarClient

    model_dir = default_model_dir()
    policy = trained_policy(model_dir, 93)
    trained = tmp_path / "trained"
    trained.mkdir()
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (trained / f.name).write_bytes(f.read_bytes())
    save_file({n: t.detach().contiguous() for n, t in collect_weights(policy)}, str(trained / "model.safetensors"))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[11, 12, 13, 14, 15], [40, 2, 7]]
    offline = LLM(dequantized_copy(trained, tmp_path / "deq"), device="cpu", dtype="float32")
    want = [o.outputs[0].token_ids for o in offline.generate(prompts, greedy)]

    server = launch("--quantization", "fp8", "--tp", str(tp))
    try:
        with SidecarClient(server.url, timeout=60) as client, \
                WeightSyncHook(client, policy, send_fp8=True, log_path=server.log_path) as hook:
            with hook.training():
                pass
            linears = sum(is_fp8_linear(n) for n, _ in collect_weights(policy))
            assert hook.stats["audit"] == "ok" and hook.stats["installed_checked"] == 2 * linears * tp
            assert hook._sender is not None and hook._sender.last_sync["fp8"]
            assert [o.outputs[0].token_ids for o in hook.rollouts(prompts, greedy)] == want
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_sidecar_rank_that_installs_other_bytes_never_serves_them(tp: int) -> None:
    """The last rank quantizes one tensor from a skewed copy (tests/fault_injection): its own audits pass,
    the sender's expected installed digests do not, so it never goes live, and with it no TP rank: the hook
    raises AuditError naming the tensor and that rank, every rank is torn, and no rollout is served."""
    from inference.core import SidecarError
    from inference.models.tiny import default_model_dir
    from tests.helpers_fault import skew_env
    from tests.helpers_sidecar import launch
    from trainer_hooks.client import SidecarClient
    from trainer_hooks.hook import AuditError

    skewed = f"dp0:pp0:tp{tp - 1}"
    policy = trained_policy(default_model_dir(), 94)
    server = launch("--quantization", "fp8", "--tp", str(tp), env=skew_env(D0, skewed))
    try:
        with SidecarClient(server.url, timeout=60) as client, \
                WeightSyncHook(client, policy, log_path=server.log_path) as hook:
            with pytest.raises(AuditError) as err, hook.training():
                pass
            assert D0 in str(err.value) and skewed in str(err.value)
            ranks = client.state()["ranks"]
            assert len(ranks) == tp and all(r["torn"]["target"] and r["weight_versions"]["target"] == 0 for r in ranks)
            client.wake_up()
            with pytest.raises(SidecarError, match="sync the weights first"):
                client.generate([[5, 17, 33]], SamplingParams(temperature=0.0, max_tokens=2))
    finally:
        server.stop()
