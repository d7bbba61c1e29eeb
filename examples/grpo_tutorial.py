"""The GRPO loop of docs/tutorial-grpo.md: rollouts from the sidecar, a group-relative policy gradient in the
trainer, and a sync with its audit after every optimizer step. Runs on a CPU in a minute.

    sidecar make-model ./tiny-model
    sidecar launch --model ./tiny-model &
    python examples/grpo_tutorial.py --url http://127.0.0.1:8000 --model ./tiny-model

The tiny model's weights are random, so the reward works on token ids: the share of digit tokens in a
completion. Replace `reward` and the prompts with your task. tests/test_examples.py runs this on the CPU.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def reward(token_ids: list[int], digits: set[int]) -> float:
    """The share of digit tokens: needs no meaning, so random weights can learn it."""
    return sum(t in digits for t in token_ids) / max(1, len(token_ids))


def grpo_loss(model: Any, outputs: list[Any], digits: set[int]) -> tuple[Any, float]:
    """GRPO: each sample's advantage is its reward against its group's mean (over the group's standard
    deviation); the loss is -advantage x the sample's log-probability, a mean over completion tokens."""
    import torch

    total, tokens, rewards = torch.zeros(()), 0, []
    for out in outputs:  # one prompt's group of samples per forward
        r = torch.tensor([reward(list(c.token_ids), digits) for c in out.outputs])
        rewards += r.tolist()
        adv = (r - r.mean()) / (r.std() + 1e-6)
        prompt = list(out.prompt_token_ids)
        for a, c in zip(adv, out.outputs, strict=True):
            ids = torch.tensor([prompt + list(c.token_ids)])
            logits = model(ids[:, :-1]).logits.float()[:, len(prompt) - 1:]
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt):, None])
            total = total - a * logp.sum()
            tokens += len(c.token_ids)
    return total / max(1, tokens), sum(rewards) / len(rewards)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the HF directory the sidecar serves")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (GRPO's group size)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference import SamplingParams
    from sidecar import SidecarClient
    from trainer_hooks import WeightSyncHook

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)  # the sidecar's weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    digits = {i for t, i in tok.get_vocab().items() if t.isdigit()}
    prompts = ["Count with me:", "The numbers are", "My phone number is", "Seven, eight,"]
    sampling = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)

    rewards = []
    with SidecarClient(args.url) as client, WeightSyncHook(client, model, sleep_level=1) as hook:
        for step in range(args.steps):
            outputs = hook.rollouts(prompts, sampling)  # wakes the sidecar; token ids and their logprobs
            with hook.training():  # sleeps the sidecar; on exit syncs the weights and audits every rank
                loss, mean_reward = grpo_loss(model, outputs, digits)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            rewards.append(round(mean_reward, 4))
            print(f"step {step}: reward {mean_reward:.3f}, rollouts from version {outputs[0].weight_version}, "
                  f"now version {hook.version}", flush=True)
        print(json.dumps({"version": hook.version, "rewards": rewards}), flush=True)


if __name__ == "__main__":
    main()
