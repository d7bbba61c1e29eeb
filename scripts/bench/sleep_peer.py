"""torch_memory_saver (the library SGLang uses) pausing and resuming the bytes scripts/bench/sleep.py releases:
the peer its level-1 and level-2 figures are held against, in the same run."""

from __future__ import annotations

import importlib.metadata
import statistics
import time

import torch


def load_peer(device: torch.device) -> tuple[object | None, str]:
    """torch_memory_saver (hook mode torch) and a note naming its version, or None and why not."""
    if device.type != "cuda":
        return None, "skipped: torch_memory_saver needs CUDA"
    try:
        from torch_memory_saver import torch_memory_saver as tms

        version = importlib.metadata.version("torch_memory_saver")
        if getattr(tms, "_impl", None) is None:
            tms.hook_mode = "torch"  # must precede the first region(); preload mode needs LD_PRELOAD
        return tms, f"torch_memory_saver {version}, hook_mode=torch"
    except Exception as e:  # a missing peer must not hide our own figures
        return None, f"torch_memory_saver unavailable: {e!r}"


class PeerCycles:
    """torch_memory_saver pausing and resuming `nbytes` in one region, one cycle per call."""

    def __init__(self, tms: object, nbytes: int, device: torch.device, backup: bool, note: str,
                 gap_s: float) -> None:
        self.tms, self.device, self.backup, self.gap_s = tms, device, backup, gap_s
        self.tag = "bench_backup" if backup else "bench_nobackup"
        self.note = f"{note}, cpu_backup={backup}, bytes={nbytes}"
        with tms.region(tag=self.tag, enable_cpu_backup=backup):  # type: ignore[attr-defined]
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.tensor.fill_(7)
        self.pauses: list[float] = []
        self.resumes: list[float] = []
        self.freed: list[int] = []

    def cycle(self) -> None:
        torch.cuda.synchronize(self.device)
        free0 = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        self.tms.pause(self.tag)  # type: ignore[attr-defined]
        torch.cuda.synchronize(self.device)
        self.pauses.append(time.perf_counter() - t0)
        self.freed.append(torch.cuda.mem_get_info(self.device)[0] - free0)
        time.sleep(self.gap_s)
        t0 = time.perf_counter()
        self.tms.resume(self.tag)  # type: ignore[attr-defined]
        torch.cuda.synchronize(self.device)
        self.resumes.append(time.perf_counter() - t0)

    def result(self) -> dict:
        n = max(1, self.tensor.numel() // 4096)
        kept = bool((self.tensor[::n] == 7).all()) if self.backup else None
        return {
            "peer_pause_s": statistics.median(self.pauses),
            "peer_resume_s": statistics.median(self.resumes),
            "peer_pause_s_all": self.pauses,
            "peer_resume_s_all": self.resumes,
            "peer_freed_bytes": int(statistics.median(self.freed)),
            "peer_verified": kept,
            "peer_note": self.note,
        }


def peer_cycles(tms: object, nbytes: int, device: torch.device, backup: bool, note: str,
                repeats: int, gap_s: float) -> dict:
    """The peer's figures from `repeats` cycles of its own (used for the with-backup comparison)."""
    try:
        peer = PeerCycles(tms, nbytes, device, backup, note, gap_s)
        for _ in range(repeats):
            peer.cycle()
        result = peer.result()
        del peer
        return result
    except Exception as e:  # a broken peer must not hide our own figures
        return {"peer_note": f"{note}, cpu_backup={backup}: failed with {e!r}"}
