"""One generic decoder-only transformer, parametrized by ModelConfig; every registered family builds it.

Family differences are flags of the config, which each family class reads from config.json
(inference/models/<family>.py): qkv_bias, o_proj's bias (naming.o_proj_has_bias), qk_norm (RMSNorm per
head on q and k before rotary), tie_word_embeddings (the LM head shares the embedding's Parameter),
sliding_window, rope (llama3 scaling), and for MoE families the sparse MLP of each MoE layer
(inference/layers/moe.py; ModelConfig.is_moe_layer).

`quantization` "fp8" (EngineConfig.quantization) builds the attention and MLP linears with FP8 weights
(inference/layers/linear.py); the embedding, the norms and the LM head stay in the model dtype.
`batch_invariant` (EngineConfig.batch_invariant) reaches every layer through _Build: products, norms, the
activation and the LM head then compute each row alone (docs/invariance.md); attention is the backend's.

Model math only: TPInfo comes in, no process group is created here. Parameter names are fixed here
(qkv_proj and gate_up_proj fused); the family maps its checkpoint's names onto them (inference/models/naming.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inference.batch import AttentionMetadata
from inference.config import ModelConfig
from inference.layers.activation import SiluAndMul, get_activation
from inference.layers.attention import Attention, AttentionBackend
from inference.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from inference.layers.gemv import silu_mul_gemv, use_silu_mul_gemv
from inference.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from inference.layers.moe import MoEBlock
from inference.layers.norm import RMSNorm
from inference.layers.rotary import Rope, RotaryEmbedding
from inference.models.naming import o_proj_has_bias
from inference.parallel import TPInfo


@dataclass(frozen=True)
class KVCacheSpec:
    """What the runner needs to size and bind the KV cache of this rank."""

    num_layers: int
    num_kv_heads: int  # local to this rank
    head_dim: int

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape bind_kv_cache expects: [2 (k, v), layers, blocks, block_size, kv_heads, head_dim]."""
        return (2, self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize


@dataclass(frozen=True)
class _Build:
    """Everything a submodule needs to build itself (kept together to keep signatures short)."""

    config: ModelConfig
    tp: TPInfo
    dtype: torch.dtype
    device: torch.device | str
    invariant: bool = False  # the batch-invariant mode
    fp8: bool = False  # the linears' weights in FP8 (EngineConfig.quantization); embeddings, norms, LM head not


class DecoderAttention(nn.Module):
    def __init__(self, b: _Build, backend: AttentionBackend) -> None:
        super().__init__()
        c, tp = b.config, b.tp
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads,
                                          c.qkv_bias, tp, b.dtype, b.device, b.invariant, b.fp8)
        self.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, o_proj_has_bias(c),
                                        tp, b.dtype, b.device, b.invariant, b.fp8)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, b.dtype, b.device, b.invariant)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, b.dtype, b.device, b.invariant)
        self.qk_norm = c.qk_norm
        self.attn = Attention(self.qkv_proj.num_heads_local, self.qkv_proj.num_kv_heads_local,
                              c.head_dim, c.head_dim ** -0.5, c.sliding_window, backend)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), rope, meta)

    def attend(self, qkv: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        """forward after the qkv projection (DecoderLayer fuses the input norm into that projection)."""
        q, k, v = self.qkv_proj.split(qkv)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, meta, rope)  # the backend rotates q and k (in its kernel where it can)
        return self.o_proj(out.reshape(out.shape[0], -1))


