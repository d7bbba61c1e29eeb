"""Counters for kernels whose last program to finish merges the others' partials (split-KV decode
attention): per device, an int32 buffer that is all zeros between launches, since the merging
program resets the counter it used. Launches sharing one MergeCounters run on one stream at a time."""

from __future__ import annotations

import torch


class MergeCounters:
    """Per-device zeroed int32 buffers; `floor` is the smallest buffer made. A buffer is never freed or
    shrunk: captured CUDA graphs keep its address, so an outgrown one stays alive beside its successor."""

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}

    def get(self, device: torch.device, size: int) -> torch.Tensor:
        """A buffer of at least `size` zeros on `device`; growing it is refused during graph capture
        (run the kernel once eagerly first)."""
        buffers = self._buffers.setdefault(device, [])
        if not buffers or buffers[-1].numel() < size:
            if device.type == "cuda":
                assert not torch.cuda.is_current_stream_capturing(), "run one eager launch before capturing"
            grown = 2 * buffers[-1].numel() if buffers else 0
            buffers.append(torch.zeros(max(size, self.floor, grown), dtype=torch.int32, device=device))
        return buffers[-1]
