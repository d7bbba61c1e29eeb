"""Tensor-parallel linear layers with loaders that take FULL (unsharded) Hugging Face tensors.

Every parameter carries `weight_loader(param, full_hf_tensor, shard_id=None)`, which copies this
rank's slice of the full tensor into the right rows/columns of the (possibly fused) parameter.
Layouts (out_features is dim 0, as in nn.Linear):
- ColumnParallelLinear: rank r holds rows [r*n/tp, (r+1)*n/tp) of the weight and bias.
- MergedColumnParallelLinear: the concatenation, per rank, of each part's row shard
  (gate_up: [gate_r; up_r]); shard_id is the part index 0, 1, ...
- QKVParallelLinear: [q heads of rank r; k heads of rank r; v heads of rank r]; shard_id "q"/"k"/"v".
- RowParallelLinear: rank r holds columns [r*n/tp, (r+1)*n/tp); outputs are summed over ranks
  (all_reduce) and the bias is added once, after the sum.
Parameters are created with torch.empty: the loader (or the weight receiver) fills them. Beside its
loader each parameter carries `held_part(param, shard_id)`: the region of the parameter that the loader
fills from a full tensor and which part of that tensor it holds there (a delta sync applies into it
and audits it); None where no single region does (an FP8 weight: its bytes are quantized).
`invariant` (EngineConfig.batch_invariant): the product runs as gemm_invariant.invariant_linear, each row's
bits independent of the other rows; with TP, RowParallelLinear then sums the ranks' partials in rank order
(TPInfo.all_reduce_ordered) rather than in the collective's own order.
`fp8` (EngineConfig.quantization = "fp8"): the weight is float8_e4m3fn with an fp32 scale per output row
in the buffer `weight_scale` (inference/quant/fp8.py; a buffer, so parameter names stay the HF names);
the loader quantizes each FULL row on the parameter's device before slicing (a RowParallel shard keeps
the whole row's scale), and the product is fp8_linear.fp8_linear. Biases stay in the model dtype.
`lora` (None, or a LoRASlot from inference/layers/lora.py): an adapter served unmerged, its term added
to the layer's own output (a RowParallelLinear's: to its partial, before the all-reduce); it is held in
`compute_dtype` (the model dtype) whatever the weight's dtype, so over an FP8 weight the base product runs
as fp8_linear and the adapter's term is added as over a bf16 one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from inference.core import InvalidRequestError
from inference.layers.fp8_linear import fp8_linear
from inference.layers.gemm_invariant import invariant_linear
from inference.layers.gemv import linear
from inference.layers.lora import LoRASlot
from inference.parallel import TPInfo
from inference.quant.fp8 import FP8_DTYPE, quantize_rows

ShardId = str | int | tuple[int, int] | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]
# (the region of a parameter, and the part of the full tensor it holds: (dim, start, length) of
# full.narrow, or None for all of it)
HeldPart = tuple[torch.Tensor, tuple[int, int, int] | None]
PartOf = Callable[[nn.Parameter, ShardId], HeldPart | None]


def new_param(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str,
              loader: WeightLoader, held_part: PartOf | None = None) -> nn.Parameter:
    """An uninitialized, non-trainable parameter with its weight_loader and held_part attached (module
    docstring; None: no region stands for a full tensor's part)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.held_part = held_part  # type: ignore[attr-defined]
    return param


def replicated_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    """Every rank holds the whole tensor (norms, unsharded layers)."""
    assert shard_id is None, shard_id
    assert param.shape == loaded.shape, (tuple(param.shape), tuple(loaded.shape))
    param.data.copy_(loaded)


def replicated_part(param: nn.Parameter, shard_id: ShardId = None) -> HeldPart:
    """replicated_loader's region: the whole parameter holds the whole tensor."""
    assert shard_id is None, shard_id
    return param.data, None


class _Fp8Weight(nn.Module):
    """What the four linears share in FP8 mode: the weight's dtype, its scale buffer, and where each HF
    tensor's quantized rows go (`installed_region`, `install`), which the loader and the weight receiver
    (inference/weights/installed.py) both write through."""

    fp8: bool
    weight: nn.Parameter

    def _init_weight(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device | str,
                     fp8: bool) -> None:
        self.fp8 = fp8
        self.weight = new_param(shape, FP8_DTYPE if fp8 else dtype, device, self.weight_loader, self.held_part)
        if fp8:
            self.weight.quantized_from = dtype  # type: ignore[attr-defined]  # the dtype a sync sends
        scale = torch.ones(shape[0], dtype=torch.float32, device=device) if fp8 else None
        self.register_buffer("weight_scale", scale, persistent=False)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes in (its input's, its output's, a LoRA adapter's): the model dtype,
        never FP8 (an FP8 weight remembers the dtype it was quantized from)."""
        return self.weight.quantized_from if self.fp8 else self.weight.dtype  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def held_part(self, param: nn.Parameter, shard_id: ShardId = None) -> HeldPart | None:
        """Where weight_loader writes `shard_id`'s part of a full tensor into `param` (module docstring)."""
        raise NotImplementedError

    def installed_region(self, shard_id: ShardId) -> tuple[torch.Tensor, torch.Tensor]:
        """(the FP8 weight's region, its scales' region) that the HF tensor `shard_id` fills on this rank."""
        raise NotImplementedError

    def quantize_part(self, loaded: torch.Tensor, shard_id: ShardId,
                      check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule's (q, scale) of this rank's region of the FULL HF tensor `loaded`, on the weight's device
        (check: quant.fp8.row_scales)."""
        raise NotImplementedError

    def shard_quantized(self, full: torch.Tensor, part: str, shard_id: ShardId) -> torch.Tensor:
        """This rank's share, on the weight's device, of a FULL tensor quantized by the rule elsewhere (on
        send): `part` "fp8" (the HF tensor's values [N, K]) or "scale" (its row scales [N])."""
        raise NotImplementedError

    def install(self, loaded: torch.Tensor, shard_id: ShardId, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize the FULL HF tensor's part and write it into its region; returns what was written."""
        q, scale = self.quantize_part(loaded, shard_id, check)
        region, region_scale = self.installed_region(shard_id)
        region.copy_(q)
        region_scale.copy_(scale)
        return q, scale

    def product(self, x: torch.Tensor, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
        if self.fp8:
            return fp8_linear(x, self.weight, self.weight_scale, bias, invariant)
        return invariant_linear(x, self.weight, bias) if invariant else linear(x, self.weight, bias)


def tp_divide(n: int, tp: TPInfo, what: str) -> int:
    """n // tp.size, or a clear InvalidRequestError naming what does not divide."""
    if n % tp.size:
        raise InvalidRequestError(
            "tp_size", f"{what} = {n} does not divide by tensor-parallel size {tp.size}")
    return n // tp.size


class ColumnParallelLinear(_Fp8Weight):
    """y = x W^T + b with W split by output rows; the output stays sharded (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device | str, invariant: bool = False, fp8: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.invariant = invariant
        self.in_features = in_features
        self.out_features_local = tp_divide(out_features, tp, "output features")
        self._init_weight((self.out_features_local, in_features), dtype, device, fp8)
        self.bias = (new_param((self.out_features_local,), dtype, device, self.weight_loader, self.held_part)
                     if bias else None)
        self.lora: LoRASlot | None = None

    def _row_shard(self, loaded: torch.Tensor, n_local: int) -> torch.Tensor:
        return loaded.narrow(0, self.tp.rank * n_local, n_local)

    def _part(self, shard_id: ShardId) -> tuple[int, int]:
        """(first row, rows) of the part `shard_id` in this rank's weight."""
        assert shard_id is None, shard_id
        return 0, self.out_features_local

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        offset, n_local = self._part(shard_id)
        assert loaded.shape[0] == n_local * self.tp.size, (shard_id, tuple(loaded.shape))
        if self.fp8 and param is self.weight:
            self.install(loaded, shard_id)
        else:
            param.data.narrow(0, offset, n_local).copy_(self._row_shard(loaded, n_local))

    def held_part(self, param: nn.Parameter, shard_id: ShardId = None) -> HeldPart | None:
        if self.fp8 and param is self.weight:
            return None
        offset, n_local = self._part(shard_id)
        return param.data.narrow(0, offset, n_local), (0, self.tp.rank * n_local, n_local)

    def installed_region(self, shard_id: ShardId) -> tuple[torch.Tensor, torch.Tensor]:
        offset, n_local = self._part(shard_id)
        return self.weight.data.narrow(0, offset, n_local), self.weight_scale.narrow(0, offset, n_local)

    def quantize_part(self, loaded: torch.Tensor, shard_id: ShardId,
                      check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._row_shard(loaded, self._part(shard_id)[1])  # a row's bytes are its own: shard first
        return quantize_rows(rows.to(self.weight.device), "weight", check)

    def shard_quantized(self, full: torch.Tensor, part: str, shard_id: ShardId) -> torch.Tensor:
        return self._row_shard(full, self._part(shard_id)[1]).to(self.weight.device)  # values and scales by rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x, self.bias, self.invariant)
        return y if self.lora is None else self.lora(x, y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate_up: output_sizes = [I, I])."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device | str, invariant: bool = False, fp8: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(self.output_sizes), bias, tp, dtype, device, invariant, fp8)
        self.local_sizes = [tp_divide(n, tp, "fused output part") for n in self.output_sizes]

    def _part(self, shard_id: ShardId) -> tuple[int, int]:
        assert isinstance(shard_id, int) and 0 <= shard_id < len(self.output_sizes), shard_id
        return sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections, split by heads. Both head counts must divide by the TP size."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPInfo, dtype: torch.dtype, device: torch.device | str, invariant: bool = False,
                 fp8: bool = False) -> None:
        self.head_dim = head_dim
        self.num_heads_local = tp_divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads_local = tp_divide(num_kv_heads, tp, "num_key_value_heads")
        out = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, tp, dtype, device, invariant, fp8)
        self.q_size_local = self.num_heads_local * head_dim
        self.kv_size_local = self.num_kv_heads_local * head_dim

    def _part(self, shard_id: ShardId) -> tuple[int, int]:
        assert shard_id in ("q", "k", "v"), shard_id
        n_local = self.q_size_local if shard_id == "q" else self.kv_size_local
        return {"q": 0, "k": self.q_size_local, "v": self.q_size_local + self.kv_size_local}[shard_id], n_local

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, (Hq + 2 Hkv) * D] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (local heads)."""
        q, k, v = qkv.split([self.q_size_local, self.kv_size_local, self.kv_size_local], dim=-1)
        t = qkv.shape[0]
        return (q.reshape(t, self.num_heads_local, self.head_dim),
                k.reshape(t, self.num_kv_heads_local, self.head_dim),
                v.reshape(t, self.num_kv_heads_local, self.head_dim))


class RowParallelLinear(_Fp8Weight):
    """y = sum_r x_r W_r^T + b, with x sharded on its last dim; all_reduce makes y whole on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPInfo,
                 dtype: torch.dtype, device: torch.device | str, invariant: bool = False, fp8: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.invariant = invariant
        self.in_features_local = tp_divide(in_features, tp, "input features")
        self.out_features = out_features
        self._init_weight((out_features, self.in_features_local), dtype, device, fp8)
        # The bias is replicated and added after the reduction, so it counts once.
        self.bias = new_param((out_features,), dtype, device, replicated_loader, replicated_part) if bias else None
        self.lora: LoRASlot | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        assert shard_id is None, shard_id
        n = self.in_features_local
        assert loaded.shape[1] == n * self.tp.size, tuple(loaded.shape)
        if self.fp8:
            self.install(loaded, shard_id)
        else:
            param.data.copy_(loaded.narrow(1, self.tp.rank * n, n))

    def held_part(self, param: nn.Parameter, shard_id: ShardId = None) -> HeldPart | None:
        assert shard_id is None, shard_id
        n = self.in_features_local
        return None if self.fp8 else (param.data, (1, self.tp.rank * n, n))

    def installed_region(self, shard_id: ShardId) -> tuple[torch.Tensor, torch.Tensor]:
        assert shard_id is None, shard_id
        return self.weight.data, self.weight_scale

    def quantize_part(self, loaded: torch.Tensor, shard_id: ShardId,
                      check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        # the rule's amax runs over the FULL row, so every TP size installs slices of the same bytes
        q, scale = quantize_rows(loaded.to(self.weight.device), "weight", check)
        n = self.in_features_local
        return q.narrow(1, self.tp.rank * n, n).contiguous(), scale

    def shard_quantized(self, full: torch.Tensor, part: str, shard_id: ShardId) -> torch.Tensor:
        assert shard_id is None, shard_id
        n = self.in_features_local  # the values split by columns; every rank holds all of the row scales
        return (full.narrow(1, self.tp.rank * n, n) if part == "fp8" else full).to(self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            y = self.product(x, self.bias, self.invariant)
            return y if self.lora is None else self.lora(x, y)
        partial = self.product(x, None, self.invariant)
        # the adapter's partial term joins the base's before the one reduction, which sums both
        return self.reduce(partial if self.lora is None else self.lora(x, partial))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's bias-free product x_r W_r^T -> the layer's output (sum over ranks, plus bias)."""
        if self.tp.size == 1:
            y = partial
        else:
            y = self.tp.all_reduce_ordered(partial) if self.invariant else self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias
