"""What `GRPOTrainer.train` keeps while it runs (`TrainRun`): the metrics sink, the progress bar, the SIGTERM watch,
the step it started at and each step's loss; and the step schedules, with transformers' rules (its
`DefaultFlowCallback`) for when a step writes a metrics record, evaluates and saves."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from .checkpoint.preemption import SigtermCheckpoint
from .distributed import all_processes_done
from .logs import MetricSink


def as_steps(value: float, max_steps: int) -> int:
    """TrainingArguments allow a fraction of the run for logging/saving intervals."""
    return max(1, math.ceil(value * max_steps)) if 0 < value < 1 else max(1, int(value))


@dataclass
class TrainRun:
    """What train() keeps while it runs (`begin_run`)."""

    sink: MetricSink
    bar: Any  # the progress bar (tqdm)
    logging_steps: int  # the step schedules, in steps
    eval_steps: int
    save_steps: int
    preemption: SigtermCheckpoint | None  # enable_jit_checkpoint: the SIGTERM watch
    first_step: int  # the step it started (or resumed) at
    started: float = field(default_factory=time.perf_counter)
    losses: list[float] = field(default_factory=list)  # each optimizer step's

    def preempted(self) -> bool:
        """A SIGTERM on any process (enable_jit_checkpoint): every process then saves this step and stops. A
        collective: every process asks at every step."""
        return self.preemption is not None and not all_processes_done(not self.preemption.requested)

    def log_due(self, args, step: int, epoch_ended: bool, control) -> bool:
        """Whether this step writes a metrics record: logging_strategy's schedule, the first step, a callback's
        should_log (with 'no', only that). The metrics of the steps after the last record go into the final
        summary (`GRPOTrainer.log`)."""
        strategy = args.logging_strategy
        due = (strategy == "steps" and step % self.logging_steps == 0) or (strategy == "epoch" and epoch_ended)
        if strategy == "no":  # not even logging_first_step (grpokit's default True would override the choice)
            return control.should_log
        return due or (step == 1 and args.logging_first_step) or control.should_log

    def evaluate_due(self, args, step: int, control) -> bool:
        """Whether this step evaluates: eval_strategy 'steps' every eval_steps from eval_delay on, or a callback's
        should_evaluate."""
        scheduled = args.eval_strategy == "steps" and step % self.eval_steps == 0 and step >= args.eval_delay
        return scheduled or control.should_evaluate

    def save_due(self, args, step: int, epoch_ended: bool, control) -> bool:
        """Whether this step saves a checkpoint: save_strategy's schedule ('steps', 'epoch'), or a callback's
        should_save."""
        scheduled = args.save_strategy == "steps" and step % self.save_steps == 0
        return scheduled or control.should_save or (args.save_strategy == "epoch" and epoch_ended)


def begin_run(args, state, is_main_process: bool, progress_label: str) -> TrainRun:
    """A run starting at state.global_step: the metrics sink (its records after that step dropped: a resumed run
    writes them again), the step schedules, the progress bar, the SIGTERM watch (enable_jit_checkpoint)."""
    from tqdm.auto import tqdm

    sink = MetricSink(
        args.output_dir, args.report_to, args.run_name, args.logging_dir, args.to_dict(), enabled=is_main_process
    )
    sink.truncate_after(state.global_step)
    bar = tqdm(
        total=state.max_steps,
        initial=state.global_step,
        desc=progress_label,
        disable=args.disable_tqdm or not is_main_process,
        dynamic_ncols=True,
    )
    return TrainRun(
        sink,
        bar,
        logging_steps=as_steps(args.logging_steps, state.max_steps),
        eval_steps=as_steps(args.eval_steps or args.logging_steps, state.max_steps),
        save_steps=as_steps(args.save_steps, state.max_steps),
        preemption=SigtermCheckpoint() if args.enable_jit_checkpoint else None,
        first_step=state.global_step,
    )
