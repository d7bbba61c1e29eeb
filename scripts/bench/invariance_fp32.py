"""How far an engine's rollout logprobs are from an fp32 forward of the same weights (the
batch-invariant mode must be no less accurate than the default engine).

For each engine and sampling mode, the "alone" case's requests of scripts/bench/invariance.py are run
through a float32 copy of the engine's own target model: the same parameter values (bf16 upcast exactly
by copy_), built by build_model in float32 on the same device with the plain layers and the reference
attention. One forward of prompt + completion per request (trainer_hooks/logprob_gap.trainer_logprobs,
the trainer-side gap's code) gives each generated token's fp32 logprob: the raw log_softmax of the
logits at temperature 1, which is what the engine reports for greedy and for temperature-1 sampling
(SamplingParams logprobs_mode="raw", the default; inference/sample/sampler.py gathers raw.logprobs). Lines:

- invariance_fp32_error: per (engine, mode), mean / max |engine logprob - fp32 logprob| over the tokens;
- invariance_fp32_error_cmp: per mode, the batch-invariant engine's mean against the default's.
  within: mode_mean_abs - default_mean_abs <= max(5% of default_mean_abs, 2 standard errors of that
  difference). The two engines' completions part after their first differing token, so the means are
  over different tokens and carry sampling noise (a few percent over a few thousand tokens); the 2-SE
  term keeps that noise from failing the check, the 5% floor states what "no worse" allows when the
  noise is smaller.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence

import torch
from torch import nn

from inference.batch import AttentionMetadata
from inference.core import RequestOutput
from inference.engine.llm import LLM
from inference.models import DecoderForCausalLM, build_model
from inference.parallel import TPInfo
from trainer_hooks.logprob_gap import completions, trainer_logprobs

REL_TOLERANCE = 0.05
SE_TOLERANCE = 2.0


class PrefillLogits(nn.Module):
    """ids [B, W] -> logits [B, W, vocab]: each row one prefill of a fresh sequence through `model`,
    in the model's dtype, on a KV cache of its own (so trainer_logprobs can drive the engine's model)."""

    def __init__(self, model: DecoderForCausalLM, max_len: int, block_size: int = 16) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size
        self.max_len = max_len
        param = next(model.parameters())
        blocks = -(-max_len // block_size)
        model.bind_kv_cache(torch.zeros(model.kv_cache_spec().shape(blocks, block_size), dtype=param.dtype,
                                        device=param.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        device = next(self.model.parameters()).device
        rows = []
        for row in ids:
            n = row.numel()
            assert n <= self.max_len, (n, self.max_len)
            table = list(range(-(-n // self.block_size)))
            meta = AttentionMetadata.build([n], [n], list(range(n)), [table], self.block_size, device)
            hidden = self.model(row, torch.arange(n, device=device), meta)
            rows.append(self.model.compute_logits(hidden))
        return torch.stack(rows)


def fp32_copy(llm: LLM) -> DecoderForCausalLM:
    """The engine's target model in float32 with the engine's parameter values (TP 1 only)."""
    src = llm.worker.models["target"]
    if llm.worker.tp.size != 1:
        raise ValueError(f"the fp32 reference needs tensor-parallel size 1, the engine has {llm.worker.tp.size}")
    param = next(src.parameters())
    model = build_model(src.config, TPInfo(), torch.float32, param.device)
    ours, theirs = dict(model.named_parameters()), dict(src.named_parameters())
    if ours.keys() != theirs.keys():
        odd = sorted(ours.keys() ^ theirs.keys())
        raise RuntimeError(f"the fp32 model's parameters differ from the engine's: {odd}")
    with torch.no_grad():
        for name, p in ours.items():
            p.copy_(theirs[name])
    return model


def abs_errors(llm: LLM, outs: Sequence[RequestOutput | None], max_len: int) -> torch.Tensor:
    """|engine logprob - fp32 logprob| (float64, CPU) of every generated token of `outs`, in order."""
    items = completions([o for o in outs if o is not None])
    model = PrefillLogits(fp32_copy(llm), max_len)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 reference, not TF32's 10-bit mantissa
    try:
        diffs = [(trainer_logprobs(model, [(p, c)])[0].double() - torch.tensor(r, dtype=torch.float64)).abs()
                 for p, c, r in items]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        model.model.unbind_kv_cache()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)


def error_line(engine: str, mode: str, errs: torch.Tensor) -> dict[str, object]:
    n = errs.numel()
    return {"bench": "invariance_fp32_error", "engine": engine, "mode": mode,
            "mean_abs": errs.mean().item() if n else 0.0, "max_abs": errs.max().item() if n else 0.0, "tokens": n}


def cmp_line(mode: str, inv: torch.Tensor, dflt: torch.Tensor) -> dict[str, object]:
    """The batch-invariant engine's mean |error| against the default's (module docstring: `within`)."""
    a, b = inv.mean().item(), dflt.mean().item()
    se = math.sqrt(inv.var().item() / inv.numel() + dflt.var().item() / dflt.numel()) if min(
        inv.numel(), dflt.numel()) > 1 else 0.0
    tolerance = max(REL_TOLERANCE * b, SE_TOLERANCE * se)
    return {"bench": "invariance_fp32_error_cmp", "mode": mode, "mode_mean_abs": a, "default_mean_abs": b,
            "mode_over_default": round(a / b, 4) if b > 0 else None, "stderr_diff": se,
            "tolerance": tolerance, "within": a - b <= tolerance}