class DecoderMLP(nn.Module):
    def __init__(self, b: _Build) -> None:
        super().__init__()
        c = b.config
        self.gate_up_proj = MergedColumnParallelLinear(
            c.hidden_size, [c.intermediate_size] * 2, False, b.tp, b.dtype, b.device, b.invariant, b.fp8)
        self.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, False, b.tp, b.dtype, b.device,
                                           b.invariant, b.fp8)
        self.act_fn = get_activation(c.hidden_act, b.invariant)
        self.invariant = b.invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activate_down(self.gate_up_proj(x))

    def activate_down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward after the gate_up projection (DecoderLayer fuses the post-attention norm into it)."""
        fuse = isinstance(self.act_fn, SiluAndMul) and self.down_proj.bias is None and self.down_proj.lora is None
        if not self.invariant and fuse and use_silu_mul_gemv(gate_up, self.down_proj.weight):
            # One row: the down projection forms silu(gate) * up itself (one launch fewer per layer).
            return self.down_proj.reduce(silu_mul_gemv(gate_up, self.down_proj.weight,
                                                       scale=self.down_proj.weight_scale))
        return self.down_proj(self.act_fn(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, b: _Build, backend: AttentionBackend, index: int = 0) -> None:
        super().__init__()
        c = b.config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, b.dtype, b.device, b.invariant)
        self.self_attn = DecoderAttention(b, backend)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, b.dtype, b.device, b.invariant)
        self.mlp: DecoderMLP | MoEBlock = (MoEBlock(c, b.tp, b.dtype, b.device, b.invariant)
                                           if c.is_moe_layer(index) else DecoderMLP(b))
        self.invariant = b.invariant

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual block: returns (this block's MLP output, the residual stream before it).

        The residual adds are in the model dtype, as HF does, fused with the following norm, which is
        itself fused into the next projection at decode batch sizes (RMSNorm.linear; never in the mode).
        """
        qkv, residual = self.input_layernorm.linear(x, residual, self.self_attn.qkv_proj)
        h = self.self_attn.attend(qkv, rope, meta)
        if isinstance(self.mlp, MoEBlock):
            h, residual = self.post_attention_layernorm.add_forward(h, residual)
            return self.mlp(h), residual
        gate_up, residual = self.post_attention_layernorm.linear(h, residual, self.mlp.gate_up_proj)
        return self.mlp.activate_down(gate_up), residual


class DecoderModel(nn.Module):
    def __init__(self, b: _Build, backend: AttentionBackend) -> None:
        super().__init__()
        c = b.config
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, b.tp, b.dtype, b.device)
        self.layers = nn.ModuleList(DecoderLayer(b, backend, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, b.dtype, b.device, b.invariant)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope, b.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb.prepare(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return self.norm.add_forward(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    """The model the runner drives.

    forward(input_ids [T], positions [T], meta) -> hidden [T, hidden] over the flattened varlen batch;
    compute_logits(hidden [N, hidden]) -> [N, vocab_size] (full vocab on every rank).
    Parameters are uninitialized until load_weights (or a weight sync) fills them.
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend, batch_invariant: bool = False, quantization: str = "none") -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.quantization = quantization
        b = _Build(config, tp, dtype, device, batch_invariant, quantization == "fp8")
        # `model` is registered before `lm_head` so that a tied weight is named model.embed_tokens.weight.
        self.model = DecoderModel(b, backend)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype, device, tied_to=tied,
                                      invariant=batch_invariant)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, (input_ids.shape, positions.shape)
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]

    def bind_routing(self, buffer: torch.Tensor | None) -> None:
        """Every forward writes token t's expert ids of the j-th MoE layer into buffer[t, j]
        ([rows, moe layers, k], rows at least any forward's tokens); None: no record."""
        blocks = self.moe_blocks()
        want = (len(blocks), self.config.num_experts_per_tok)
        assert buffer is None or (buffer.dim() == 3 and tuple(buffer.shape[1:]) == want), (
            f"routing buffer {None if buffer is None else tuple(buffer.shape)}: expected [rows, *{want}]")
        for j, block in enumerate(blocks):
            block.routing_out = None if buffer is None else buffer[:, j]

    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.attention_layers()[0]
        return KVCacheSpec(len(self.model.layers), attn.num_kv_heads, attn.head_dim)

    def bind_kv_cache(self, kv: torch.Tensor) -> None:
        """Give layer i the views kv[0, i] (keys) and kv[1, i] (values); no copies are made."""
        spec = self.kv_cache_spec()
        assert kv.dim() == 6 and kv.shape == spec.shape(kv.shape[2], kv.shape[3]), (
            f"KV cache shape {tuple(kv.shape)} does not fit {spec}")
        for i, attn in enumerate(self.attention_layers()):
            attn.bind_kv_cache(kv[0, i], kv[1, i])

    def unbind_kv_cache(self) -> None:
        """Drop every view of the KV cache, so that freeing the cache tensor really frees its memory."""
        for attn in self.attention_layers():
            attn.bind_kv_cache(None, None)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        for attn in self.attention_layers():
            attn.backend = backend
