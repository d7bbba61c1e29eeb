"""Which torch CPU operations give a row the same bits alone as inside a batch, on this machine?

The facts inference/layers/invariant.py rests on (docs/invariance.md), probed again: for each operation a
JSON line with the number of rows (or elements) whose bits differed between the batched call and the
call on that row alone, out of the number tried. Run it on a new machine, torch build or thread count
before trusting the batch-invariant mode's CPU path there.

    python3 -m scripts.tools.probe_invariance [--threads N]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file from a checkout too

from inference.layers.invariant import row_sum, silu_and_mul_invariant, tiled_linear

Op = Callable[[torch.Tensor], torch.Tensor]


def rows_differing(op: Op, x: torch.Tensor, step: int = 7) -> tuple[int, int]:
    """(rows whose op(row alone) differs from op(x)[row], rows tried)."""
    full = op(x)
    tried = range(0, x.shape[0], step)
    return sum(not torch.equal(op(x[j:j + 1])[0], full[j]) for j in tried), len(tried)


def scalar_tail_differing(op: Op, n: int = 1 << 18) -> tuple[int, int]:
    """(elements where op over 31-element calls, all in the scalar tail, differs from one big call, n)."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(n // 2, generator=g) * 10, -100 * torch.rand(n // 2, generator=g)])
    big = op(x)
    tails = torch.cat([op(x[i:i + 31]) for i in range(0, n, 31)])
    return int((big != tails).sum()), n


def probes() -> list[tuple[str, tuple[int, int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in ((384, 128), (896, 896), (4864, 896)):
        w, x = torch.randn(n, k, generator=g), torch.randn(300, k, generator=g)
        out.append((f"F.linear fp32 [{n}x{k}]", rows_differing(lambda t, w=w: F.linear(t, w), x)))
        out.append((f"tiled_linear fp32 [{n}x{k}]", rows_differing(lambda t, w=w: tiled_linear(t, w), x)))
    long_rows = torch.randn(12, 151936, generator=g)
    out.append(("sum over a 151936-row", rows_differing(lambda t: t.sum(-1), long_rows, step=1)))
    out.append(("row_sum over a 151936-row", rows_differing(row_sum, long_rows, step=1)))
    short_rows = torch.randn(300, 4096, generator=g)
    out.append(("sum over a 4096-row", rows_differing(lambda t: t.sum(-1), short_rows)))
    gate_up = torch.randn(333, 200, generator=g)
    out.append(("F.silu(gate) * up [333 x 100]",
                rows_differing(lambda t: F.silu(t[:, :100]) * t[:, 100:], gate_up, step=1)))
    out.append(("silu_and_mul_invariant [333 x 100]", rows_differing(silu_and_mul_invariant, gate_up, step=1)))
    for name, fn in (("exp", torch.exp), ("log", lambda t: torch.log(t.abs() + 1e-30)),
                     ("rsqrt", lambda t: torch.rsqrt(t.abs() + 1e-6)), ("F.silu", F.silu),
                     ("sigmoid", torch.sigmoid), ("exp2", torch.exp2)):
        out.append((f"{name}: SIMD body vs scalar tail", scalar_tail_differing(fn)))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for name, (bad, tried) in probes():
        print(json.dumps({"probe": name, "differing": bad, "tried": tried, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
