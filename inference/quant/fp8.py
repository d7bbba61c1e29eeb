"""THE FP8 weight rule: a [N, K] weight -> float8_e4m3fn values and one fp32 scale per output row.

Every row n is quantized alone (so a TP row shard, a fused qkv/gate_up part and a whole tensor give the
same bytes for the same row), in fp32, by exactly-rounded steps only, so CPU and CUDA agree bit for bit:
  amax[n]  = max_k |w[n, k]|                        (exact: a maximum never rounds; +a and -a tie)
  scale[n] = max(amax[n] / 448, 2^-126)             (one IEEE division; 1.0 for an all-zero row; the
                                                     floor keeps a subnormal amax off a zero divisor)
  q[n, k]  = e4m3(clamp(w[n, k] / scale[n], -448, 448)), rounded to nearest, ties to even
  w ~= q.float() * scale[:, None]                  (dequantize_rows)
A non-finite weight is refused (InvalidRequestError naming the tensor): e4m3fn has no inf, and a NaN
would silently poison its row's scale. `RULE` names this rule wherever its bytes are digested.
On the CPU a weight goes through these steps in blocks of rows that stay in cache (each step is per
element or per row, so the bits are the same; about 2-3.5x faster there than whole-tensor passes).
The trainer's side imports this module (it computes the expected installed digest): torch only.
"""

from __future__ import annotations

import torch

from inference.core import InvalidRequestError

RULE = "fp8_e4m3fn_rowwise_amax448"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
MIN_SCALE = 2.0 ** -126  # the smallest normal fp32
SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CPU_BLOCK = 1 << 18  # elements of a CPU block of rows (1 MiB of fp32)


def row_scales(w: torch.Tensor, name: str, check: bool = True) -> torch.Tensor:
    """[N] fp32 scales of a [N, K] weight under the rule; InvalidRequestError(name) if w is not finite.
    check=False skips that host read (one per tensor): a non-finite row then gets a non-finite scale,
    which the caller checks for many tensors at once (check_finite)."""
    if w.dim() != 2 or w.dtype not in SOURCE_DTYPES:
        raise InvalidRequestError(name, f"FP8 quantizes 2-D bf16/fp16/fp32 weights, not {w.dtype} "
                                  f"of shape {list(w.shape)}")
    if not w.shape[1]:
        amax = w.new_zeros(w.shape[0], dtype=torch.float32)
    elif w.device.type == "cpu":
        amax = torch.cat([w[rows].abs().amax(dim=1) for rows in _row_blocks(w)]).float()
    else:
        amax = w.abs().amax(dim=1).float()
    if check and not bool(torch.isfinite(amax).all()):  # amax propagates NaN and inf
        check_finite(w, name)
    return scales_of_amax(amax)


def check_finite(w: torch.Tensor, name: str) -> None:
    """InvalidRequestError naming `name` and the first non-finite element of w, if it has one."""
    bad = torch.nonzero(~torch.isfinite(w))
    if bad.numel():
        n, k = bad[0].tolist()
        raise InvalidRequestError(name, f"holds a non-finite value ({w[n, k].item()} at [{n}, {k}]); FP8 "
                                  "quantization refuses inf and NaN")


def scales_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """scale = max(amax / 448, 2^-126), and 1.0 where amax is 0 (fp32 in, fp32 out)."""
    scale = torch.clamp_min(amax / FP8_MAX, MIN_SCALE)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize_with_scales(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(w / scale[:, None], -448, 448)): the values of the rule for given row scales."""
    if w.device.type != "cpu" or w.dim() != 2:
        return torch.div(w.float(), scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    for rows in _row_blocks(w):
        q[rows] = torch.div(w[rows].float(), scale[rows, None]).clamp_(-FP8_MAX, FP8_MAX)  # copy_ rounds as .to
    return q


def _row_blocks(w: torch.Tensor) -> list[slice]:
    """Slices of about _CPU_BLOCK elements of whole rows covering a 2-D w."""
    step = max(1, _CPU_BLOCK // max(1, w.shape[1]))
    return [slice(i, i + step) for i in range(0, w.shape[0], step)]


def quantize_rows(w: torch.Tensor, name: str, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] float8_e4m3fn, scale [N] fp32) of a finite [N, K] weight, on w's device (check: row_scales)."""
    scale = row_scales(w, name, check)
    return quantize_with_scales(w, scale), scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule on activations [M, K] (each row its own scale) for the FP8 GEMM, without the host
    check: a step must not read the host (CUDA graphs); a non-finite activation stays non-finite."""
    amax = x.abs().amax(dim=1).float()
    scale = scales_of_amax(amax)
    return quantize_with_scales(x, scale), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q.float() * scale[:, None], rounded to dtype (the reference every FP8 kernel is held to)."""
    return (q.float() * scale[:, None]).to(dtype)
