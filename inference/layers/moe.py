"""A sparse mixture-of-experts MLP: a router picks top-k experts per token, the experts' outputs are summed
with the routing weights. Parameters (names as transformers 5 holds them; inference/models/moe_family.py):
    gate.weight                [E, H]             the router, replicated on every TP rank
    experts.gate_up_proj       [E, 2 I/tp, H]     per expert [gate rows of this rank; up rows of this rank]
    experts.down_proj          [E, H, I/tp]       per expert the columns of this rank; outputs all-reduced
Routing (`route`): softmax over all experts in fp32, the k largest, renormalised when norm_topk_prob
(Mixtral's softmax of the top-k logits is the same weights). Ties go to the lowest expert index (a stable
sort), so routing is a function of the token's logits alone.
Experts: on CUDA (or in Triton's interpreter) two grouped GEMM launches over the pairs sorted by expert
(moe_kernels.py; no host sync, so CUDA graphs capture it); elsewhere a loop over the experts present.
A token's k expert outputs are summed by one reduction over the k slots (never atomics; its order follows
k and the hidden size only), so in the batch-invariant mode, where the kernels' tiles are fixed, a token's
output does not depend on the rest of the batch.
Routing record (`routing_out`, bound by the model): each forward writes its tokens' expert ids into the
first rows of that static buffer, inside the forward, so a CUDA graph captures the write.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference.config import ModelConfig
from inference.layers.activation import SiluAndMul, get_activation
from inference.layers.gemm_invariant import invariant_linear
from inference.layers.kernel_device import use_triton
from inference.layers.linear import HeldPart, ShardId, new_param, replicated_loader, replicated_part, tp_divide
from inference.parallel import TPInfo

try:
    import triton

    from inference.layers.moe_kernels import _moe_down_kernel, _moe_gate_up_kernel
except ImportError:  # the reference loop serves without Triton
    triton = None

# Tiles of the grouped GEMMs. BLOCK_K and BLOCK_N fix a pair's reduction order; BLOCK_M only pads the
# experts' row groups (16 for decode-sized batches, where most experts get one or two pairs).
BLOCK_N, BLOCK_K = 64, 64
INVARIANT_BLOCK_M = 16  # the batch-invariant mode never changes tiles with the batch


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) from router logits [T, E]; see module docstring."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = values[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, act_fn: nn.Module, invariant: bool = False) -> torch.Tensor:
    """sum_j weights[t, j] * down[e](act(gate_up[e] x[t])), e = ids[t, j]: a loop over the experts present."""
    t, k = ids.shape
    product = invariant_linear if invariant else F.linear
    flat = ids.reshape(-1)
    out = x.new_zeros(t * k, down.shape[1])
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        out[pairs] = product(act_fn(product(x[pairs // k], gate_up[e])), down[e])
    return (out.view(t, k, -1) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert) for the kernels (moe_kernels.py): pairs t*k+j sorted by expert (stable),
    each expert's run padded to block_m with the pair count. Device ops only (no host sync), sized by
    ids.shape alone, so the result's shapes are static under CUDA graphs."""
    flat = ids.reshape(-1).long()
    p = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(p, device=ids.device) - (counts.cumsum(0) - counts)[sorted_experts]
    num_blocks = -(-(p + min(num_experts, p) * (block_m - 1)) // block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), p, dtype=torch.int32, device=ids.device)
    sorted_pairs[(ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def experts_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor, block_m: int) -> torch.Tensor:
    """experts_reference in two grouped GEMM launches (Triton); SiLU*up is the only activation."""
    t, k = ids.shape
    e, inter2, hidden = gate_up.shape
    inter, p = inter2 // 2, t * k
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    sorted_pairs, block_expert = align_pairs(ids, e, block_m)
    precision = "ieee" if x.dtype == torch.float32 else None  # None: the dot's default (bf16, fp16)
    num_blocks = block_expert.numel()
    act = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, BLOCK_N))](
        x, gate_up, act, sorted_pairs, block_expert, p, k, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision)
    out = torch.empty(p, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, BLOCK_N))](
        act, down, out, sorted_pairs, block_expert, weights.reshape(-1).contiguous(), p, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision)
    return out.view(t, k, hidden).sum(dim=1)


def pick_block_m(num_pairs: int, invariant: bool) -> int:
    if invariant or num_pairs <= 1024:
        return INVARIANT_BLOCK_M
    return 64


