"""A PEFT LoRA model of a tiny checkpoint (B drawn nonzero, so the adapter changes outputs) and its merged
weights as a checkpoint: the LoRA tests' trainer side and reference."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]  # k_proj and up_proj left out on purpose


def peft_model(base_dir: Path, rank: int = 4) -> Any:
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(hf, config)
    with torch.no_grad():  # PEFT starts B at zero, which would make the adapter a no-op
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def merged_dir(model: Any, base_dir: Path, out: Path) -> Path:
    """The PEFT model's merged weights as a checkpoint beside the base's tokenizer."""
    copy.deepcopy(model).merge_and_unload().save_pretrained(str(out))
    for f in base_dir.iterdir():
        if not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out
