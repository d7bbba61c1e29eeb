"""A GRPO-style loop on DeepSpeed ZeRO-3 with the Sidecar hook (needs the deepspeed extra and a GPU).

    sidecar launch --model MODEL_DIR --device cuda &          # on its own GPU(s): the nccl backend
    deepspeed --num_gpus 2 examples/deepspeed_grpo.py --url http://127.0.0.1:8000 --model MODEL_DIR

On one GPU shared with the sidecar, pass --sender ipc (NCCL cannot put two ranks on one GPU).
tests/test_examples.py runs it that way on a GPU machine (marked cuda).

Every rank runs the hook (ZeRO-3 gathers parameters a group at a time and every rank must enter
each gather); rank 0 alone talks to the sidecar and broadcasts the rollouts to the other ranks.
The reward is a toy one (the fraction of digit tokens); replace `reward` with yours.
"""

from __future__ import annotations

import argparse
from typing import Any


def reward(token_ids: list[int], digits: set[int]) -> float:
    return sum(t in digits for t in token_ids) / max(1, len(token_ids))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the HF directory the sidecar serves")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--sender", choices=("nccl", "ipc"), default="nccl",
                   help="the weight wire: nccl (the sidecar on other GPUs) or ipc (on this GPU)")
    p.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    args = p.parse_args()

    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.core import SamplingParams
    from sidecar.client import SidecarClient
    from trainer_hooks import WeightSyncHook

    deepspeed.init_distributed()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3},  # torch_adam: torch's AdamW, no extension to compile
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "torch_adam": True}}}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tok = AutoTokenizer.from_pretrained(args.model)
    digits = {i for t, i in tok.get_vocab().items() if t.isdigit()}
    prompts = [tok.encode(text) for text in ("Count with me:", "The numbers are", "My phone number is")]
    sampling = SamplingParams(n=args.samples, temperature=1.0, max_tokens=32)

    client = SidecarClient(args.url) if torch.distributed.get_rank() == 0 else None
    with WeightSyncHook(client, engine, sender=args.sender) as hook:
        batch = hook.rollouts(prompts, sampling, broadcast=True)
        for _ in range(args.steps):
            hook.before_training()
            _grpo_step(engine, batch, digits)
            hook.after_optimizer_step()  # every rank: gathers, rank 0 syncs + audits
            batch = hook.rollouts(prompts, sampling, broadcast=True)
        if client is not None:
            print(f"weight version {batch[0].weight_version} after {args.steps} steps", flush=True)


def _grpo_step(engine: Any, batch: list[Any], digits: set[int]) -> None:
    import torch

    for out in batch:  # one group (the n samples of a prompt) per micro-step
        seqs = [list(out.prompt_token_ids) + list(c.token_ids) for c in out.outputs]
        r = torch.tensor([reward(c.token_ids, digits) for c in out.outputs], device=engine.device)
        adv = r - r.mean()
        # samples end at different lengths (a stop token): pad on the right and mask the padding out
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=engine.device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=engine.device)
        n = len(out.prompt_token_ids)
        logits = engine(ids[:, :-1], attention_mask=mask[:, :-1]).logits.float()[:, n - 1:]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, n:, None]).squeeze(-1)
        completion = mask[:, n:].float()
        engine.backward(-(adv[:, None] * logp * completion).sum() / completion.sum().clamp(min=1.0))
    engine.step()


if __name__ == "__main__":
    main()