class MoEExperts(nn.Module):
    """The fused expert weights of one layer (see module docstring), TP-sharded over the intermediate dim."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp: TPInfo, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.tp = tp
        self.inter_local = tp_divide(inter, tp, "moe_intermediate_size")
        self.gate_up_proj = new_param((num_experts, 2 * self.inter_local, hidden), dtype, device, self.load_gate_up,
                                      self.gate_up_part)
        self.down_proj = new_param((num_experts, hidden, self.inter_local), dtype, device, self.load_down,
                                   self.down_part)

    def load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        """One expert's gate (part 0) or up (part 1) [I, H]: this rank's rows into their half; or, shard id
        None, every expert's [E, 2I, H] fused (transformers 5's in-memory layout): this rank's rows of each half."""
        n = self.inter_local
        if shard_id is None:
            inter = loaded.shape[1] // 2
            assert inter == n * self.tp.size, tuple(loaded.shape)
            for part in (0, 1):
                param.data.narrow(1, part * n, n).copy_(loaded.narrow(1, part * inter + self.tp.rank * n, n))
            return
        assert isinstance(shard_id, tuple), f"expert gate/up needs an (expert, part) shard id, got {shard_id!r}"
        expert, part = shard_id
        assert loaded.shape[0] == n * self.tp.size, tuple(loaded.shape)
        param.data[expert].narrow(0, part * n, n).copy_(loaded.narrow(0, self.tp.rank * n, n))

    def load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
        """One expert's down [H, I] (or, shard id None, every expert's [E, H, I]): this rank's columns."""
        n = self.inter_local
        if shard_id is None:
            assert loaded.shape[2] == n * self.tp.size, tuple(loaded.shape)
            param.data.copy_(loaded.narrow(2, self.tp.rank * n, n))
            return
        assert isinstance(shard_id, int), f"expert down needs an expert index, got {shard_id!r}"
        assert loaded.shape[1] == n * self.tp.size, tuple(loaded.shape)
        param.data[shard_id].copy_(loaded.narrow(1, self.tp.rank * n, n))

    def gate_up_part(self, param: nn.Parameter, shard_id: ShardId) -> HeldPart | None:
        """load_gate_up's region of one expert's gate or up; None for every expert's fused tensor (two parts)."""
        if not isinstance(shard_id, tuple):
            return None
        expert, part = shard_id
        n = self.inter_local
        return param.data[expert].narrow(0, part * n, n), (0, self.tp.rank * n, n)

    def down_part(self, param: nn.Parameter, shard_id: ShardId) -> HeldPart:
        """load_down's region: this rank's columns of one expert's down, or of every expert's."""
        n = self.inter_local
        if shard_id is None:
            return param.data, (2, self.tp.rank * n, n)
        assert isinstance(shard_id, int), shard_id
        return param.data[shard_id], (1, self.tp.rank * n, n)


class MoEBlock(nn.Module):
    """forward(x [T, H]) -> [T, H]: route, run the chosen experts, sum (all-reduced over TP ranks)."""

    def __init__(self, config: ModelConfig, tp: TPInfo, dtype: torch.dtype, device: torch.device | str,
                 invariant: bool = False) -> None:
        super().__init__()
        c = config
        if not 0 < c.num_experts_per_tok <= c.num_experts:
            raise ValueError(f"num_experts_per_tok={c.num_experts_per_tok} must be in 1..num_experts={c.num_experts}")
        self.top_k, self.renormalize, self.invariant, self.tp = c.num_experts_per_tok, c.norm_topk_prob, invariant, tp
        self.gate = nn.Module()
        self.gate.weight = new_param((c.num_experts, c.hidden_size), dtype, device, replicated_loader, replicated_part)
        self.experts = MoEExperts(c.num_experts, c.hidden_size, c.moe_intermediate_size, tp, dtype, device)
        self.act_fn = get_activation(c.hidden_act, invariant)
        # [rows, k] view of the model's routing buffer (DecoderForCausalLM.bind_routing); None: not recorded
        self.routing_out: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = invariant_linear if self.invariant else F.linear
        weights, ids = route(product(x, self.gate.weight), self.top_k, self.renormalize)
        if self.routing_out is not None:
            self.routing_out[: ids.shape[0]].copy_(ids)
        return self.reduce(self.run_experts(x, ids, weights))

    def run_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's partial output for given routing (the grouped kernels where Triton takes x)."""
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if triton is not None and use_triton(x) and isinstance(self.act_fn, SiluAndMul) and x.shape[0]:
            return experts_grouped(x, gate_up, down, ids, weights, pick_block_m(ids.numel(), self.invariant))
        return experts_reference(x, gate_up, down, ids, weights, self.act_fn, self.invariant)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return partial
        return self.tp.all_reduce_ordered(partial) if self.invariant else self.tp.all_reduce(partial)
