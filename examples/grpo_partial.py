"""GRPO with partial rollouts and over-sampling: a step trains on the first groups that finish, not on all.

    sidecar make-model MODEL_DIR          # or any HF checkpoint directory
    sidecar launch --model MODEL_DIR &
    python examples/grpo_partial.py --url http://127.0.0.1:8000 --model MODEL_DIR

Each step asks for `--groups` finished groups (a prompt's `--samples` samples) with
`hook.rollouts(new_prompts, sampling, min_groups=G)`: the sidecar returns as soon as G groups are done,
oldest first, and keeps generating the rest (the tail), which later steps take first. Over-sampling
keeps `--oversample` more groups in flight than a step consumes, so the step never waits for its
slowest sample. Samples of a carried-over group may have begun under older weights: the loss corrects
for it with truncated importance sampling against the rollout's own logprobs (docs/async-rl.md).
The lengths here are drawn per prompt (lognormal, like scripts/bench_rollout.py) because the tiny
model's random weights rarely stop by themselves; the reward counts digit tokens. Replace both.
tests/test_examples.py runs this on the CPU (the dev extra brings transformers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from typing import Any


def reward(token_ids: list[int], digits: set[int]) -> float:
    return sum(t in digits for t in token_ids) / max(1, len(token_ids))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the HF directory the sidecar serves")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--groups", type=int, default=4, help="groups (prompts) one step trains on")
    p.add_argument("--oversample", type=int, default=2, help="groups kept in flight beyond a step's")
    p.add_argument("--samples", type=int, default=4, help="samples per group (GRPO's n)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--tis-cap", type=float, default=2.0, help="truncation of the importance weights")
    p.add_argument("--pool", default="grpo-partial", help="the sidecar's pool id (a restart takes what is left)")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from inference.core import SamplingParams
    from sidecar.client import SidecarClient
    from trainer_hooks import WeightSyncHook

    torch.manual_seed(0)
    rng = random.Random(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    digits = {i for t, i in tok.get_vocab().items() if t.isdigit()}
    dataset = itertools.cycle([tok.encode(t) for t in ("Count with me:", "The numbers are", "My phone number is",
                                                       "Seven, eight,", "Call 555")])

    def sampling() -> SamplingParams:  # one prompt's: its length stands in for where a real model would stop
        length = min(args.max_tokens, max(4, int(rng.lognormvariate(3.0, 1.0))))
        return SamplingParams(n=args.samples, temperature=1.0, max_tokens=length, ignore_eos=True,
                              seed=rng.randrange(2**31))

    seen: set[str] = set()
    totals: dict[str, Any] = {"groups": 0, "carried": 0, "staleness_samples": {}}
    with SidecarClient(args.url) as client, WeightSyncHook(client, model, rollout_pool=args.pool) as hook:
        # the first step fills the pool with G + oversample groups; each later step adds the G it consumed
        fresh = args.groups + args.oversample
        for step in range(args.steps):
            prompts = [next(dataset) for _ in range(fresh)]
            batch = hook.rollouts(prompts, [sampling() for _ in prompts], min_groups=args.groups)
            fresh = len(batch)
            assert not seen & {o.request_id for o in batch}, "a group came back twice"
            seen.update(o.request_id for o in batch)
            _note(totals, hook.stats)
            with hook.training():  # sleep (the tail is held), train, sync + audit on exit
                loss = _grpo_loss(model, batch, digits, args.tis_cap)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            print(f"step {step}: {len(batch)} groups ({hook.stats['rollout_carried']} carried over), "
                  f"staleness {hook.stats['staleness_samples']}, {hook.stats['rollout_left']} left in the pool, "
                  f"loss {loss.item():.4f}", flush=True)
        summary = {"version": hook.version, **totals, "left": client.rollout_counts(args.pool)}
    print(json.dumps(summary), flush=True)


def _note(totals: dict[str, Any], stats: dict[str, Any]) -> None:
    totals["groups"] += stats["rollout_groups"]
    totals["carried"] += stats["rollout_carried"]
    for lag, count in stats["staleness_samples"].items():
        totals["staleness_samples"][lag] = totals["staleness_samples"].get(lag, 0) + count


def _grpo_loss(model: Any, batch: list[Any], digits: set[int], tis_cap: float) -> Any:
    """GRPO's group-relative advantage with truncated importance sampling: each token's policy-gradient
    term is weighted by min(pi_train / pi_rollout, tis_cap), pi_rollout being the logprob the sidecar
    sampled it with (its `logprobs`, raw by default: docs/dev/design.md). Tokens from older weights (a
    carried-over group) and any numerical gap between the engines are corrected alike; the cap bounds
    the variance. Padding is masked out, so the loss is a mean over completion tokens."""
    import torch

    total, count = torch.zeros(()), 0
    for out in batch:  # one group per forward
        seqs = [list(out.prompt_token_ids) + list(c.token_ids) for c in out.outputs]
        r = torch.tensor([reward(c.token_ids, digits) for c in out.outputs])
        adv = (r - r.mean()) / (r.std() + 1e-6) if len(r) > 1 else r - r.mean()
        width, n = max(len(s) for s in seqs), len(out.prompt_token_ids)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1.0] * len(s) + [0.0] * (width - len(s)) for s in seqs])[:, n:]
        rollout = torch.tensor([list(c.logprobs) + [0.0] * (width - n - len(c.logprobs)) for c in out.outputs])
        logits = model(ids[:, :-1]).logits.float()[:, n - 1:]  # right padding: causal attention never sees it
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, n:, None]).squeeze(-1)
        weight = torch.exp(logp.detach() - rollout).clamp(max=tis_cap)
        total = total - (weight * adv[:, None] * logp * mask).sum()
        count += int(mask.sum())
    return total / max(1, count)


if __name__ == "__main__":
    main()
