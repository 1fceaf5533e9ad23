"""GRPOTrainer: rollout → rewards → advantages → μ optimisation passes → optimizer steps, on accelerate.

One training step, top to bottom (`train`; docs/guides/how-it-works.md walks through it):

    for each optimizer step:
        window = generation.take(gradient_accumulation_steps)    the next micro-batches (grpokit.generation): for
                                                                each generation batch (`generate_batch`: engine →
                                                                rewards → advantages → TrainBatch; or the producer's,
                                                                with max_staleness), for each of its μ passes, its
                                                                micro-batches in order
        optimizer_step(window): for each micro-batch, forward, loss, backward (`training_step`, `compute_loss`);
                                then one optimizer step (`OptimizerStepper`)
        _after_step: callbacks, log, evaluate, save, stop

Batch semantics are TRL's: the processes generate `generation_batch_size` = per_device_train_batch_size × processes
× steps_per_generation completions at a time (G per prompt; a prompt's group may span processes) and reuses them μ
times. An optimizer step may take micro-batches from two generation batches (steps_per_generation need not be a
multiple of gradient_accumulation_steps). Micro-batch losses are normalised by the counts of the whole optimizer
step's window, so how it is split does not change the update (except for `bnpo`, a per-micro-batch mean by
definition).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch
from accelerate.utils.memory import clear_device_cache
from torch.utils.data import DataLoader

from .batch import TrainBatch, trl_micro_batch
from .build import (
    activation_offload,
    build_checkpointer,
    build_entropy_controller,
    build_experience,
    build_runner,
    build_sampler,
    build_scheduler,
    build_scorer,
    build_stepper,
    build_trained_models,
    launch,
    moe_shape,
    new_state,
    place_reward_models,
    router_aux_loss_coef,
    run_inputs,
    total_steps,
    track_best_checkpoint,
)
from .checkpoint import TrainingParts
from .checkpoint.loop_state import loop_state, restore_loop
from .checkpoint.model_files import ModelWriter, load_best_checkpoint
from .checks import warn_unreadable_prompts
from .config import GRPOConfig
from .cpu_matmul import release_scratch
from .cpu_memory import reuse_activation_memory, trim_heap_in_backward
from .dataloaders import eval_dataloader, train_dataloader
from .distributed import at_least_global_quantile, is_sharded, unwrap_model
from .generation import Generation
from .hub import check_hub, push_folder
from .logprobs import check_padding_free
from .logs import MetricSink, MetricWindow, console_line, evaluation_line, reduce_step_metrics, train_summary
from .loss import off_policy_mask
from .micro_batch import micro_batch_loss, window_counts
from .model_card import run_model_card
from .models import sync_reference
from .producer import Producer, WeightSync, start_producer
from .rewards.model import RewardModel
from .rollout import RolloutEngine
from .served import check_step, take_step_totals
from .signals import SignalWarnings
from .state import Callbacks
from .train_run import TrainRun, begin_run

logger = logging.getLogger(__name__)


class GRPOTrainer:
    scores_completions = True  # False: an objective without rewards (DistillationTrainer): none asked for or scored
    progress_label = "GRPO"  # the progress bar's
    config_file = "grpo_config.json"  # the configuration as written, in output_dir

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        rollout_engine: RolloutEngine | None = None,
        teacher_model=None,
        environment=None,
    ):
        """TRL 1.16's arguments, in its order, plus `rollout_engine` (any `RolloutEngine`; default: sampling in this
        process with `HFEngine`) and `teacher_model` (a model or path sharing the policy's tokenizer: its per-token
        signal, weighted by teacher_kl_coef, joins the reward advantages; grpokit.teacher) and `environment` (an
        environment of another library, trained on as it is: its prompts, rewards and turns; grpokit.integrations)."""
        self.args = args = args or GRPOConfig()
        # Everything a user can get wrong in the data or rewards is checked before the model is loaded.
        inputs = run_inputs(
            args,
            train_dataset,
            eval_dataset,
            reward_funcs,
            reward_processing_classes,
            rollout_engine,
            tools,
            rollout_func,
            environment_factory,
            environment,
            rewards_required=self.scores_completions,
        )
        self.train_dataset, self.eval_dataset = inputs.train_dataset, eval_dataset
        self.reward_functions, self.reward_weights = inputs.reward_functions, inputs.reward_weights
        if args.push_to_hub:
            check_hub(args)

        acc, wrapped = launch(args, model, quantization_config, rollout_engine, peft_config)
        self.accelerator = acc
        self.weights, self.producer = WeightSync(), None  # asynchronous generation (grpokit.producer)
        self._restored_in_flight: list[dict] = []  # generation batches in flight that a checkpoint held
        optimizer, scheduler = optimizers
        models = build_trained_models(
            model, processing_class, peft_config, quantization_config, optimizer, args, acc, inputs, wrapped
        )
        self.model, self.optimizer, self.reference = models.policy, models.optimizer, models.reference
        self.processing_class, self._producer_copy = models.processing_class, models.producer_copy
        place_reward_models(self.reward_functions, acc.device)
        self._set_up_loop(inputs, models, scheduler, teacher_model)
        self.router_aux_loss_coef = router_aux_loss_coef(args, self.unwrapped_model)
        self.activation_offload = activation_offload(args, acc.device)
        if args.padding_free:
            check_padding_free(self.model, self.reference, self.router_aux_loss_coef)
        self.entropy_controller = build_entropy_controller(args)
        self.callback_handler = Callbacks(
            callbacks, self.unwrapped_model, self.processing_class, self.optimizer, self.scheduler
        )
        self.callback_handler("on_init_end", args, self.state)

    def _set_up_loop(self, inputs, models, scheduler, teacher_model) -> None:
        """The parts the loop drives (grpokit.build): the rollout runner, reward scorer, state, scheduler, optimizer
        stepper, model writer, checkpointer, prompt sampler and experience maker; and the loop's records."""
        args, acc, deepspeed = self.args, self.accelerator, models.deepspeed
        # A user's rollout_func receives the trainer (TRL's contract): the runner passes it on as the host.
        self.runner = build_runner(inputs, models, args, acc, host=self)
        self.codec, self.engine, self.agents = self.runner.codec, self.runner.engine, self.runner.driver
        self.warn_unknown_prompt_tokens()
        self.scorer = build_scorer(self.reward_functions, self.reward_weights, self.codec.tokenizer, args)
        self.state = new_state(args, self.train_dataset, acc)
        self.scheduler = scheduler or build_scheduler(self.optimizer, args, self.state.max_steps)
        self.stepper = build_stepper(acc, self.model, self.optimizer, self.scheduler, args, deepspeed)
        self.model_writer = ModelWriter(
            self.unwrapped_model, self.processing_class, args.save_merged, self._model_card, not acc.is_main_process
        )
        sharded = is_sharded(self.unwrapped_model)
        self.checkpointer = build_checkpointer(acc, args, self.model_writer, deepspeed, sharded)
        self.sampler = build_sampler(self.train_dataset, args, acc.num_processes)
        self.experience, self.evaluator = build_experience(
            args,
            acc,
            self.runner,
            self.scorer,
            models,
            teacher_model,
            lambda n: self.sampler.rows(self.train_dataset, n),
        )
        self.window = MetricWindow()
        self._window_counts, self._step_stats, self._sink = None, [], None  # the current step's (compute_loss, log)
        self._samples: list[dict] | None = None  # the latest generation's completions-log rows
        self._batch_staleness: int | None = None  # max_staleness: the trained batch's (optimizer steps behind)
        # The micro-batches the loop trains on, one generation batch at a time (`generate_batch`, late-bound: a test
        # may replace it), and the cursor into them that checkpoints save.
        self.generation = Generation(
            lambda: self.generate_batch(), self.sampler, args.per_device_train_batch_size, args.num_iterations
        )
        self._last_evaluation: dict | None = None  # the latest evaluation's record (metric_for_best_model)
        self.signal_warnings = SignalWarnings()
        self._in_train = False

    # HF Trainer's callback API
    def add_callback(self, callback) -> None:
        self.callback_handler.add(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.pop(callback)

    @property
    def unwrapped_model(self):
        return unwrap_model(self.accelerator, self.model)

    # TRL's GRPOTrainer attributes, read by scripts, callbacks and subclasses
    ref_model = property(lambda self: self.reference, doc="The frozen reference (None with beta = 0 or LoRA).")
    reward_funcs = property(lambda self: [f.fn for f in self.reward_functions])
    reward_func_names = property(lambda self: [f.name for f in self.reward_functions])
    reward_processing_classes = property(
        lambda self: [
            getattr(f.fn, "tokenizer", None) if isinstance(f.fn, RewardModel) else None for f in self.reward_functions
        ]
    )
    aux_loss_enabled = property(lambda self: bool(self.router_aux_loss_coef))
    num_generations = property(lambda self: self.args.num_generations)

    @property
    def tools(self) -> list:
        """TRL's: the tools the model may call, the standalone ones then each environment's methods (TRL's union)."""
        tools = getattr(self.agents, "tools", None) or []
        return list(tools.values()) if isinstance(tools, dict) else list(tools)  # a verifiers ToolEnv's: name -> tool

    environments = property(
        lambda self: getattr(self.agents, "latest_environments", None),
        doc="TRL's: the environment instances of the latest rollouts, one per completion.",
    )
    environment_tools = property(
        lambda self: getattr(self.agents, "tools_by_environment", {}),
        doc="Environment name (None for a single factory) -> the tools a row of that environment is shown (the "
        "standalone tools, then the probe instance's methods). Empty without environment_factory.",
    )
    environment_pool = property(
        lambda self: getattr(getattr(self.agents, "environments", None), "pool", {}),
        doc="Environment name (None for a single factory) -> its pooled instances, the probe first. Empty without "
        "environment_factory.",
    )
    # TRL's private names for the two, which its tests and subclasses read.
    _env_tools = property(lambda self: self.environment_tools)
    _environment_pool = property(lambda self: self.environment_pool)

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now: the adaptive controller's (use_adaptive_entropy), else the config's."""
        controller = self.entropy_controller
        return controller.coef if controller is not None else self.args.entropy_coef

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's: True for the tokens whose entropy is at least the `threshold` quantile of every process's masked
        tokens (grpokit's training forward uses `loss.high_entropy_mask` with quantile 1 - threshold)."""
        return at_least_global_quantile(self.accelerator, entropies, mask, threshold)

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's off-policy sequence mask (DeepSeek-V3.2), [B, 1]: 1 keeps a sequence (`loss.off_policy_mask`)."""
        return off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold)

    # ------------------------------------------------------------------------------------------------ the loop

    def train(self, resume_from_checkpoint: bool | str | None = None, **unused):
        """Train to max_steps (or num_train_epochs); returns transformers' `TrainOutput(global_step,
        training_loss, metrics)` and appends the summary record (`train_loss`, `train_runtime`, ...) to
        `state.log_history`, as the HF Trainer does."""
        if unused:
            raise TypeError(f"train() got unexpected arguments {sorted(unused)}; it takes resume_from_checkpoint.")
        self._in_train = True  # evaluations inside keep the training precision (bf16_full_eval / fp16_full_eval)
        try:
            return self._train(resume_from_checkpoint)
        finally:
            self._in_train = False
            if self.producer is not None:  # what it had in flight is dropped; a resumed run samples it again
                self.producer.close()
                self.producer = None

    def _train(self, resume_from_checkpoint: bool | str | None):
        args, acc = self.args, self.accelerator
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        if resume:
            self._resume(True if resume in (True, "true", "True") else resume)
        state, callbacks = self.state, self.callback_handler
        run = self._begin_run()
        self.model.train()
        if acc.device.type == "cpu":  # the loop's activations reuse heap memory (cpu_memory: a page fault per 4 KiB)
            reuse_activation_memory()
            trim_heap_in_backward(self.unwrapped_model)  # but not the backward's, at the step's peak
        control = callbacks("on_train_begin", args, state)
        if args.eval_on_start:
            self._log_evaluation(state.global_step, run.sink)
        if state.global_step == 0 or int(state.epoch) == state.epoch:
            control = callbacks("on_epoch_begin", args, state)
        if args.max_staleness is not None:  # asynchronous generation: from here on a producer samples ahead
            self._start_producer()
        with run.preemption or contextlib.nullcontext():
            while state.global_step < state.max_steps and not control.should_training_stop:
                step_started, epoch_before = time.perf_counter(), int(state.epoch)
                control = callbacks("on_step_begin", args, state)
                window = self.generation.take(args.gradient_accumulation_steps)
                run.losses.append(self.optimizer_step(window))
                self.window.add({"step_time": time.perf_counter() - step_started})
                control = self._after_step(run, epoch_ended=int(state.epoch) > epoch_before)
        return self._end_run(run)

    def _begin_run(self) -> TrainRun:
        """What train() keeps while it runs (grpokit.train_run). Writes the configuration used."""
        args, main = self.args, self.accelerator.is_main_process
        run = begin_run(args, self.state, main, self.progress_label)
        self._sink = run.sink
        if main:
            args.save(Path(args.output_dir) / self.config_file)
        return run

    def _after_step(self, run: TrainRun, epoch_ended: bool):
        """What follows an optimizer step, in this order: the step-end callbacks; a SIGTERM on any process; the metrics
        record; an evaluation; the epoch's end; a checkpoint; stopping. Returns the callbacks' TrainerControl."""
        args, acc, state, callbacks = self.args, self.accelerator, self.state, self.callback_handler
        step = state.global_step
        run.bar.update(1)
        control = callbacks("on_step_end", args, state)
        preempted = run.preempted()
        if preempted:
            control.should_training_stop = True
        if run.log_due(args, step, epoch_ended, control):
            control.should_log = False
            self.log({"step": step, "epoch": round(state.epoch, 4)})
            control = callbacks.control
            run.bar.set_postfix(reward=f"{state.log_history[-1].get('reward', float('nan')):.3f}")
            self.check_guard()
            self.check_learning_signals()
            if args.log_completions and acc.is_main_process and self._samples:
                run.sink.write_completions(step, self._samples, args.log_unique_prompts)
        if not preempted and run.evaluate_due(args, step, control):
            control.should_evaluate = False  # before saving: the checkpoint holds the evaluation
            self._log_evaluation(step, run.sink)
        if epoch_ended:
            control = callbacks("on_epoch_end", args, state)
        if run.save_due(args, step, epoch_ended, control) or preempted:
            control.should_save = False
            self._save_checkpoint()
            control = callbacks("on_save", args, state)
        if preempted and acc.is_main_process:
            console_line(
                f"SIGTERM: saved checkpoint-{step} in {args.output_dir} and stopped; resume with "
                f"resume_from_checkpoint."
            )
        if epoch_ended and state.global_step < state.max_steps:
            control = callbacks("on_epoch_begin", args, state)
        return control

    def _end_run(self, run: TrainRun):
        """The best checkpoint's weights back (load_best_model_at_end), the summary record and train_results.json,
        the on_train_end callbacks; returns transformers' TrainOutput."""
        from transformers.trainer_utils import TrainOutput

        args, acc, state = self.args, self.accelerator, self.state
        run.bar.close()
        if args.load_best_model_at_end and state.best_model_checkpoint is not None:
            load_best_checkpoint(self.unwrapped_model, state, args.metric_for_best_model, announce=acc.is_main_process)
        release_scratch()  # the float32 route's reused buffers (CPU), allocated again if anything runs after
        runtime, steps = time.perf_counter() - run.started, state.global_step - run.first_step
        summary = train_summary(args, state, steps, acc.num_processes, runtime, run.losses)
        train_loss = summary["train_loss"]
        self.log(summary)  # with the metrics of the steps after the last record, as TRL's log() merges them
        summary = state.log_history[-1]
        if acc.is_main_process:  # the HF Trainer's save_metrics("train", ...) file
            (Path(args.output_dir) / "train_results.json").write_text(json.dumps(summary, indent=1))
        run.sink.close()
        self.callback_handler("on_train_end", args, state)
        return TrainOutput(state.global_step, train_loss, summary)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """transformers' hook, as TRL's GRPOTrainer extends it: the metrics gathered since the last record (the
        logging window) join `logs` and the record goes to state.log_history, metrics.jsonl and the trackers, and to
        the `on_log` callbacks. The loop calls it for every step record and for the final summary, which so carries
        the metrics of the steps after the last record (`reward`, `rewards/<name>/mean`, ...; not the window's
        loss, learning rate and gradient norm: transformers reports train_loss). Override it to change what is
        logged."""
        window = self.window.flush()
        if "train_runtime" in logs:
            window = {k: v for k, v in window.items() if k not in ("loss", "learning_rate", "grad_norm")}
        record = {**logs, **window, **({"num_tokens": self.state.num_tokens} if window else {})}
        self.state.log_history.append(record)
        if self._sink is not None and window:
            self._sink.write(record, console="train_runtime" not in logs)
        self.callback_handler("on_log", self.args, self.state, logs=record)

    def optimizer_step(self, window: list[TrainBatch]) -> float:
        """One optimizer step on a window of micro-batches (a public seam: tests feed it typed batches). Returns
        the step's loss, averaged over processes."""
        args, acc = self.args, self.accelerator
        # The counts of the whole window (all micro-batches, all processes) normalise each micro-batch's loss.
        loss_total, self._window_counts, self._step_stats = 0.0, window_counts(acc, window), []
        # A producer (asynchronous generation) never copies half-updated weights: the optimizer step runs under the
        # weights' lock, and under DeepSpeed, whose engine steps inside the window's last backward, so does that.
        steps_in_backward = self.stepper.deepspeed
        for index, micro_batch in enumerate(window):
            last = index == len(window) - 1
            with (
                self.stepper.micro_batch(is_last=last),
                self.weights.step() if last and steps_in_backward else contextlib.nullcontext(),
            ):
                loss_total += self.training_step(self.model, micro_batch).item()
            if not last:
                self.callback_handler("on_substep_end", args, self.state)
        self.callback_handler("on_pre_optimizer_step", args, self.state)
        with contextlib.nullcontext() if steps_in_backward else self.weights.step():
            result = self.stepper.step(loss_total, self.state)
        self.callback_handler("on_optimizer_step", args, self.state)
        stats = self._step_stats
        if self.entropy_controller is not None:  # the coefficient for the next step, from this window's entropy
            stats.append({"entropy_coef": self.entropy_controller.coef})
            self.entropy_controller.step(acc.reduce(self.entropy_controller.window_totals().to(acc.device), "sum"))
        elif args.entropy_coef != 0:  # TRL logs a static coefficient too, whenever the bonus is on
            stats.append({"entropy_coef": args.entropy_coef})
        self.state.global_step += 1
        self.state.epoch = self.sampler.epochs_done
        sync_reference(args, self.reference, self.unwrapped_model, self.state.global_step)
        self.weights.stepped()
        step_metrics = {
            "loss": loss_total,
            "learning_rate": result.learning_rate,
            "grad_norm": result.grad_norm,
            "nonfinite_steps": self.state.nonfinite_steps,
        }
        served = take_step_totals(stats)  # the served-policy check's, not metrics
        means = reduce_step_metrics(acc, step_metrics, stats)  # over processes
        self.window.add(means)
        check_step(acc, args, stats, served, self.engine, self.state.global_step - 1, self.experience.policy())
        return means["loss"]

    def training_step(self, model, inputs: TrainBatch, num_items_in_batch=None) -> torch.Tensor:
        """transformers' hook, called for every micro-batch: its loss (`compute_loss`) and backward. Returns the
        loss, detached."""
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.args.torch_empty_cache_steps and self.state.global_step % self.args.torch_empty_cache_steps == 0:
            clear_device_cache()  # as transformers' Trainer: cached allocator blocks back to the device, pre-backward
        self.stepper.backward(loss)
        return loss.detach()

    def compute_loss(self, model, inputs: TrainBatch | dict, return_outputs: bool = False, num_items_in_batch=None):
        """TRL's hook: the GRPO loss of one micro-batch (`inputs`, a `TrainBatch`) under `model`. Unlike TRL's, the
        loss is normalised by the counts of the whole optimizer step's window (grpokit's exact accumulation):
        `num_items_in_batch` = (sequences, tokens, micro-batches) of the window; None: the current step's. Its
        metrics join the step's. As in TRL, return_outputs=True is refused.
        `inputs` may also be a dict in TRL's layout (`TrainBatch.from_trl_inputs`): its loss is then TRL's number,
        normalised as TRL normalises a micro-batch (`batch.trl_loss_counts`; `num_items_in_batch` unused, as TRL's)."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        args = self.args
        if isinstance(inputs, dict):  # TRL's layout, and TRL's mode: no accumulation in evaluation
            training, processes = self.model.training, self.accelerator.num_processes
            inputs, num_items_in_batch = trl_micro_batch(inputs, args, training, processes)
        counts = num_items_in_batch or self._window_counts or (len(inputs), inputs.loss_mask.sum().item(), 1)
        load_balancing = self.router_aux_loss_coef  # MoE (TRL's router_aux_loss_coef)
        loss, step_stats = micro_batch_loss(
            model,
            inputs.trimmed(),
            counts,
            args,
            self.accelerator.autocast,
            entropy_controller=self.entropy_controller,
            router_aux_loss_coef=load_balancing,
            moe=moe_shape(self.unwrapped_model.config) if load_balancing else None,
            offload=self.activation_offload,
        )
        clipped = step_stats.get("clip_ratio/region_mean")
        if self._batch_staleness is not None and clipped is not None:
            # Under max_staleness a step trains one generation batch: its clip ratio, keyed by the batch's staleness,
            # is averaged by the logging window over the steps of that staleness.
            step_stats[f"clip_ratio/region_mean_staleness_{self._batch_staleness}"] = clipped
        self._step_stats.append(step_stats)
        return loss

    # ------------------------------------------------------------------------------------------ dataloaders

    def get_train_dataloader(self) -> DataLoader:
        """TRL's: a torch DataLoader over the rows this process trains on, in the order the loop draws them and in
        TRL's layout (a batch is this process's generation batch, each prompt num_generations times; repeated
        steps_per_generation × num_iterations times; an epoch per pass), with the dataloader_* fields. The loop
        reads prompts itself; this loader replays its draws from a copy of its sampler (grpokit.dataloaders)."""
        acc = self.accelerator
        return train_dataloader(self.train_dataset, self.sampler, self.args, acc.process_index, acc.num_processes)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        """TRL's: a torch DataLoader over this process's evaluation rows, as `evaluate` samples them. `eval_dataset`:
        a dataset, the name of one of the trainer's named eval sets, or None for the trainer's."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        acc = self.accelerator
        return eval_dataloader(
            self.eval_dataset if eval_dataset is None else eval_dataset, self.args, acc.process_index, acc.num_processes
        )

    # ------------------------------------------------------------------------------------------- generation

    def generate_batch(self) -> TrainBatch:
        """This process's next generation batch (`ExperienceMaker.make`: sample, score, advantages, π_old and π_ref
        where the loss needs them), with what it produced recorded: its metrics into the logging window, its tokens
        into state.num_tokens, its rollouts into state.rollouts (the next rollout index), its completions-log rows."""
        if self.args.max_staleness is None:
            experience = self.experience.make(self.state.rollouts, self.state)
            self.state.rollouts += experience.rollouts
        else:  # from the producer (train() starts it): the sampler's position and the seeds move to the batch's end
            if self.producer is None:
                raise RuntimeError(
                    "With max_staleness, generation batches come from the producer that train() starts: "
                    "call train(), or set max_staleness=None to sample batches with generate_batch()."
                )
            produced, metrics = self.producer.take(self.state.global_step)
            experience = produced.experience
            self.state.rollouts = produced.rollout_index + experience.rollouts
            self.sampler.load_state_dict(produced.sampler_state)
            self.window.add(metrics)
            self._batch_staleness = int(metrics["sample/staleness_max"])
        self.state.num_tokens += experience.num_tokens
        self.window.add(experience.metrics)
        if experience.samples is not None:
            self._samples = experience.samples
        return experience.batch

    def _start_producer(self) -> Producer:
        """Asynchronous generation (max_staleness): grpokit.producer, from the trainer's parts."""
        restored, self._restored_in_flight = self._restored_in_flight, []
        self.producer = start_producer(
            self.args,
            self.accelerator,
            self.unwrapped_model,
            self.experience,
            self.sampler,
            self.train_dataset,
            self.weights,
            self.state,
            self.processing_class,
            restored,
            self._producer_copy,
        )
        return self.producer

    # ------------------------------------------------------------------------------------------ evaluation

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample num_generations_eval completions per prompt of eval_dataset (default: the trainer's), score them
        and return grpokit's `eval/...` metrics (grpokit.evaluation: rewards, pass@k, lengths) and `eval_loss`
        (the GRPO loss of those completions with their group advantages, as TRL computes it in evaluation).
        Named sets (a dict / DatasetDict) are evaluated one by one, their metrics prefixed `eval_<name>/` and
        `eval_<name>_loss`. Sampling uses the training settings and fixed seeds, so the same weights always give
        the same completions; they are kept, with their rewards, in `self.eval_samples`."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("No eval_dataset: pass one to GRPOTrainer(eval_dataset=...) or to evaluate().")
        full_eval = torch.float16 if self.args.fp16_full_eval else torch.bfloat16 if self.args.bf16_full_eval else None
        if full_eval is not None and not self._in_train:
            # transformers' Trainer: outside train(), the model itself is cast (in place, for good) for evaluation.
            self.unwrapped_model.to(dtype=full_eval)
        producer = self.producer
        # Under max_staleness the producer may sample with this very engine: evaluation leases it.
        lease = producer.lease() if producer is not None and producer.shares_engine else contextlib.nullcontext()
        with lease:
            metrics, self.eval_samples = self.evaluator.evaluate_sets(dataset, metric_key_prefix, self.state)
        self.callback_handler("on_evaluate", self.args, self.state, metrics=metrics)
        return metrics

    def _log_evaluation(self, step: int, sink: MetricSink) -> None:
        record = {"step": step, "epoch": round(self.state.epoch, 4), **self.evaluate()}
        self._last_evaluation = record
        self.state.log_history.append(record)
        sink.write(record, console=False)
        if self.accelerator.is_main_process:
            console_line(f"[step {step}] eval: {evaluation_line(record)}")
        self.check_guard()

    def check_guard(self) -> None:
        """Warn, once per guard_window logging steps, when the reward rises while guard_metric falls."""
        if self.accelerator.is_main_process:  # one warning is enough
            self.signal_warnings.check_guard(self.state.log_history, self.args.guard_metric, self.args.guard_window)

    def check_learning_signals(self) -> None:
        """Warn, once per sign, when the logged metrics say since the start that the run cannot learn
        (signals.STALL_SIGNS: groups with no reward spread, completions all cut at max length)."""
        if self.accelerator.is_main_process:
            self.signal_warnings.check_stalls(self.state.log_history)

    def warn_unknown_prompt_tokens(self) -> None:
        """Prompts the tokenizer cannot read (most of their characters out of its vocabulary) are said before
        training (`checks.warn_unreadable_prompts`)."""
        if self.accelerator.is_main_process:
            warn_unreadable_prompts(self.train_dataset, getattr(self.codec, "tokenizer", None))

    # ------------------------------------------------------------------------------------- saving, resuming

    def _training_parts(self) -> TrainingParts:
        moving_reference = self.args.sync_ref_model and self.reference is not None
        return TrainingParts(self.model, self.optimizer, self.scheduler, self.reference if moving_reference else None)

    def _save_checkpoint(self) -> Path | None:
        step = self.state.global_step
        loop, process = loop_state(self.generation, self.window, self.entropy_controller, self.producer, step)
        track_best_checkpoint(self.args, self.state, self._last_evaluation)
        return self.checkpointer.save(self._training_parts(), self.state, loop, process)

    def _resume(self, resume: bool | str) -> None:
        acc, path = self.accelerator, self.checkpointer.find(resume)
        resumed = self.checkpointer.load(path, self._training_parts())
        if acc.is_main_process:  # said, as it matters most with resume_from_checkpoint=True
            logger.warning(f"Resuming from {path.resolve()} (step {resumed.state.global_step}).")
        in_flight = restore_loop(resumed, self.generation, self.window, self.entropy_controller, acc.device)
        if self.args.ignore_data_skip:  # transformers' meaning: the current epoch's data starts over
            self.sampler.position = 0
        self._restored_in_flight = in_flight  # for the producer (max_staleness) that train() starts
        self.state = resumed.state
        self.state.max_steps = total_steps(self.args, self.train_dataset, acc.num_processes)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every process calls it; the main process writes (under FSDP2 / ZeRO-3 all of them gather first), or with
        save_on_each_node the main process of each node."""
        self.accelerator.wait_for_everyone()
        model = self.unwrapped_model
        weights = self.model_writer.gather(model) if is_sharded(model) else None
        if self.checkpointer.writes:
            self.model_writer(Path(output_dir or self.args.output_dir), weights)
            if self.args.push_to_hub and not _internal_call and self.accelerator.is_main_process:
                push_folder(self.args, Path(output_dir or self.args.output_dir), "Model saved by grpokit")

    def push_to_hub(self, commit_message: str | None = "End of training", **unused) -> str | None:
        """Save the model to output_dir and upload it to hub_model_id (transformers' Trainer.push_to_hub)."""
        self.save_model(self.args.output_dir, _internal_call=True)
        if self.accelerator.is_main_process:
            return push_folder(self.args, Path(self.args.output_dir), commit_message or "End of training")
        return None

    def _model_card(self, method="GRPO", final_keys=("reward", "eval/reward"), config: dict | None = None) -> str:
        """The card of `method`, `config` (default: args'), and the last records with `final_keys` (train, eval)."""
        rewards = [(f.name, w) for f, w in zip(self.reward_functions, self.reward_weights.tolist())]
        return run_model_card(
            self.args, self.unwrapped_model, self.state, self.train_dataset, rewards, method, final_keys, config
        )
