"""The peers scripts/bench/sync.py compares a sync with (both ends of each): the ceiling (ipc: one device copy of the
same bytes; gloo/nccl: a plain bucket-by-bucket broadcast), one broadcast per parameter, and verl-style
2 GiB buckets with a JSON index. The trainer process calls the *_send half, the receiver the *_recv half."""

from __future__ import annotations

import argparse
import json
import pickle

import torch

from inference.config import ModelConfig
from inference.models.loader import load_hf_tensor
from inference.transfer.groups import TransferGroup

PEER_BUCKET_BYTES = 2 << 30
_SCRATCH: dict[tuple[int, str], torch.Tensor] = {}


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _scratch(nbytes: int, device: torch.device) -> torch.Tensor:
    key = (nbytes, str(device))
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return _SCRATCH[key]


def ceiling_send(args: argparse.Namespace, group: TransferGroup, named: dict, device: torch.device) -> None:
    if args.backend == "ipc":
        return  # the receiver measures its own device copy
    total = sum(t.numel() * t.element_size() for t in named.values())
    buf = _scratch(min(args.bucket_mb << 20, total), device if args.backend == "nccl" else torch.device("cpu"))
    for off in range(0, total, buf.numel()):
        group.wait(group.broadcast(buf[:min(buf.numel(), total - off)]), "ceiling")


def per_param_send(args: argparse.Namespace, group: TransferGroup, named: dict, device: torch.device) -> None:
    if args.backend == "ipc":
        from torch.multiprocessing.reductions import reduce_tensor

        group.broadcast_bytes(pickle.dumps([reduce_tensor(t)[1] for t in named.values()]))
    else:
        for t in named.values():
            src = t if args.backend == "nccl" else t.cpu()
            group.wait(group.broadcast(src.contiguous().view(-1).view(torch.uint8)), "per-param")
    group.all_max([0], "ack")


def bucket_send(args: argparse.Namespace, group: TransferGroup, named: dict, device: torch.device) -> None:
    total = sum(t.numel() * t.element_size() for t in named.values())
    bucket_device = device if args.backend in ("ipc", "nccl") else torch.device("cpu")
    buf = _scratch(min(PEER_BUCKET_BYTES, total), bucket_device)
    if args.backend == "ipc" and not getattr(bucket_send, "shared", False):
        from torch.multiprocessing.reductions import reduce_tensor

        group.broadcast_bytes(pickle.dumps(reduce_tensor(buf)[1]))
        bucket_send.shared = True  # type: ignore[attr-defined]
    entries: list[tuple[str, int]] = []
    used = 0
    for name, t in [*named.items(), ("", None)]:
        nbytes = 0 if t is None else t.numel() * t.element_size()
        if t is None or used + nbytes > buf.numel():
            sync_device(bucket_device)
            group.broadcast_bytes(json.dumps(entries).encode())
            if args.backend != "ipc":
                group.wait(group.broadcast(buf[:used]), "peer bucket")
            group.all_max([0], "peer bucket ack")
            entries, used = [], 0
        if t is not None:
            buf[used:used + nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
            entries.append((name, used))
            used += nbytes
    group.broadcast_bytes(json.dumps([]).encode())


def ceiling_recv(args: argparse.Namespace, group: TransferGroup, config: ModelConfig, params: dict,
                 manifest: dict, total: int, device: torch.device) -> None:
    if args.backend == "ipc":
        src, dst = _scratch(total, device), _scratch(total + 1, device)[:total]
        dst.copy_(src)
        return
    buf = _scratch(min(args.bucket_mb << 20, total), device if args.backend == "nccl" else torch.device("cpu"))
    for off in range(0, total, buf.numel()):
        group.wait(group.broadcast(buf[:min(buf.numel(), total - off)]), "ceiling")


def per_param_recv(args: argparse.Namespace, group: TransferGroup, config: ModelConfig, params: dict,
                   manifest: dict, total: int, device: torch.device) -> None:
    specs = manifest["tensors"]
    if args.backend == "ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        handles = pickle.loads(group.broadcast_bytes(None))
        for spec, h in zip(specs, handles):
            load_hf_tensor(params, config, spec["name"], rebuild_cuda_tensor(*h))
        sync_device(device)
        del handles
    else:
        recv_device = device if args.backend == "nccl" else torch.device("cpu")
        for spec in specs:
            t = torch.empty(spec["shape"], dtype=torch.bfloat16, device=recv_device)
            group.wait(group.broadcast(t.view(-1).view(torch.uint8)), "per-param")
            load_hf_tensor(params, config, spec["name"], t)
    group.all_max([0], "ack")


def bucket_recv(args: argparse.Namespace, group: TransferGroup, config: ModelConfig, params: dict,
                manifest: dict, total: int, device: torch.device) -> None:
    shapes = {t["name"]: t["shape"] for t in manifest["tensors"]}
    if args.backend == "ipc":
        if not hasattr(bucket_recv, "buf"):
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            bucket_recv.buf = rebuild_cuda_tensor(*pickle.loads(group.broadcast_bytes(None)))  # type: ignore[attr-defined]
        buf = bucket_recv.buf  # type: ignore[attr-defined]
    else:
        buf = _scratch(min(PEER_BUCKET_BYTES, total), device if args.backend == "nccl" else torch.device("cpu"))
    while entries := json.loads(group.broadcast_bytes(None)):
        used = max(off + torch.Size(shapes[n]).numel() * 2 for n, off in entries)
        if args.backend != "ipc":
            group.wait(group.broadcast(buf[:used]), "peer bucket")
        for name, off in entries:
            n = torch.Size(shapes[name]).numel() * 2
            load_hf_tensor(params, config, name, buf[off:off + n].view(torch.bfloat16).view(shapes[name]))
        sync_device(device)
        group.all_max([0], "peer bucket ack")


def reset_peers() -> None:
    """Forget this process's scratch buffers and the receiver's shared peer bucket (the next shape has
    its own sizes and its own trainer)."""
    _SCRATCH.clear()
    if hasattr(bucket_recv, "buf"):
        del bucket_recv.buf
