"""gloo: bucket broadcasts through host memory over the session's gloo group (inference/transfer/
backends/broadcast.py). Runs with any device at either end: CUDA tensors are packed into pinned host
buckets on the sender and copied to the device from them on a receiver."""

from __future__ import annotations

from inference.transfer.backends.broadcast import BroadcastBackend


class GlooBackend(BroadcastBackend):
    """The bytes go over the control group itself: no data plane, buckets on the host."""
