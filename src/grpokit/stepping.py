"""One optimizer step over a window of micro-batches, with every backend's quirks in this one object.

- DDP / FSDP2: gradients are synchronised only on the window's last micro-batch (`no_sync` before it), or at every
  one with sync_each_batch.
- DeepSpeed: the engine takes the optimizer step inside the last micro-batch's backward, so the accumulation
  boundary is marked by hand, the loss (already normalised over the whole step) is not divided again, and a
  non-finite step cannot be skipped: training stops instead.
- Everywhere else a NaN/inf loss or gradient norm (on any process) skips the update, counted; too many in a row
  stop training.
The learning-rate schedule advances on every step, skipped ones included.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from dataclasses import dataclass

import torch

from .compat import set_accumulation_boundary
from .state import TrainerState


@dataclass
class StepResult:
    grad_norm: float
    learning_rate: float  # the rate this step was taken with
    applied: bool  # False when a non-finite loss or gradient skipped the update


class OptimizerStepper:
    def __init__(
        self,
        accelerator,
        model,
        optimizer,
        scheduler,
        *,
        max_grad_norm: float,
        max_nonfinite_steps: int,
        deepspeed: bool,
        sync_each_batch: bool = False,
    ):
        """sync_each_batch: synchronise gradients at every micro-batch, not only the window's last (accelerate's
        GradientAccumulationPlugin option: under FSDP2 each micro-batch's gradients are reduce-scattered into the
        shards at once rather than held whole until the last)."""
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.max_grad_norm, self.max_nonfinite_steps, self.deepspeed = max_grad_norm, max_nonfinite_steps, deepspeed
        self.sync_each_batch = sync_each_batch

    def micro_batch(self, is_last: bool):
        """The context one micro-batch's forward and backward run in."""
        if self.deepspeed:
            set_accumulation_boundary(self.accelerator, is_last)
        if is_last or self.sync_each_batch:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        # The loss is already normalised over the whole optimizer step: DeepSpeed must not divide it again.
        self.accelerator.backward(loss, **({"scale_wrt_gas": False} if self.deepspeed else {}))

    def step(self, loss_total: float, state: TrainerState) -> StepResult:
        """Clip, then apply the accumulated gradients unless they (or the loss) are non-finite on any process."""
        acc = self.accelerator
        grad_norm = acc.clip_grad_norm_(
            self.model.parameters(), self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        )
        learning_rate = self.scheduler.get_last_lr()[0]
        step_number = state.global_step + 1
        finite = math.isfinite(loss_total) and math.isfinite(float(grad_norm))
        if self.deepspeed and not finite:  # the engine has already applied it: stop rather than go on poisoned
            raise FloatingPointError(
                f"Step {step_number}: non-finite loss or gradient norm under DeepSpeed, which takes the optimizer "
                f"step inside backward(), so the update could not be skipped; resume from the last checkpoint with "
                f"a lower learning rate, or use DDP/FSDP2, where such steps are skipped."
            )
        # (accelerate's reduce knows "sum", "mean" and "max" only: any other name silently sums.)
        applied = acc.reduce(torch.tensor(float(not finite), device=acc.device), "max").item() == 0.0
        if applied:
            self.optimizer.step()
            state.nonfinite_in_a_row = 0
        else:
            state.nonfinite_steps += 1
            state.nonfinite_in_a_row += 1
            warnings.warn(
                f"Step {step_number}: non-finite loss or gradient norm; update skipped "
                f"({state.nonfinite_in_a_row} in a row).",
                RuntimeWarning,
                stacklevel=3,
            )
            if state.nonfinite_in_a_row >= self.max_nonfinite_steps:
                raise FloatingPointError(
                    f"{state.nonfinite_in_a_row} optimizer steps in a row had a NaN/inf loss or gradient; training "
                    f"stopped (max_nonfinite_steps={self.max_nonfinite_steps}). Lower the learning rate, check the "
                    f"rewards and inputs, or use bf16 instead of fp16."
                )
        with warnings.catch_warnings():  # a skipped update still advances the schedule, on purpose
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(float(grad_norm), learning_rate, applied)
