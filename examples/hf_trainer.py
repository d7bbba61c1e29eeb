"""A Hugging Face Trainer with the Sidecar callback (needs the dev extra: transformers and accelerate).

    sidecar make-model MODEL_DIR          # or any HF checkpoint directory
    sidecar launch --model MODEL_DIR &
    python examples/hf_trainer.py --url http://127.0.0.1:8000 --model MODEL_DIR

The trainer and the sidecar load the same directory, so they start from the same weights (the
tiny model's are random: its text is gibberish). tests/test_examples.py runs this on the CPU.

The callback puts the sidecar to sleep when training starts, syncs (and audits) the weights after
every `--sync-every` optimizer steps, and wakes it when training ends; rollouts can then be
generated from exactly the trained weights. The Trainer folds gradient accumulation into its
optimizer steps, so the hook keeps grad_accum_steps=1.
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()

    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    from inference.core import SamplingParams
    from sidecar.client import SidecarClient
    from trainer_hooks import WeightSyncHook
    from trainer_hooks.hf_callback import sidecar_callback

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    texts = ["one two three four five", "the river ran slowly past the old mill"] * 16
    data = [{"input_ids": ids, "labels": ids} for ids in (tok.encode(t) for t in texts)]

    with (SidecarClient(args.url) as client, WeightSyncHook(client, model, sync_every=args.sync_every) as hook,
          tempfile.TemporaryDirectory(prefix="hf-trainer-sidecar-") as out_dir):
        trainer = Trainer(model=model, train_dataset=data, callbacks=[sidecar_callback(hook)],
                          args=TrainingArguments(output_dir=out_dir, max_steps=args.steps,
                                                 per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                                 learning_rate=1e-3, report_to=[], save_strategy="no",
                                                 dataloader_pin_memory=torch.cuda.is_available()))
        trainer.train()
        out = hook.rollouts(["one two"], SamplingParams(temperature=0.0, max_tokens=8))
        print(f"weight version {out[0].weight_version}: {out[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
