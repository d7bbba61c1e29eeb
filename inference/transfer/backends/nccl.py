"""nccl: bucket broadcasts between GPUs over an NCCL group of the session's own (inference/transfer/
backends/broadcast.py), with the buckets in GPU memory at both ends. One GPU per end: NCCL refuses
two ranks on one device (two processes sharing a GPU use ipc).

The communicator is built on the session's prefixed store, never the default process group. Its
collectives are asynchronous: TransferGroup polls them against its own deadline and aborts the
communicator when it passes, so the watchdog's timeout below is only a backstop.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from inference.core import InvalidRequestError
from inference.transfer.backends.broadcast import BroadcastBackend
from inference.transfer.groups import InitInfo, TransferError


class NcclBackend(BroadcastBackend):
    """Buckets on this end's GPU, broadcast over the data plane below."""

    def bucket_device(self) -> torch.device:
        return self.device

    @staticmethod
    def data_plane(store: dist.Store, rank: int, world_size: int, info: InitInfo, device: torch.device) -> Any:
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise TransferError("backend 'nccl' needs a CUDA build of torch")
        if device.type != "cuda":
            raise InvalidRequestError("init_info.backend", f"'nccl' needs a CUDA device, this rank has {device}")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=2 * float(info.timeout_s) + 30)
        with torch.cuda.device(device):
            return dist.ProcessGroupNCCL(store, rank, world_size, opts)
