"""A minimal plain-torch decoder (llama / qwen2 / qwen3 / mistral math) for the demo's trainer side.

Why it exists: the demo's trainer must not use the engine's model (the point is to show two
independent implementations agreeing through the weight wire), and transformers is only a dev
extra. `ToyPolicy` reads an HF model directory (config.json + model.safetensors) and computes the
same logits as transformers' *ForCausalLM (tests/test_trainer_hooks.py holds it to that).

Invariants:
- Parameter names are the HF names (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight,
  ..., lm_head.weight), so `named_parameters()` is what a sidecar sync expects.
- A tied lm_head IS the embedding Parameter: named_parameters() yields it once, as the embedding.
- Default rotary only (no rope scaling); full causal attention over unpadded batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from checksum import DTYPES
from inference.core import InvalidRequestError


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, self.nh, self.nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or h // self.nh
        bias = cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        # Qwen2's bias stops at v_proj; llama/qwen3 `attention_bias` covers o_proj too.
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias and cfg["model_type"] != "qwen2")
        self.qk_norm = cfg["model_type"] == "qwen3"
        if self.qk_norm:
            self.q_norm = _RMSNorm(self.hd, cfg["rms_norm_eps"])
            self.k_norm = _RMSNorm(self.hd, cfg["rms_norm_eps"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nh != self.nkv)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half convention: the two halves of each head are the (real, imaginary) pairs."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class _MLP(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        # Transformers' registration order, so named_parameters() lists the same names in the same order.
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = _RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = _RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = _RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class ToyPolicy(nn.Module):
    """logits = ToyPolicy(cfg)(input_ids [batch, time]) -> [batch, time, vocab] (see module docstring)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        if cfg.get("rope_scaling"):
            raise InvalidRequestError("rope_scaling", "the toy policy supports default rotary embeddings only")
        self.model = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
        # On the CPU even when built under a CUDA device context: the same table whatever the device.
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.to(input_ids.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.model.embed_tokens(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    @classmethod
    def from_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu") -> ToyPolicy:
        """Build from an HF directory; every checkpoint tensor must fill a parameter and vice versa."""
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        dtype = DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"), torch.float32)
        with torch.device(device):  # parameters are initialised where they will live (0.5B in fp32: fast on a GPU)
            policy = cls(cfg)
        state = load_file(str(model_dir / "model.safetensors"))
        if cfg.get("tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # some tied checkpoints carry it; it IS the embedding
        missing, unexpected = policy.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and cfg.get("tie_word_embeddings"))]
        if missing or unexpected:
            raise InvalidRequestError("model_dir", f"{model_dir}: missing {missing}, unexpected {unexpected}")
        return policy.to(device=device, dtype=dtype)


def token_logprobs(policy: nn.Module, sequences: torch.Tensor, num_prompt: int) -> torch.Tensor:
    """log p(token t | tokens < t) for the completion part of equal-length sequences: [batch, time - num_prompt]."""
    logits = policy(sequences[:, :-1]).float()
    logp = torch.log_softmax(logits[:, num_prompt - 1:], dim=-1)
    return logp.gather(-1, sequences[:, num_prompt:, None]).squeeze(-1)
