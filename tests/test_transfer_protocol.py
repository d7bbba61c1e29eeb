"""The control protocol of one sync on the CPU: the one all-reduce that agrees on the plan (and, for
ipc, on the layout and its size), sized control messages, and the ipc exporter's staged offers.
The ipc data path itself needs a GPU (tests/test_weight_update_cuda.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from inference.transfer import ipc
from inference.transfer.groups import InitInfo, TransferGroup, master_store, new_session_id

WORLD = 3


@pytest.fixture
def groups() -> Iterator[list[TransferGroup]]:
    store = master_store("127.0.0.1", 0, WORLD, 20.0)
    info = InitInfo("gloo", "127.0.0.1", store.port, WORLD, 1 << 20, 20.0, new_session_id())
    with ThreadPoolExecutor(WORLD) as pool:
        joins = [pool.submit(TransferGroup, info, r, torch.device("cpu"), store if r == 0 else None)
                 for r in range(WORLD)]
        made = [j.result(timeout=30) for j in joins]
    yield made
    for g in made:
        g.close()


def on_all(groups: list[TransferGroup], call: Callable[[int, TransferGroup], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(groups)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(call, r, g) for r, g in enumerate(groups)]]


def test_agree_many_is_one_verdict_per_key_on_every_rank(groups: list[TransferGroup]) -> None:
    same_plan, new_layout = 7 << 40, 12345
    got = on_all(groups, lambda r, g: g.agree_many([same_plan, new_layout if r == 0 else 99], [100 * r]))
    assert got == [([True, False], [200])] * WORLD, "a key one rank lacks is not agreed, on any rank"
    got = on_all(groups, lambda r, g: g.agree_many([same_plan, new_layout], [0]))
    assert got == [([True, True], [0])] * WORLD
    got = on_all(groups, lambda r, g: g.agree_many([0, 5 if r else 6]))
    assert got == [([False, False], [])] * WORLD, "0 never agrees, even when every rank passes it"
    assert on_all(groups, lambda r, g: g.agree(same_plan + (r == 2))) == [False] * WORLD
    assert all(not g.broken for g in groups), "a disagreement leaves the group usable"


def test_a_message_of_agreed_size_arrives_whole(groups: list[TransferGroup]) -> None:
    payload = json.dumps({"layout": list(range(300))}).encode()
    got = on_all(groups, lambda r, g: g.broadcast_bytes(payload if r == 0 else None, len(payload)))
    assert got == [payload] * WORLD
    got = on_all(groups, lambda r, g: g.broadcast_bytes(b"sized by an all-reduce" if r == 0 else None))
    assert got == [b"sized by an all-reduce"] * WORLD


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> ipc.IpcExporter:
    monkeypatch.setattr(ipc, "export_storage", lambda storage: {"size": storage.nbytes()})  # no CUDA here
    return ipc.IpcExporter()


def test_an_offer_that_never_reached_the_receivers_is_rolled_back(exporter: ipc.IpcExporter) -> None:
    a, b = torch.zeros(10), torch.zeros(20)
    exporter.offer("direct", [a, b])
    exporter.commit()
    steady = exporter.offer("direct", [a, b])
    c = torch.zeros(10)
    stopped = exporter.offer("direct", [c, b])  # e.g. the plan agreement failed: nothing was sent
    exporter.rollback()
    assert exporter.offer("direct", [a, b]) == steady, "the receivers still hold the old layout"
    retried = exporter.offer("direct", [c, b])
    assert retried.key == 0 and json.loads(retried.payload) == json.loads(stopped.payload), \
        "the handle the receivers never got is offered (and sent) again"


def test_the_layout_key_covers_the_mode_and_every_placement(exporter: ipc.IpcExporter) -> None:
    a, buf = torch.zeros(10), torch.zeros(64, dtype=torch.uint8)
    direct = exporter.offer("direct", [a])
    exporter.commit()
    exporter.retire()
    packed = exporter.offer("packed", [], [buf])
    exporter.commit()
    exporter.retire()  # as after every sync: a's storage is no longer live, the receivers dropped it
    again = exporter.offer("packed", [], [buf])
    layouts = [json.loads(o.payload) for o in (direct, packed, again)]
    assert [lay["mode"] for lay in layouts] == ["direct", "packed", "packed"]
    assert again.key == ipc.layout_key(layouts[2]) != 0 and layouts[2]["new"] == {}
    steady_direct = exporter.offer("direct", [a])  # so it is exported again
    assert steady_direct.key == 0 and len(json.loads(steady_direct.payload)["new"]) == 1
    base = {"mode": "direct", "live": [0, 1], "tensors": [[0, 0], [1, 0]], "buffers": []}
    variants = [{**base, "mode": "packed"}, {**base, "live": [0, 2]}, {**base, "tensors": [[0, 0], [1, 4]]},
                {**base, "buffers": [1]}]
    keys = {ipc.layout_key(base), *map(ipc.layout_key, variants)}
    assert len(keys) == 1 + len(variants) and 0 not in keys
    assert ipc.layout_key({**base, "new": {"3": {}}}) == ipc.layout_key(base), "new handles are not kept"
