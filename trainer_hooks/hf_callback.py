"""A Hugging Face `transformers.TrainerCallback` driving a WeightSyncHook (transformers imported lazily).

    hook = WeightSyncHook(client, model)
    trainer = Trainer(model=model, ..., callbacks=[sidecar_callback(hook)])

on_train_begin -> hook.before_training() (the sidecar sleeps); on_step_end (once per optimizer
step: the Trainer already folds gradient accumulation, so the hook must be built with
grad_accum_steps=1) -> hook.after_optimizer_step(); on_train_end -> a last sync if optimizer
steps ran since the last one, then the sidecar is woken for rollouts. Every rank runs the
callback (the Trainer calls callbacks on all processes), as the hook's sources need.
"""

from __future__ import annotations

import functools
from typing import Any

from trainer_hooks.hook import WeightSyncHook


def sidecar_callback(hook: WeightSyncHook, *, final_sync: bool = True) -> Any:
    """A TrainerCallback instance bound to `hook` (see module docstring)."""
    if hook.grad_accum_steps != 1:
        raise ValueError("the HF Trainer calls on_step_end once per optimizer step: build the hook with "
                         f"grad_accum_steps=1 (got {hook.grad_accum_steps})")
    return _callback_class()(hook, final_sync)


@functools.cache
def _callback_class() -> type:
    """Built on first use, so importing this module does not import transformers."""
    from transformers import TrainerCallback

    class SidecarCallback(TrainerCallback):  # type: ignore[misc,valid-type]
        def __init__(self, hook: WeightSyncHook, final_sync: bool) -> None:
            self.hook, self.final_sync = hook, final_sync

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.hook.before_training()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.hook.after_optimizer_step()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.final_sync and self.hook.optimizer_steps % self.hook.sync_every:
                self.hook.sync()  # the last steps' weights, not yet synced
            self.hook.wake()

    return SidecarCallback
