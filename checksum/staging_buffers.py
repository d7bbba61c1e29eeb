"""Staging buffers of the device hashing pipeline (checksum/staging.py): reusable buffers, the way
bytes get into them, and when a hasher may read them. HostStaging runs the pipeline without a GPU;
CudaStaging copies into pinned buffers on a per-device copy stream, one blocking event per buffer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch

from checksum.tensor_bytes import host_view


class Staging(Protocol):
    """Reusable staging buffers and the way bytes get into them."""

    num_buffers: int

    def session(self, device: torch.device | None) -> AbstractContextManager[None]:
        """Context for one run's copies; on exit, no copy into a buffer is still in flight."""
        ...

    def copy(self, buf: int, src: torch.Tensor) -> None:
        """Start copying the 1-D uint8 `src` into buffer `buf` (may return before it lands)."""
        ...

    def wait(self, buf: int) -> None:
        """Block until the last copy issued into `buf` has landed. Releases the GIL while blocked."""
        ...

    def view(self, buf: int, nbytes: int) -> memoryview:
        """The first `nbytes` of buffer `buf`, zero-copy."""
        ...


class HostStaging:
    """Plain host buffers with synchronous copies: runs the device pipeline without a GPU."""

    def __init__(self, chunk_bytes: int, num_buffers: int) -> None:
        self.num_buffers = num_buffers
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(num_buffers)]
        self._views = [host_view(b) for b in self._buffers]

    @contextmanager
    def session(self, device: torch.device | None) -> Iterator[None]:
        yield

    def copy(self, buf: int, src: torch.Tensor) -> None:
        self._buffers[buf][: src.numel()].copy_(src)

    def wait(self, buf: int) -> None:
        pass  # copies are synchronous

    def view(self, buf: int, nbytes: int) -> memoryview:
        return self._views[buf][:nbytes]


class CudaStaging:
    """Pinned host buffers filled by one copy stream per device, one blocking event per buffer.

    Blocking-sync events make a waiting hasher sleep instead of spinning on a core that another
    hasher needs. Streams and events are made once per device and reused by every run.
    """

    def __init__(self, chunk_bytes: int, num_buffers: int) -> None:
        self.num_buffers = num_buffers
        self._buffers = [
            torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_buffers)
        ]
        self._views = [host_view(b) for b in self._buffers]
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._events: dict[int, list[torch.cuda.Event]] = {}
        self._stream: torch.cuda.Stream | None = None
        self._current_events: list[torch.cuda.Event] = []

    @contextmanager
    def session(self, device: torch.device | None) -> Iterator[None]:
        assert device is not None and device.type == "cuda", f"CudaStaging needs a cuda device, got {device}"
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            if index not in self._streams:
                self._streams[index] = torch.cuda.Stream()
                self._events[index] = [torch.cuda.Event(blocking=True) for _ in range(self.num_buffers)]
            stream = self._streams[index]
            # The tensors were written on the caller's current stream: copy only after that work.
            stream.wait_stream(torch.cuda.current_stream())
            self._stream, self._current_events = stream, self._events[index]
            try:
                with torch.cuda.stream(stream):  # contiguous() of strided tensors runs here too
                    yield
            finally:
                # Whatever happened, no DMA may still be writing a buffer once the run is over.
                stream.synchronize()
                self._stream, self._current_events = None, []

    def copy(self, buf: int, src: torch.Tensor) -> None:
        assert self._stream is not None, "copy outside a session"
        self._buffers[buf][: src.numel()].copy_(src, non_blocking=True)
        self._current_events[buf].record(self._stream)

    def wait(self, buf: int) -> None:
        self._current_events[buf].synchronize()

    def view(self, buf: int, nbytes: int) -> memoryview:
        return self._views[buf][:nbytes]
