"""Shared helpers for model tests: tiny random HF checkpoints per family, a toy paged-KV allocator,
and HF reference logits. CPU, fp32."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from inference.batch import AttentionMetadata
from inference.models import DecoderForCausalLM, build_model
from inference.models.hf_config import read_model_config
from inference.models.loader import load_weights
from inference.parallel import TPInfo

_BASE: dict[str, Any] = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
)

# case name -> (transformers config class name, overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"rope_theta": 500.0}),
    "llama3": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    # Layer 1 keeps a dense MLP; softmax, top-2 of 8, not renormalised.
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 6, "num_experts_per_tok": 2, "sliding_window": None}),
}


def make_hf_checkpoint(case: str, path: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Write a random HF model of `case` to `path` (safetensors) and return it in eval mode (eager attn).

    Norm weights and biases are randomized so that a loader that skips them cannot pass.
    """
    import transformers

    cls_name, case_kwargs = CASES[case]
    kwargs = {**_BASE, **case_kwargs, **overrides}
    rope_scaling = kwargs.pop("rope_scaling", None)
    theta = kwargs.pop("rope_theta", 10000.0)
    cfg = getattr(transformers, cls_name)(**kwargs)
    cfg.rope_parameters = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": theta}
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                          attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def load_ours(path: Path, tp: TPInfo | None = None, num_blocks: int = 48,
              block_size: int = 4) -> DecoderForCausalLM:
    """Build + load our model from an HF dir and bind a zeroed KV cache."""
    config = read_model_config(path)
    model = build_model(config, tp or TPInfo(), torch.float32, "cpu")
    load_weights(model, path)
    model.bind_kv_cache(torch.zeros(model.kv_cache_spec().shape(num_blocks, block_size)))
    return model


class ToyPager:
    """Assigns shuffled (non-contiguous) blocks to sequences and builds one step's tensors."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]]
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """One forward's (input_ids, positions, meta); new_tokens maps seq id -> its new token ids."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens, ctx_lens, tables = [], [], []
        for sid, toks in new_tokens.items():
            blocks = self.blocks.setdefault(sid, [])
            start = self.lens.get(sid, 0)
            for p in range(start, start + len(toks)):
                if p // self.block_size >= len(blocks):
                    blocks.append(self.free.pop())
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
                pos.append(p)
            ids += toks
            self.lens[sid] = start + len(toks)
            q_lens.append(len(toks))
            ctx_lens.append(self.lens[sid])
            tables.append(list(blocks))
        meta = AttentionMetadata.build(q_lens, ctx_lens, slots, tables, self.block_size, "cpu")
        return torch.tensor(ids), torch.tensor(pos), meta


def our_logits(model: DecoderForCausalLM, pager: ToyPager,
               new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Run one step; seq id -> logits [len(new tokens), vocab]."""
    input_ids, positions, meta = pager.step(new_tokens)
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, meta))
    out, start = {}, 0
    for sid, toks in new_tokens.items():
        out[sid] = logits[start:start + len(toks)]
        start += len(toks)
    return out


def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """HF logits [len(tokens), vocab] for one unpadded sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
