"""SidecarClient against a real sidecar: sleep -> wake -> weight sync -> audit with this test process as
the trainer (WeightSender over gloo), torn weights refusing generation, the status and audit CLIs,
and the client's error types and retry rule (against a mock transport)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from checksum import ChecksumMismatch, Manifest, manifest_from_tensors
from inference.core import InvalidRequestError, SamplingParams, StateError
from inference.engine.llm import LLM
from inference.models.tiny import TinyModelSpec, random_weights, write_model_dir
from inference.transfer.sender import WeightSender
from sidecar.cli.main import main
from sidecar.cli.status import format_state
from tests.helpers_sidecar import KV_BYTES, Sidecar, first_digest_wrong, launch
from trainer_hooks.client import (
    SidecarChecksumError,
    SidecarClient,
    SidecarConnectionError,
    SidecarRequestError,
    SidecarStateError,
    records_json,
)
from trainer_hooks.client_errors import CHECKSUM_MISMATCH

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The miller's daughter", [11, 12, 13, 14]]
RANK = "dp0:pp0:tp0"


@pytest.fixture(scope="module")
def server() -> Iterator[Sidecar]:
    proc = launch()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def sender() -> Iterator[WeightSender]:
    s = WeightSender("gloo", num_receivers=1, timeout_s=60)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.slow
def test_sleep_wake_sync_audit_end_to_end(server: Sidecar, sender: WeightSender, tmp_path: Path) -> None:
    spec = TinyModelSpec(seed=1)
    new = random_weights(spec)
    reference = LLM(write_model_dir(spec, tmp_path / "v1"), device="cpu", kv_cache_bytes=KV_BYTES)
    want = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY)]
    with SidecarClient(server.url, timeout=60) as c:
        assert [o.outputs[0].token_ids for o in c.generate(PROMPTS, GREEDY)] != want  # the sync must show
        assert c.sleep(level=2)["state"]["tags"] == {"weights": "asleep_empty", "kv_cache": "asleep_empty"}
        assert c.wake_up(["weights"])["state"]["tags"]["weights"] == "awake"
        c.connect_sender(sender)
        result = c.sync_weights(sender, new, version=1)
        assert result["ok"], result["table"]
        assert result["ranks"] == [RANK] and result["tensors_checked"] >= len(new)
        assert 'sidecar_weight_sync_seconds_count{model="target",phase="audit"}' in c.metrics()
        c.wake_up(["kv_cache"])
        got = c.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in got] == want
        assert {o.weight_version for o in got} == {1}
        state = c.state()
        assert state["weight_versions"] == {"target": 1} and state["torn"] == {"target": False}
        # The sidecar holds exactly the bytes of a fresh load of the trainer's new weights.
        held = manifest_from_tensors(list(reference.worker.models["target"].named_parameters()), model="target",
                                     weight_version=1, rank=RANK)
        assert c.audit(source="held", expected=held.to_dict())["ok"]
        sent = manifest_from_tensors(new, model="target", weight_version=1, rank=RANK)
        flipped = records_json(list(sent.records))
        flipped[3]["digest"] = "0" * 32
        report = c.audit(source="received", expected=flipped)
        assert not report["ok"]
        assert report["mismatches"][0]["tensor"] == flipped[3]["name"] and report["mismatches"][0]["rank"] == RANK
    _check_audit_cli(server.url, sent, tmp_path)


def _check_audit_cli(url: str, sent: Manifest, tmp_path: Path) -> None:
    good, bad = tmp_path / "sent.json", tmp_path / "bad.json"
    sent.save(good)
    data = sent.to_dict()
    data["tensors"][0]["digest"] = "f" * 32
    Manifest.from_dict(data).save(bad)
    assert main(["audit", "--url", url, "--source", "received", str(good)]) == 0
    assert main(["audit", "--url", url, "--source", "received", str(bad)]) == 1
    assert main(["audit", "--url", url]) == 2  # one rank, nothing expected: nothing to compare, never "OK"
    assert main(["audit", "--url", "http://127.0.0.1:1", "--timeout", "2"]) == 2


@pytest.mark.slow
def test_failed_audit_tears_the_model_until_a_good_sync(server: Sidecar, sender: WeightSender,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    weights = random_weights(TinyModelSpec(seed=2))
    with SidecarClient(server.url, timeout=60) as c:
        c.connect_sender(sender)
        first_digest_wrong(monkeypatch)
        with pytest.raises(SidecarChecksumError) as mismatch:
            c.sync_weights(sender, weights, version=2)
        monkeypatch.undo()
        assert isinstance(mismatch.value, SidecarStateError) and mismatch.value.status == 409
        assert mismatch.value.type == "ChecksumMismatch" and mismatch.value.rank == RANK
        assert c.state()["torn"] == {"target": True}
        with pytest.raises(SidecarStateError):
            c.generate(["refused while torn"], GREEDY, wait=False)
        assert c.sync_weights(sender, weights, version=3)["ok"]
        assert c.state()["torn"] == {"target": False}
        assert c.generate(["served again"], GREEDY)[0].weight_version == 3
        assert "sidecar_weight_sync_bytes_total" in c.metrics()


@pytest.mark.slow
def test_status_cli(server: Sidecar, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", server.url]) == 0
    out = capsys.readouterr().out
    assert "healthy" in out and RANK in out
    assert main(["status", "http://127.0.0.1:1", "--timeout", "1"]) == 2


def test_status_shows_the_engines_counters_once_it_generated() -> None:
    state = {"healthy": True, "weight_versions": {"target": 2}, "ranks": []}
    assert not any(line.startswith("engine") for line in format_state("u", state).splitlines())
    state["engine"] = {"generated_tokens": 900, "prefix_cache_hit_tokens": 64, "draft_tokens_proposed": 400,
                       "draft_tokens_accepted": 300, "preemptions": 2}
    (line,) = [line for line in format_state("u", state).splitlines() if line.startswith("engine")]
    assert line == ("engine     900 tokens generated, 64 prompt tokens from the prefix cache, draft acceptance "
                    "75.0% of 400 proposed, 2 preemption(s)")


# ---- the client alone (mock transport) ----------------------------------------------------------------


def _client(handler: object) -> SidecarClient:
    return SidecarClient("http://sidecar.test", transport=httpx.MockTransport(handler), backoff_s=0.0)


def test_get_is_retried_but_generate_is_sent_once() -> None:
    calls: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if len(calls) < 3:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"healthy": True})

    assert _client(flaky).state() == {"healthy": True} and calls == ["GET"] * 3

    def down(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        raise httpx.ReadTimeout("slow", request=request)

    calls.clear()
    with pytest.raises(SidecarConnectionError):
        _client(down).generate(["x"])
    assert calls == ["POST"]


def test_error_responses_become_typed_exceptions() -> None:
    def reply(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            return httpx.Response(400, json={"error": {"type": "InvalidRequestError", "message": "bad token",
                                                       "field": "prompts[1]", "rank": RANK}})
        return httpx.Response(409, json={"error": {"type": "StateError", "message": "asleep"}})

    c = _client(reply)
    with pytest.raises(InvalidRequestError) as e:
        c.generate(["a", "b"])
    assert isinstance(e.value, SidecarRequestError)
    assert (e.value.status, e.value.field, e.value.rank) == (400, "prompts[1]", RANK)
    with pytest.raises(StateError) as e409:
        c.sleep()
    assert type(e409.value) is SidecarStateError


def test_a_checksum_mismatch_is_its_own_class() -> None:
    assert ChecksumMismatch.__name__ == CHECKSUM_MISMATCH  # the type the server reports for it

    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"error": {"type": "ChecksumMismatch", "rank": RANK,
                                                   "message": "tensor 'lm_head.weight' digest differs"}})

    with pytest.raises(SidecarChecksumError) as e:
        _client(reply).pause()
    assert isinstance(e.value, StateError) and e.value.rank == RANK and "lm_head.weight" in e.value.message


def test_the_sidecar_package_reexports_the_client() -> None:
    import sidecar
    import sidecar.client
    import trainer_hooks
    import trainer_hooks.client

    assert sidecar.SidecarClient is sidecar.client.SidecarClient is trainer_hooks.client.SidecarClient
    assert trainer_hooks.SidecarClient is trainer_hooks.client.SidecarClient
    assert set(sidecar.client.__all__) == set(trainer_hooks.client.__all__)
    for name in sidecar.client.__all__:
        assert getattr(sidecar.client, name) is getattr(trainer_hooks.client, name)
    for name in trainer_hooks.__all__:
        assert getattr(trainer_hooks, name) is not None


def test_sampling_params_round_trip_to_json() -> None:
    seen: list[dict] = []

    def echo(request: httpx.Request) -> httpx.Response:
        import json

        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"outputs": []})

    _client(echo).generate([[1, 2]], SamplingParams(temperature=0.5, stop=("x",), seed=3))
    body = seen[0]
    assert body["prompts"] == [[1, 2]]
    assert SamplingParams.from_dict(body["sampling_params"]) == SamplingParams(temperature=0.5, stop=("x",), seed=3)
