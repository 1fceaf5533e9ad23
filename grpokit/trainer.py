"""GRPOTrainer: rollout → rewards → advantages → μ optimisation passes → optimizer steps, on accelerate.

One training step, top to bottom (`train`):

    for each optimizer step:
        window = the next gradient_accumulation_steps micro-batches of the stream:
            for each generation batch (`generate_batch`: engine → rewards → advantages → TrainBatch)
                for each of the μ = num_iterations passes over it
                    its micro-batches of per_device_train_batch_size rows, in order
        for each micro-batch of the window: forward, loss, backward   (`_train_micro_batch`)
        one optimizer step                                             (`OptimizerStepper`)
        log, evaluate, save

Batch semantics are TRL's: a process generates `generation_batch_size` = per_device_train_batch_size ×
steps_per_generation completions at a time (G per prompt; a prompt's group may span processes) and reuses them μ
times. An optimizer step may take micro-batches from two generation batches (steps_per_generation need not be a
multiple of gradient_accumulation_steps). Micro-batch losses are normalised by the counts of the whole optimizer
step's window, so how it is split does not change the update (except for `bnpo`, a per-micro-batch mean by
definition).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from accelerate.utils.memory import clear_device_cache

from .agents import EnvironmentPool, build_agents, check_agents, placeholder_dataset
from .advantages import combine_and_normalize, group_advantages, group_stats, process_advantages
from .batch import ScoredRollout, TrainBatch
from .checkpoint import Checkpointer, TrainingParts
from .checkpoint.preemption import SigtermCheckpoint
from .config import LOG_LEVELS, GRPOConfig
from .compat import models_written_by_this_process
from .cpu_matmul import float32_matmuls, release_scratch
from .cpu_memory import keep_large_allocations_mapped, return_free_memory, reuse_activation_memory
from .data import (
    PromptSampler,
    StreamSampler,
    check_dataset,
    dataset_columns,
    dataset_rows,
    is_iterable_dataset,
    named_eval_datasets,
)
from .distributed import (
    all_processes_done,
    build_accelerator,
    check_backend,
    configure_deepspeed,
    deepspeed_stage,
    full_state_dict,
    is_sharded,
    place_before_reference_copy,
    prepare_reference,
    trainable_parameters,
    unwrap_model,
)
from .evaluation import evaluation_metrics, group_records
from .hub import check_hub, push_folder
from .logprobs import check_padding_free, token_logprobs
from .logs import MetricSink, MetricWindow, generation_metrics, reduce_extremes
from .loss import (
    AdaptiveEntropyController,
    high_entropy_mask,
    load_balancing_loss,
    policy_loss,
    sampling_correction,
)
from .model_card import describe_dataset, model_card_writable, render_model_card, write_model_card
from .models import (
    build_policy,
    build_reference,
    compile_blocks,
    enable_gradient_checkpointing,
    full_precision,
    is_peft_model,
    load_model_weights,
    mix_into_reference,
    prompt_length_limit,
    reference_policy,
    save_merged,
)
from .multimodal import check_images_supported, loggable_prompt
from .offload import ActivationOffload
from .optim import build_optimizer
from .rewards import build_reward_functions
from .rewards.base import check_required_columns, combine_rewards, compute_rewards, routes_from_column
from .rewards.context import RewardLogs
from .rewards.model import RewardModel
from .rewards.process import step_token_ends
from .rollout import EVAL_SEED_OFFSET, HFEngine, PromptCodec, RolloutEngine, group_counts, rollout_seed
from .signals import duplicate_ratio, guard_message, sequence_keys
from .state import Callbacks, TrainerState
from .stepping import OptimizerStepper


@dataclass
class GenerationCursor:
    """Where the loop is inside the current generation batch: saved in checkpoints, so that a resumed run takes
    exactly the micro-batches the interrupted one would have taken next."""

    batch: TrainBatch | None = None  # this process's generation batch being trained on (None: sample the next)
    pass_index: int = 0  # which of the μ passes over it
    micro_index: int = 0  # micro-batches of this pass already taken


class GRPOTrainer:
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
    ):
        """TRL 1.16's arguments, in its order, plus `rollout_engine` (any `RolloutEngine`; default: sampling in
        this process with `HFEngine`)."""
        from accelerate.utils import set_seed

        self.args = args = args or GRPOConfig()
        # Everything a user can get wrong in the data or rewards is checked before the model is loaded.
        environments = EnvironmentPool(environment_factory) if environment_factory is not None else None
        if train_dataset is None and environments is not None:  # the environments supply the prompts (reset)
            train_dataset = placeholder_dataset(args, environment_factory)
        check_run(args, train_dataset, eval_dataset, rollout_engine, tools, rollout_func, environment_factory)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.reward_functions = build_reward_functions(
            reward_funcs, reward_processing_classes, args.per_device_train_batch_size, args.trust_remote_code,
            environment_rewards=environments.reward_functions() if environments is not None else ())  # fmt: skip
        for dataset in (train_dataset, *named_eval_datasets(eval_dataset).values()):
            if rollout_func is None:  # a rollout_func's extra fields are columns too, known only once it has run
                agent_columns = ["turn_ends"] if tools or environments is not None else []
                check_required_columns(self.reward_functions, dataset_columns(dataset) + agent_columns)
        self.reward_weights = reward_weights(args, len(self.reward_functions), len(environments.reward_types)
                                             if environments is not None else 0)  # fmt: skip
        warn_like_trl(args, model, quantization_config)
        if args.push_to_hub:
            check_hub(args)

        self.accelerator = acc = build_accelerator(args)
        args.check_batch(acc.num_processes)
        set_log_level(args.log_level if acc.is_main_process else args.log_level_replica)
        if acc.device.type == "cpu":  # freed tensors leave the process (cpu_memory: glibc kept them, +30% peak RSS)
            keep_large_allocations_mapped()
        if args.full_determinism:  # as transformers' Trainer: deterministic kernels, then the same seeding
            from transformers import enable_full_determinism

            enable_full_determinism(args.seed)
        else:
            set_seed(args.seed)
        self.model, self.processing_class = build_policy(model, processing_class, peft_config, args,
                                                         quantization_config)  # fmt: skip
        if args.bf16 or not full_precision(self.model):  # before the reference is copied: it takes the same route
            float32_matmuls(self.model, acc.device)
        for dataset in (train_dataset, *named_eval_datasets(eval_dataset).values()):
            check_images_supported(self.processing_class, dataset_columns(dataset))
        max_prompt_length = prompt_length_limit(self.model, args)
        self.model = place_before_reference_copy(acc, self.model)  # the reference is then copied on the device
        self.reference = build_reference(model, self.model, args)
        enable_gradient_checkpointing(self.model, args, acc.device)
        check_backend(acc, self.model, args)
        if args.torch_compile:  # the policy only, after the reference was copied from it
            compile_blocks(self.model, backend=args.torch_compile_backend, mode=args.torch_compile_mode)
        optimizer, scheduler = optimizers
        self.optimizer = optimizer or build_optimizer(self.model, args)
        deepspeed = deepspeed_stage(acc) is not None
        if deepspeed:
            configure_deepspeed(acc, args)
        self.model, self.optimizer = acc.prepare(self.model, self.optimizer)
        self.reference = prepare_reference(acc, self.reference, self.model)
        for function in self.reward_functions:
            if isinstance(function.fn, RewardModel):
                function.fn.to(acc.device)

        if "underflow_overflow" in args.debug:  # as transformers' Trainer: hooks on every module, stop at inf/nan
            from transformers.debug_utils import DebugUnderflowOverflow

            DebugUnderflowOverflow(self.unwrapped_model)
        stop_token_ids, suppress_token_ids = args.generation_token_ids()
        self.codec = PromptCodec(self.processing_class, self.unwrapped_model, max_prompt_length,
                                 args.chat_template_kwargs, stop_token_ids, suppress_token_ids)  # fmt: skip
        # With sharded parameters every forward is a collective: the processes sample in step (see generate()).
        all_done = all_processes_done if is_sharded(self.unwrapped_model) else None
        if rollout_engine is None and args.use_vllm:  # vLLM is imported only here (grpokit.rollout.vllm)
            from .rollout.vllm import engine_from_config

            rollout_engine = engine_from_config(self.unwrapped_model, args, self.processing_class, acc.process_index,
                                                acc.num_processes, acc.local_process_index)  # fmt: skip
        exact = not (args.bf16 or args.fp16) and full_precision(self.unwrapped_model)  # bf16 weights: not exact
        if rollout_engine is None:
            compile = False if (args.generation_kwargs or {}).get("disable_compile") else None
            rollout_engine = HFEngine(self.unwrapped_model, acc.device, autocast=acc.autocast, all_done=all_done,
                                      exact_logprobs=exact, cache_implementation=args.cache_implementation,
                                      compile=compile)  # fmt: skip
        self.engine = rollout_engine
        self.agents = build_agents(self.processing_class, self.unwrapped_model, args, max_prompt_length, tools,
                                   environments, rollout_func)  # fmt: skip
        self.state = self._new_state()
        self.scheduler = scheduler or build_scheduler(self.optimizer, args, self.state.max_steps)
        sync_each_batch = bool(args.accelerator_options().get("gradient_accumulation_kwargs", {}).get("sync_each_batch"))
        self.stepper = OptimizerStepper(acc, self.model, self.optimizer, self.scheduler, deepspeed=deepspeed,
                                        max_grad_norm=args.max_grad_norm, max_nonfinite_steps=args.max_nonfinite_steps,
                                        sync_each_batch=sync_each_batch)  # fmt: skip
        self.checkpointer = Checkpointer(acc, args.output_dir, self._write_model, save_total_limit=args.save_total_limit,
                                         save_only_model=args.save_only_model, deepspeed=deepspeed,
                                         gather_weights=self._gathered_weights,
                                         save_on_each_node=args.save_on_each_node)  # fmt: skip
        if args.save_on_each_node and (is_sharded(self.unwrapped_model) or self.checkpointer.format != "plain"):
            raise NotImplementedError("save_on_each_node=True is supported with whole weights in every process "
                                      "(DDP, or one process per node): under FSDP2 and DeepSpeed every process writes "
                                      "its part of a checkpoint into one directory, so put output_dir on storage all "
                                      "nodes share and leave save_on_each_node False.")  # fmt: skip
        if args.load_best_model_at_end and self.checkpointer.format != "plain":
            raise ValueError(f"load_best_model_at_end=True loads plain checkpoints only; this run writes "
                             f"{self.checkpointer.format} ones (FSDP2 SHARDED_STATE_DICT / DeepSpeed). Set it False "
                             f"and load trainer.state.best_model_checkpoint (metric_for_best_model tracks it) "
                             f"yourself, or use FULL_STATE_DICT checkpoints.")  # fmt: skip
        self.sampler = (StreamSampler(train_dataset) if is_iterable_dataset(train_dataset) else
                        PromptSampler(len(train_dataset), args.data_seed or args.seed, args.shuffle_dataset))  # fmt: skip
        self.window = MetricWindow()
        self.cursor = GenerationCursor()
        self._last_evaluation: dict | None = None  # the latest evaluation's record (metric_for_best_model)
        self._in_train = False
        self.router_aux_loss_coef = router_aux_loss_coef(args, self.unwrapped_model)
        self.activation_offload = activation_offload(args, acc.device)
        if args.padding_free:
            check_padding_free(self.model, self.reference, self.router_aux_loss_coef)
        self.entropy_controller = None if not args.use_adaptive_entropy else AdaptiveEntropyController(
            args.entropy_coef, args.entropy_target, args.entropy_coef_delta, args.entropy_coef_min,
            args.entropy_coef_max)  # fmt: skip
        self.reward_logs = RewardLogs()  # what reward functions report through log_metric / log_extra
        self.callback_handler = Callbacks(callbacks, self.unwrapped_model, self.processing_class, self.optimizer,
                                          self.scheduler)  # fmt: skip
        self.callback_handler("on_init_end", args, self.state)

    def _new_state(self) -> TrainerState:
        args, acc = self.args, self.accelerator
        return TrainerState(max_steps=total_steps(args, self.train_dataset, acc.num_processes),
                            logging_steps=args.logging_steps, eval_steps=args.eval_steps, save_steps=args.save_steps,
                            train_batch_size=args.per_device_train_batch_size, num_train_epochs=args.num_train_epochs,
                            is_local_process_zero=acc.is_local_main_process,
                            is_world_process_zero=acc.is_main_process)  # fmt: skip

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

    def _train(self, resume_from_checkpoint: bool | str | None):
        from tqdm.auto import tqdm
        from transformers.trainer_utils import TrainOutput

        args, acc = self.args, self.accelerator
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        if resume:
            self._resume(True if resume in (True, "true", "True") else resume)
        state, callbacks = self.state, self.callback_handler
        sink = MetricSink(args.output_dir, args.report_to, args.run_name, args.logging_dir, args.to_dict(),
                          enabled=acc.is_main_process)  # fmt: skip
        sink.truncate_after(state.global_step)
        if acc.is_main_process:
            args.save(Path(args.output_dir) / "grpo_config.json")
        logging_steps, save_steps = as_steps(args.logging_steps, state.max_steps), as_steps(args.save_steps, state.max_steps)
        eval_steps = as_steps(args.eval_steps or args.logging_steps, state.max_steps)
        bar = tqdm(total=state.max_steps, initial=state.global_step, desc="GRPO",
                   disable=args.disable_tqdm or not acc.is_main_process, dynamic_ncols=True)  # fmt: skip
        self.model.train()
        if acc.device.type == "cpu":  # the loop's activations reuse heap memory (cpu_memory: a page fault per 4 KiB)
            reuse_activation_memory()
        micro_batches = self._micro_batch_stream()
        first_step, started, losses = state.global_step, time.perf_counter(), []
        control = callbacks("on_train_begin", args, state)
        if args.eval_on_start:
            self._log_evaluation(state.global_step, sink)
        if state.global_step == 0 or int(state.epoch) == state.epoch:
            control = callbacks("on_epoch_begin", args, state)
        preemption = SigtermCheckpoint() if args.enable_jit_checkpoint else None
        with preemption or contextlib.nullcontext():
            while state.global_step < state.max_steps and not control.should_training_stop:
                step_started, epoch_before = time.perf_counter(), int(state.epoch)
                control = callbacks("on_step_begin", args, state)
                window = [next(micro_batches) for _ in range(args.gradient_accumulation_steps)]
                losses.append(self.optimizer_step(window))
                self.window.add({"step_time": time.perf_counter() - step_started})
                step = state.global_step
                bar.update(1)
                control = callbacks("on_step_end", args, state)
                epoch_ended = int(state.epoch) > epoch_before
                # SIGTERM on any process: every process saves this step and stops (a collective, every step).
                preempted = preemption is not None and not all_processes_done(not preemption.requested)
                if preempted:
                    control.should_training_stop = True
                if self._log_due(step, epoch_ended, logging_steps, control):
                    control.should_log = False
                    record = {"step": step, "epoch": round(state.epoch, 4), **self.window.flush(),
                              "num_tokens": state.num_tokens}  # fmt: skip
                    state.log_history.append(record)
                    bar.set_postfix(reward=f"{record.get('reward', float('nan')):.3f}")
                    sink.write(record)
                    control = callbacks("on_log", args, state, logs=record)
                    self.check_guard()
                    if args.log_completions and acc.is_main_process and getattr(self, "_samples", None):
                        sink.write_completions(step, self._samples, args.log_unique_prompts)
                if not preempted and ((args.eval_strategy == "steps" and step % eval_steps == 0
                                       and step >= args.eval_delay) or control.should_evaluate):  # fmt: skip
                    control.should_evaluate = False  # before saving: the checkpoint holds the evaluation
                    self._log_evaluation(step, sink)
                if epoch_ended:
                    control = callbacks("on_epoch_end", args, state)
                if (args.save_strategy == "steps" and step % save_steps == 0) or control.should_save or \
                        (args.save_strategy == "epoch" and epoch_ended) or preempted:  # fmt: skip
                    control.should_save = False
                    self._save_checkpoint()
                    control = callbacks("on_save", args, state)
                if preempted and acc.is_main_process:
                    print(f"SIGTERM: saved checkpoint-{step} in {args.output_dir} and stopped; resume with "
                          f"resume_from_checkpoint.", file=sys.stderr, flush=True)  # fmt: skip
                if epoch_ended and state.global_step < state.max_steps:
                    control = callbacks("on_epoch_begin", args, state)
        bar.close()
        if args.load_best_model_at_end and state.best_model_checkpoint is not None:
            self._load_best_checkpoint()
        release_scratch()  # the float32 route's reused buffers (CPU), allocated again if anything runs after
        runtime = time.perf_counter() - started
        steps = state.global_step - first_step
        samples = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * acc.num_processes
        train_loss = sum(losses) / len(losses) if losses else 0.0
        summary = {"train_runtime": round(runtime, 4), "train_samples_per_second": round(samples / runtime, 3),
                   "train_steps_per_second": round(steps / runtime, 3), "total_flos": float(state.total_flos),
                   "train_loss": train_loss, "epoch": round(state.epoch, 4), "step": state.global_step}  # fmt: skip
        state.log_history.append(summary)
        callbacks("on_log", args, state, logs=summary)
        if acc.is_main_process:  # the HF Trainer's save_metrics("train", ...) file
            import json

            (Path(args.output_dir) / "train_results.json").write_text(json.dumps(summary, indent=1))
        sink.close()
        callbacks("on_train_end", args, state)
        return TrainOutput(state.global_step, train_loss, summary)

    def _log_due(self, step: int, epoch_ended: bool, logging_steps: int, control) -> bool:
        """Whether this step writes a metrics record: logging_strategy's schedule, the first step, a callback's
        should_log, and a step that ends training early, so that its metrics are not lost; with 'no', only a
        callback's should_log."""
        args, strategy = self.args, self.args.logging_strategy
        due = (strategy == "steps" and (step % logging_steps == 0 or step == self.state.max_steps)) or \
            (strategy == "epoch" and epoch_ended)  # fmt: skip
        if strategy == "no":  # not even logging_first_step (grpokit's default True would override the choice)
            return control.should_log
        return due or (step == 1 and args.logging_first_step) or control.should_log or control.should_training_stop

    def _micro_batch_stream(self) -> Iterator[TrainBatch]:
        """For each generation batch, for each of the μ passes over it, its micro-batches in order, from the
        cursor's position on (a resumed run continues where the checkpoint was taken)."""
        args, cursor = self.args, self.cursor
        while True:
            if cursor.batch is None:
                cursor.batch, cursor.pass_index, cursor.micro_index = self.generate_batch(), 0, 0
            micro_batches = cursor.batch.split(args.per_device_train_batch_size)
            while cursor.pass_index < args.num_iterations:
                while cursor.micro_index < len(micro_batches):
                    cursor.micro_index += 1
                    yield micro_batches[cursor.micro_index - 1]
                cursor.pass_index, cursor.micro_index = cursor.pass_index + 1, 0
            cursor.batch = None

    def optimizer_step(self, window: list[TrainBatch]) -> float:
        """One optimizer step on a window of micro-batches (a public seam: tests feed it typed batches). Returns
        the step's loss, averaged over processes."""
        args, acc = self.args, self.accelerator
        # Counts over the whole window (all micro-batches, all processes) normalise each micro-batch's loss; DDP
        # averages gradients over processes, so each process's share is multiplied back.
        local_counts = torch.tensor([sum(len(b) for b in window), sum(b.loss_mask.sum().item() for b in window)],
                                    dtype=torch.float64, device=acc.device)  # fmt: skip
        num_sequences, num_tokens = (acc.reduce(local_counts, "sum") / acc.num_processes).tolist()
        loss_total, stats = 0.0, []
        for index, micro_batch in enumerate(window):
            with self.stepper.micro_batch(is_last=index == len(window) - 1):
                loss, micro_stats = self._train_micro_batch(micro_batch, num_sequences, num_tokens, len(window))
            loss_total += loss
            stats.append(micro_stats)
            if index < len(window) - 1:
                self.callback_handler("on_substep_end", args, self.state)
        self.callback_handler("on_pre_optimizer_step", args, self.state)
        result = self.stepper.step(loss_total, self.state)
        self.callback_handler("on_optimizer_step", args, self.state)
        if self.entropy_controller is not None:  # the coefficient for the next step, from this window's entropy
            stats.append({"entropy_coef": self.entropy_controller.coef})
            self.entropy_controller.step(acc.reduce(self.entropy_controller.window_totals().to(acc.device), "sum"))
        self.state.global_step += 1
        self.state.epoch = self.sampler.epochs_done
        if args.sync_ref_model and self.reference is not None and self.state.global_step % args.ref_model_sync_steps == 0:
            mix_into_reference(self.reference, self.unwrapped_model, args.ref_model_mixup_alpha)
        metrics = {"loss": loss_total, "learning_rate": result.learning_rate, "grad_norm": result.grad_norm,
                   "nonfinite_steps": self.state.nonfinite_steps,
                   **{key: sum(s[key] for s in stats if key in s) / sum(key in s for s in stats)
                      for key in sorted({k for s in stats for k in s})}}  # fmt: skip
        # One all-reduce for all metrics. Every process has the same keys (sorted, so in the same order): a NaN is
        # kept through the reduction (the window drops it after), never dropped on one process only.
        names = sorted(metrics)
        means = acc.reduce(torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64, device=acc.device),
                           "mean")  # fmt: skip
        self.window.add(dict(zip(names, means.tolist())))
        return means[names.index("loss")].item()

    def _train_micro_batch(self, batch: TrainBatch, num_sequences: float, num_tokens: float,
                           num_micro_batches: int) -> tuple[float, dict]:  # fmt: skip
        args, controller = self.args, self.entropy_controller
        batch = batch.trimmed()
        entropy_coef = controller.coef_to_apply() if controller is not None else args.entropy_coef
        router_logits = [] if self.router_aux_loss_coef else None
        offload = self.activation_offload or contextlib.nullcontext()
        with self.accelerator.autocast(), offload:  # offload: what the forward saves waits in host memory
            logprobs, entropies = token_logprobs(self.model, batch.input_ids, batch.input_mask,
                                                 batch.completion_ids.shape[1], args.temperature, with_entropy=True,
                                                 entropy_grad=args.entropy_coef != 0 or controller is not None,
                                                 router_logits=router_logits, fp32_head=args.cast_lm_head_to_fp32,
                                                 multimodal=batch.multimodal,
                                                 padding_free=args.padding_free)  # fmt: skip
        loss_weights = None
        if args.top_entropy_quantile < 1.0:
            loss_weights = high_entropy_mask(entropies.detach(), batch.loss_mask, args.top_entropy_quantile)
        loss, stats = policy_loss(
            logprobs, batch.old_logprobs, batch.ref_logprobs, batch.advantages, batch.loss_mask,
            num_sequences=num_sequences, num_tokens=num_tokens, entropies=entropies, entropy_coef=entropy_coef,
            loss_weights=loss_weights, sampling_logprobs=batch.sampling_logprobs, sampling_ratio=batch.sampling_ratio,
            num_micro_batches=num_micro_batches,
            entropy_normalization="token_mean", **objective_options(args),
        )  # fmt: skip
        if controller is not None:
            mask = batch.loss_mask if loss_weights is None else batch.loss_mask * loss_weights
            controller.observe(entropies.detach(), mask)
        if router_logits is not None:  # MoE load balancing (TRL's router_aux_loss_coef), per optimizer step
            aux = load_balancing_loss(router_logits, *moe_shape(self.unwrapped_model.config),
                                      batch.input_mask).to(loss.device)  # fmt: skip
            loss = loss + self.router_aux_loss_coef * aux / num_micro_batches
            stats.objective["aux_loss"] = aux.detach()
        if args.torch_empty_cache_steps and self.state.global_step % args.torch_empty_cache_steps == 0:
            clear_device_cache()  # as transformers' Trainer: cached allocator blocks back to the device, pre-backward
        self.stepper.backward(loss)
        return loss.item(), stats.as_dict()

    # ------------------------------------------------------------------------------------------- generation

    def generate_batch(self) -> TrainBatch:
        """Sample and score this process's next rows, turn rewards into advantages (over the whole global batch:
        a group may span processes), and add π_old and π_ref where the loss needs them. Rows come shuffled so that
        each optimizer step sees a mix of groups (as TRL does)."""
        args, acc, device = self.args, self.accelerator, self.accelerator.device
        scored = self._sample_and_score()
        if device.type == "cpu":  # the rollout's freed heap (cpu_memory: its holes fit no later tensor)
            return_free_memory()
        if args.dynamic_sampling:
            scored = self._fill_with_varied_groups(scored)
        rollout, offset, n = scored.rollout, scored.offset, len(scored.rows)
        all_scores = acc.gather(scored.scores.to(device)).cpu()
        rewards = self._outcome_rewards(all_scores)
        process = self._process_indices
        outcome = [i for i in range(len(self.reward_functions)) if i not in process]
        if outcome:  # advantages.py: the estimator and the multi-objective aggregation (docs/objectives.md)
            token_counts = None
            if args.advantage_estimator == "reinforce_pp_baseline":
                token_counts = acc.gather(rollout.loss_mask.sum(-1).to(device)).cpu().float()
            advantages = combine_and_normalize(all_scores[:, outcome], self.reward_weights[outcome],
                                               args.num_generations, estimator=args.advantage_estimator,
                                               scale_rewards=args.scale_rewards, token_counts=token_counts,
                                               multi_objective_aggregation=args.multi_objective_aggregation)
        else:  # only process rewards: the per-token advantages below are the whole signal
            advantages = torch.zeros(len(rewards))
        if process:
            advantages = self._add_process_advantages(advantages, process, scored.step_rewards, scored.step_ends,
                                                      rollout.completion_ids.shape[1])  # fmt: skip
        width = rollout.completion_ids.shape[1]
        local = advantages[offset : offset + n]
        token_advantages = local[:, :width] if local.dim() == 2 else local[:, None].expand(-1, width)
        loss_mask = rollout.loss_mask
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.is_truncated)[:, None].to(loss_mask.dtype)
        batch = TrainBatch(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.attention_mask,
                           loss_mask, rollout.lengths, token_advantages.to(device).contiguous(),
                           sampling_logprobs=rollout.sampling_logprobs, multimodal=rollout.multimodal)  # fmt: skip
        # With vLLM (TRL: use_vllm and its correction) π_old is always the training forward's; the sampler's
        # log-probs only feed the correction.
        corrected = args.use_vllm and args.vllm_importance_sampling_correction
        if not trains_on_policy(args) or corrected:
            # The engine's log-probs serve as π_old only where they are the training forward's (the in-process
            # engine in float32, tested to 1e-5); otherwise π_old comes from a training-style forward.
            exact = getattr(self.engine, "exact_logprobs", False) and rollout.sampling_logprobs is not None and \
                (self.agents is None or self.agents.exact_logprobs) and not corrected  # fmt: skip
            batch.old_logprobs = rollout.sampling_logprobs if exact else self._logprobs_in_chunks(
                self.unwrapped_model, batch)  # fmt: skip
        if corrected:
            if rollout.sampling_logprobs is None:
                raise ValueError(f"vllm_importance_sampling_correction needs the engine's sampling log-probs, and "
                                 f"{type(self.engine).__name__} reports none: set "
                                 f"vllm_importance_sampling_correction=False.")  # fmt: skip
            batch.sampling_ratio, stats = sampling_correction(
                batch.old_logprobs, rollout.sampling_logprobs, loss_mask, mode=args.vllm_importance_sampling_mode,
                clip_min=args.vllm_importance_sampling_clip_min, clip_max=args.vllm_importance_sampling_clip_max)
            self.window.add(reduce_extremes(acc, stats))
        if args.beta > 0:
            with reference_policy(self.unwrapped_model, self.reference) as reference:
                batch.ref_logprobs = self._logprobs_in_chunks(reference, batch)
        if device.type == "cpu":  # and the no-grad forwards' (π_old, π_ref), before the training forward
            return_free_memory()
        self._log_generation(all_scores, rewards, rollout, scored.failures)
        self.window.add(self.reward_logs.flush_metrics(acc))
        if self.agents is not None:
            self.window.add(self.agents.metrics(acc))
        extra = self.reward_logs.flush_extra()
        if args.log_completions:
            shown = args.num_completions_to_print or args.num_generations
            self._samples = [
                {**loggable_prompt(scored.prompts[i], args.log_multimodal), "completion": scored.completions[i],
                 "rewards": {f.name: _none_if_nan(all_scores[offset + i, j].item())
                             for j, f in enumerate(self.reward_functions)},
                 "reward": _none_if_nan(rewards[offset + i].item()),
                 "advantage": advantages[offset + i].float().mean().item(),
                 **({"extra": {k: v[i] for k, v in extra.items() if i < len(v)}} if extra else {})}
                for i in range(min(shown, n))
            ]  # fmt: skip
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + self.state.generations))
        return batch.select(order)

    def _sample_and_score(self) -> ScoredRollout:
        """Draw this process's next rows, sample their completions with the engine and score them."""
        args, acc = self.args, self.accelerator
        per_process = args.generation_batch_size
        prompts = self.sampler.rows(self.train_dataset, per_process * acc.num_processes // args.num_generations)
        offset = acc.process_index * per_process
        global_rows = [row for row in prompts for _ in range(args.num_generations)]  # each prompt G times
        rows = global_rows[offset : offset + per_process]
        seed = rollout_seed(args.seed, self.state.generations, acc.process_index)
        self.state.generations += 1
        rollout, rows, completions, completion_ids = self._rollout(
            rows, group_counts(len(rows), args.num_generations, offset), seed)
        prompts, scores, failures, step_rewards, step_ends = self._score(rows, completions, completion_ids)
        return ScoredRollout(rows, prompts, completions, completion_ids, rollout, scores, failures, step_rewards,
                             step_ends, offset)  # fmt: skip

    def _rollout(self, rows: list[dict], counts: list[int], seed: int):
        """The engine's rollout of rows (consecutive runs of counts[i] rows share a prompt), on this process's
        device, with its completions decoded: (rollout, rows, completions, completion token ids). The fields an
        engine reports per row (`Rollout.extra`) join the rows, so reward functions receive them as columns."""
        starts = [sum(counts[:i]) for i in range(len(counts))]
        prompts = self.codec.encode([rows[s] for s in starts], counts)
        self.engine.sync_weights(self.unwrapped_model)
        if self.agents is not None:  # multi-turn (grpokit.agents): tools, environments or the user's rollout_func
            rollout, completions = self.agents.rollout(self.engine, rows, self._sampling_params(), seed, self)
            rollout = rollout.to(self.accelerator.device)
            decoded, completion_ids = self.codec.decode(rollout, prompts.raw)
            completions = decoded if completions is None else completions
        else:
            rollout = self.engine.generate(prompts, self._sampling_params(), seed).to(self.accelerator.device)
            completions, completion_ids = self.codec.decode(rollout, prompts.raw)
            if prompts.images is not None:  # reward functions receive the messages with their images, as in TRL
                rows = [{**row, "prompt": prompts.raw[b]} if prompts.images[b] else row
                        for row, b in zip(rows, prompts.rows())]  # fmt: skip
        if rollout.extra:
            rows = [{**row, **{name: values[i] for name, values in rollout.extra.items()}} for i, row in enumerate(rows)]
        return rollout, rows, completions, completion_ids

    def _sampling_params(self):
        args = self.args
        return self.codec.sampling_params(args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
                                          top_k=args.top_k, min_p=args.min_p,
                                          repetition_penalty=args.repetition_penalty)  # fmt: skip

    @torch.no_grad()
    def _logprobs_in_chunks(self, model, batch: TrainBatch) -> torch.Tensor:
        """Log-probs [N, T] of batch's completions under model (π_old or π_ref), per_device_train_batch_size rows at
        a time."""
        out = []
        for part in batch.split(self.args.per_device_train_batch_size):
            with self.accelerator.autocast():
                logprobs, _ = token_logprobs(model, part.input_ids, part.input_mask, part.completion_ids.shape[1],
                                             self.args.temperature, fp32_head=self.args.cast_lm_head_to_fp32,
                                             multimodal=part.multimodal,
                                             padding_free=self.args.padding_free)  # fmt: skip
            out.append(logprobs.float())
        return torch.cat(out)

    @property
    def _process_indices(self) -> list[int]:
        return [i for i, f in enumerate(self.reward_functions) if f.is_process]

    def _outcome_rewards(self, scores: torch.Tensor) -> torch.Tensor:
        weights = self.reward_weights.clone()
        weights[self._process_indices] = 0.0  # process rewards enter as token advantages, not here
        return combine_rewards(scores, weights)

    def _score(self, rows, completions, completion_ids):
        """(prompts, scores [N, F], failures, step rewards, step ends) of the completions of rows, with the
        reward routing and process-reward handling of training (evaluation scores through this too)."""
        args = self.args
        columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt",)}
        prompts = [r.get("prompt", r.get("prompt_ids")) for r in rows]
        names = [f.name for f in self.reward_functions]
        routes = (routes_from_column(columns[args.reward_routing_column], names, args.reward_routing_column)
                  if args.reward_routing_column in columns else None)  # fmt: skip
        step_ends = ([step_token_ends(ids, self.codec.tokenizer, args.step_separator) for ids in completion_ids]
                     if self._process_indices else [[] for _ in rows])  # fmt: skip
        if self._process_indices and "turn_ends" in columns:  # an agent's steps are its turns (grpokit.agents)
            step_ends = [list(ends) for ends in columns["turn_ends"]]
        context = {"trainer_state": self.state, "log_metric": self.reward_logs.log_metric,
                   "log_extra": self.reward_logs.log_extra}  # fmt: skip
        scores, failures, step_rewards = compute_rewards(
            self.reward_functions, prompts, completions, completion_ids, columns, on_error=args.reward_fn_errors,
            routes=routes, step_counts=[len(e) for e in step_ends], context=context,
        )  # fmt: skip
        unscored = torch.isnan(scores).all(dim=1).nonzero().flatten().tolist() if scores.shape[1] else []
        if unscored:  # TRL's warning: such a completion has no reward at all
            row = unscored[0]
            warnings.warn(f"All reward functions returned None for {len(unscored)} completion(s), e.g. prompt "
                          f"{_short(prompts[row])}, completion {_short(completions[row])}: they get no advantage. "
                          f"Make sure at least one reward function scores every completion.", stacklevel=3)
        return prompts, scores, failures, step_rewards, step_ends

    def _fill_with_varied_groups(self, first: ScoredRollout) -> ScoredRollout:
        """DAPO's dynamic sampling: keep only groups whose rewards vary, and sample more prompts until the batch
        is full (at most max_resample_rounds more rounds; then zero-spread groups fill the rest, counted)."""
        args, size, G = self.args, len(first.rows), self.args.num_generations

        def groups(scored: ScoredRollout, varied: bool) -> list[int]:
            _, std = group_stats(self._outcome_rewards(scored.scores), G)
            return [i for g, s in enumerate(std.tolist()) if (s > 0) == varied for i in range(g * G, (g + 1) * G)]

        kept, rounds, current = [], 0, first
        while True:
            kept.append(current.select(groups(current, varied=True)))
            if sum(len(k.rows) for k in kept) >= size or rounds >= args.max_resample_rounds:
                break
            current, rounds = self._sample_and_score(), rounds + 1
        filled = ScoredRollout.concat(kept)
        missing = size - len(filled.rows)
        self.window.add({"dynamic_sampling/rounds": rounds,
                         "dynamic_sampling/filled_groups": max(missing, 0) / G})  # fmt: skip
        if missing > 0:  # out of rounds: complete the batch with the first round's zero-spread groups
            filled = ScoredRollout.concat([filled, first.select(groups(first, varied=False)[:missing])])
        return filled.select(list(range(size)))

    def _add_process_advantages(self, advantages, process, step_rewards, step_ends, width) -> torch.Tensor:
        """Outcome advantages [N_global] broadcast over tokens, plus each process function's weighted token
        advantages; every process gathers the step rewards of the whole batch (groups may span processes)."""
        from accelerate.utils import gather_object

        gather = gather_object if self.accelerator.num_processes > 1 else (lambda values: values)
        ends, width = gather(step_ends), max(gather([width]))
        token_advantages = advantages[:, None].expand(-1, width).clone()
        for index in process:
            token_advantages += self.reward_weights[index] * process_advantages(
                gather(step_rewards[index]), ends, self.args.num_generations, width
            )
        return token_advantages

    def _log_generation(self, scores, rewards, rollout, failures) -> None:
        args, acc = self.args, self.accelerator
        # With tools a completion's length counts the model's own tokens, not the tool results (as TRL).
        lengths = rollout.loss_mask.sum(1) if self.agents is not None else rollout.lengths
        lengths = acc.gather(lengths.float()).cpu()
        truncated = acc.gather(rollout.is_truncated.float()).cpu()
        tokens = acc.gather((rollout.prompt_mask.sum() + rollout.attention_mask.sum()).reshape(1)).sum().item()
        self.state.num_tokens += int(tokens)
        keys = torch.tensor(sequence_keys(rollout.completion_ids, rollout.attention_mask), device=acc.device)
        # Reward errors are counted where they happen: the metric is the total over the processes.
        errors = acc.reduce(torch.tensor([float(failures.get(f.name, 0)) for f in self.reward_functions],
                                         device=acc.device), "sum").tolist()  # fmt: skip
        names = [f.name for f in self.reward_functions]
        self.window.add(generation_metrics(rewards, scores, names, lengths, truncated, args.num_generations,
                                           errors={n: e for n, e in zip(names, errors) if n in failures or e}))
        self.window.add({"completions/duplicate_ratio": duplicate_ratio(acc.gather(keys).tolist(),
                                                                        args.num_generations)})  # fmt: skip

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
        metrics: dict[str, float] = {}
        for name, one in named_eval_datasets(dataset).items():
            prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
            metrics.update(self._evaluate_one(one, prefix))
        self.callback_handler("on_evaluate", self.args, self.state, metrics=metrics)
        return metrics

    @torch.no_grad()
    def _evaluate_one(self, dataset, prefix: str) -> dict[str, float]:
        from accelerate.utils import gather_object

        args, acc = self.args, self.accelerator
        if is_iterable_dataset(dataset):
            dataset = dataset_rows(dataset)
        n = args.num_generations_eval
        names = [f.name for f in self.reward_functions]
        indices = list(range(acc.process_index, len(dataset), acc.num_processes))
        prompts_per_batch = max(1, args.per_device_eval_batch_size // n)
        batches = math.ceil(len(indices) / prompts_per_batch)
        if is_sharded(self.unwrapped_model):  # every process samples as many batches as the busiest one
            batches = math.ceil(math.ceil(len(dataset) / acc.num_processes) / prompts_per_batch)
        records, loss_sum, loss_count = [], 0.0, 0
        for batch_index in range(batches):
            chunk = indices[batch_index * prompts_per_batch : (batch_index + 1) * prompts_per_batch]
            # A process with no prompts left samples a discarded one, in step with the others.
            rows = [dataset[i] for i in (chunk or [0]) for _ in range(n)]
            seed = rollout_seed(args.seed + EVAL_SEED_OFFSET, batch_index, acc.process_index)
            rollout, rows, completions, completion_ids = self._rollout(rows, [n] * (len(rows) // n), seed)
            prompts, scores, *_ = self._score(rows, completions, completion_ids)
            rewards = self._outcome_rewards(scores)
            loss = self._evaluation_loss(rollout, group_advantages(rewards, n, args.scale_rewards))
            if not chunk:
                continue
            loss_sum, loss_count = loss_sum + loss, loss_count + 1
            records += group_records(prompts, completions, scores, rewards, rollout.lengths, rollout.is_truncated,
                                     names, n)  # fmt: skip
        self.reward_logs.flush_extra()
        logged = self.reward_logs.flush_metrics(acc)
        totals = acc.reduce(torch.tensor([loss_sum, float(loss_count)], dtype=torch.float64, device=acc.device), "sum")
        self.eval_samples = gather_object(records) if acc.num_processes > 1 else records
        metrics = evaluation_metrics(self.eval_samples, names, args.pass_threshold, prefix=f"{prefix}/")
        metrics.update({f"{prefix}/{k}": v for k, v in logged.items()})
        if self.agents is not None:
            metrics.update({f"{prefix}/{k}": v for k, v in self.agents.metrics(acc).items()})
        metrics[f"{prefix}_loss"] = (totals[0] / totals[1].clamp(min=1)).item()
        return metrics

    def _evaluation_loss(self, rollout, advantages: torch.Tensor) -> float:
        """The GRPO loss value of an evaluation batch (no gradient): on-policy, so the ratio is 1 and the value
        is the aggregate of -A (+ beta·KL)."""
        args = self.args
        width = rollout.completion_ids.shape[1]
        batch = TrainBatch(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.attention_mask,
                           rollout.loss_mask, rollout.lengths,
                           advantages.to(rollout.prompt_ids.device)[:, None].expand(-1, width),
                           multimodal=rollout.multimodal)  # fmt: skip
        logprobs = self._logprobs_in_chunks(self.unwrapped_model, batch)
        ref = None
        if args.beta > 0:
            with reference_policy(self.unwrapped_model, self.reference) as reference:
                ref = self._logprobs_in_chunks(reference, batch)
        loss, _ = policy_loss(logprobs, None, ref, batch.advantages, batch.loss_mask, **objective_options(args))
        return loss.item()

    def _log_evaluation(self, step: int, sink: MetricSink) -> None:
        record = {"step": step, "epoch": round(self.state.epoch, 4), **self.evaluate()}
        self._last_evaluation = record
        self.state.log_history.append(record)
        sink.write(record, console=False)
        if self.accelerator.is_main_process:
            shown = " ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in record.items()
                             if k == "eval/reward" or "/pass@" in k)  # fmt: skip
            print(f"[step {step}] eval: {shown}", file=sys.stderr, flush=True)
        self.check_guard()

    def check_guard(self) -> None:
        """Warn, once per guard_window logging steps, when the reward rises while guard_metric falls."""
        args = self.args
        if args.guard_metric is None or not self.accelerator.is_main_process:  # one warning is enough
            return
        step, message = guard_message(self.state.log_history, args.guard_metric, args.guard_window)
        if message and getattr(self, "_guard_warned_step", None) != step:
            self._guard_warned_step = step
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------------------------- saving, resuming

    def _training_parts(self) -> TrainingParts:
        moving_reference = self.args.sync_ref_model and self.reference is not None
        return TrainingParts(self.model, self.optimizer, self.scheduler, self.reference if moving_reference else None)

    def _save_checkpoint(self) -> Path | None:
        cursor, args = self.cursor, self.args
        if cursor.batch is not None and cursor.pass_index == args.num_iterations - 1 and \
                cursor.micro_index == math.ceil(len(cursor.batch) / args.per_device_train_batch_size):
            cursor = GenerationCursor()  # used up: the resumed run samples the next one, as this one would  # fmt: skip
        loop = {"sampler": self.sampler.state_dict(), "window": self.window.state_dict(),
                "pass_index": cursor.pass_index, "micro_index": cursor.micro_index,
                "entropy_controller": None if self.entropy_controller is None else self.entropy_controller.state_dict()}
        process = {"batch": None if cursor.batch is None else cursor.batch.to("cpu").state_dict()}
        self._track_best_checkpoint()
        return self.checkpointer.save(self._training_parts(), self.state, loop, process)

    def _track_best_checkpoint(self) -> None:
        """metric_for_best_model: when this step's evaluation beats state.best_metric (strictly, as transformers),
        the checkpoint about to be written becomes state.best_model_checkpoint."""
        args, state = self.args, self.state
        evaluation = self._last_evaluation
        if args.metric_for_best_model is None or evaluation is None or evaluation["step"] != state.global_step:
            return
        value = float(evaluation[best_metric_key(args.metric_for_best_model, evaluation)])
        if state.best_metric is None or (value > state.best_metric if args.greater_is_better else
                                         value < state.best_metric):  # fmt: skip
            state.best_metric, state.best_global_step = value, state.global_step
            state.best_model_checkpoint = str(Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def _load_best_checkpoint(self) -> None:
        """load_best_model_at_end: the best checkpoint's weights (the adapter with LoRA) into the model."""
        state = self.state
        path = Path(state.best_model_checkpoint)
        if not path.is_dir():
            warnings.warn(f"load_best_model_at_end: the best checkpoint {path} is gone; the model keeps its last "
                          f"weights.", UserWarning, stacklevel=3)  # fmt: skip
            return
        load_model_weights(self.unwrapped_model, path)
        if self.accelerator.is_main_process:
            print(f"Loaded the best checkpoint, {path.name} ({self.args.metric_for_best_model} = "
                  f"{state.best_metric:.6g}).", file=sys.stderr, flush=True)  # fmt: skip

    def _resume(self, resume: bool | str) -> None:
        resumed = self.checkpointer.load(self.checkpointer.find(resume), self._training_parts())
        self.sampler.load_state_dict(resumed.loop["sampler"])
        if self.args.ignore_data_skip:  # transformers' meaning: the current epoch's data starts over
            self.sampler.position = 0
        self.window.load_state_dict(resumed.loop["window"])
        if self.entropy_controller is not None and resumed.loop.get("entropy_controller"):
            self.entropy_controller.load_state_dict(resumed.loop["entropy_controller"])
        batch = (resumed.process or {}).get("batch")
        if batch is None:
            self.cursor = GenerationCursor()
        else:
            self.cursor = GenerationCursor(TrainBatch.from_state_dict(batch).to(self.accelerator.device),
                                           resumed.loop["pass_index"], resumed.loop["micro_index"])  # fmt: skip
        self.state = resumed.state
        self.state.max_steps = total_steps(self.args, self.train_dataset, self.accelerator.num_processes)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every process calls it; the main process writes (under FSDP2 / ZeRO-3 all of them gather first), or with
        save_on_each_node the main process of each node."""
        self.accelerator.wait_for_everyone()
        weights = self._gathered_weights(self.unwrapped_model) if is_sharded(self.unwrapped_model) else None
        if self.checkpointer.writes:
            self._write_model(Path(output_dir or self.args.output_dir), weights)
            if self.args.push_to_hub and not _internal_call and self.accelerator.is_main_process:
                push_folder(self.args, Path(output_dir or self.args.output_dir), "Model saved by grpokit")

    def push_to_hub(self, commit_message: str | None = "End of training", **unused) -> str | None:
        """Save the model to output_dir and upload it to hub_model_id (transformers' Trainer.push_to_hub)."""
        self.save_model(self.args.output_dir, _internal_call=True)
        if self.accelerator.is_main_process:
            return push_folder(self.args, Path(self.args.output_dir), commit_message or "End of training")
        return None

    def _gathered_weights(self, model) -> dict[str, torch.Tensor]:
        """What `_write_model` needs of a sharded model, gathered (a collective): with LoRA the adapter only (the
        base is never gathered), unless the merged model is written too."""
        adapter_only = is_peft_model(model) and not self.args.save_merged
        return trainable_parameters(model) if adapter_only else full_state_dict(model)

    def _write_model(self, output_dir: Path, weights: dict[str, torch.Tensor] | None = None,
                     with_weights: bool = True) -> None:  # fmt: skip
        # Each node's main process writes under save_on_each_node; transformers would leave it to rank 0 alone.
        with models_written_by_this_process(not self.accelerator.is_main_process):
            self._write_model_files(output_dir, weights, with_weights)

    def _write_model_files(self, output_dir: Path, weights: dict[str, torch.Tensor] | None,
                           with_weights: bool) -> None:  # fmt: skip
        output_dir.mkdir(parents=True, exist_ok=True)
        model = self.unwrapped_model
        if not with_weights:  # a sharded checkpoint: its config and tokenizer make the directory legible
            if hasattr(getattr(model, "config", None), "save_pretrained"):
                model.config.save_pretrained(output_dir)
            if hasattr(self.processing_class, "save_pretrained"):
                self.processing_class.save_pretrained(output_dir)
            return
        card = model_card_writable(output_dir)  # asked first: peft's save_pretrained writes a README.md of its own
        if hasattr(model, "save_pretrained"):
            # With LoRA: the adapter only. A sharded model saves the gathered weights.
            model.save_pretrained(output_dir, safe_serialization=True,
                                  **({"state_dict": weights} if weights is not None else {}))  # fmt: skip
            if self.args.save_merged and is_peft_model(model):
                save_merged(model, output_dir / "merged", self.processing_class, weights)
        else:
            from safetensors.torch import save_file

            weights = model.state_dict() if weights is None else weights
            save_file({k: v.contiguous() for k, v in weights.items()}, str(output_dir / "model.safetensors"))
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(output_dir)
        if card:
            history = self.state.log_history
            base_model = getattr(getattr(model, "config", None), "name_or_path", "") or "(a model object)"
            write_model_card(output_dir, render_model_card(
                self.args.run_name or Path(self.args.output_dir).name, base_model,
                describe_dataset(self.train_dataset),
                [(f.name, w) for f, w in zip(self.reward_functions, self.reward_weights.tolist())],
                {**self.args.to_dict(), "max_steps": self.state.max_steps},
                final_metrics=next((r for r in reversed(history) if "reward" in r), None),
                final_eval=next((r for r in reversed(history) if "eval/reward" in r), None),
            ))  # fmt: skip


# ------------------------------------------------------------------------------------------------------ setup


def check_run(args: GRPOConfig, train_dataset, eval_dataset, rollout_engine, tools, rollout_func,
              environment_factory) -> None:  # fmt: skip
    """The run-time checks (what GRPOConfig.validate cannot know: the data, the launch, the arguments)."""
    check_agents(tools, rollout_func, environment_factory, rollout_engine)
    check_dataset(train_dataset)
    if is_iterable_dataset(train_dataset) and args.max_steps <= 0:
        raise ValueError("train_dataset is an IterableDataset (no len()): set max_steps > 0 to say how long to "
                         "train, as with transformers' Trainer.")  # fmt: skip
    for name, dataset in named_eval_datasets(eval_dataset).items():
        check_dataset(dataset, "eval_dataset" if name is None else f"eval_dataset[{name!r}]")
    if eval_dataset is None and args.eval_strategy != "no":
        raise ValueError(f"eval_strategy={args.eval_strategy!r} needs an eval_dataset: pass "
                         f"GRPOTrainer(eval_dataset=...), or set eval_strategy='no'.")  # fmt: skip
    if eval_dataset is None and args.eval_on_start:
        raise ValueError("eval_on_start=True needs an eval_dataset: pass GRPOTrainer(eval_dataset=...), or set "
                         "eval_on_start=False.")  # fmt: skip
    if args.dynamic_sampling and (args.generation_batch_size % args.num_generations):
        raise ValueError("dynamic_sampling keeps or drops whole groups: make the per-process generation batch a "
                         "multiple of num_generations.")  # fmt: skip
    if args.dynamic_sampling and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise NotImplementedError("dynamic_sampling runs in one process only for now: processes would draw "
                                  "different numbers of prompt batches and fall out of step.")  # fmt: skip
    if rollout_engine is not None and not isinstance(rollout_engine, RolloutEngine):
        raise TypeError(f"rollout_engine={rollout_engine!r} is not a RolloutEngine: it needs generate(prompts, "
                        f"params, seed) -> Rollout and sync_weights(model) (see grpokit.rollout.engine).")


def moe_shape(config) -> tuple[int, int] | None:
    """(experts, experts per token) of a mixture-of-experts config, whatever the family calls them; None if not MoE."""
    experts = next((getattr(config, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(config, n, None)), None)  # fmt: skip
    top_k = next((getattr(config, n) for n in ("num_experts_per_tok", "experts_per_token") if getattr(config, n, None)),
                 None)  # fmt: skip
    return (experts, top_k) if experts and top_k else None


def router_aux_loss_coef(args: GRPOConfig, model) -> float:
    """TRL's rule: router_aux_loss_coef, or (None) the MoE model config's own (Qwen3-MoE: 0.001); 0 turns it off."""
    config = getattr(model, "config", None)
    is_moe = moe_shape(config) is not None
    if args.router_aux_loss_coef is None:
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if is_moe else 0.0
    if args.router_aux_loss_coef and not is_moe:
        raise ValueError(f"router_aux_loss_coef={args.router_aux_loss_coef} needs a mixture-of-experts model (its "
                         f"config has num_experts and num_experts_per_tok); this model has none. Set it to None.")
    return float(args.router_aux_loss_coef)


def objective_options(args: GRPOConfig) -> dict:
    """The config's objective settings as policy_loss's keyword arguments."""
    names = ("loss_type", "beta", "epsilon", "epsilon_high", "importance_sampling_level", "max_completion_length",
             "delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
             "vespo_lambda_neg", "off_policy_mask_threshold", "use_bias_correction_kl")  # fmt: skip
    return {name: getattr(args, name) for name in names}


def reward_weights(args: GRPOConfig, count: int, environment_rewards: int = 0) -> torch.Tensor:
    """One weight per reward function; the environments' get_reward functions (last) weigh 1, as in TRL."""
    count -= environment_rewards
    weights = args.reward_weights or [1.0] * count
    if len(weights) != count:
        raise ValueError(f"reward_weights has {len(weights)} entries for {count} reward functions; give one weight "
                         f"per function.")  # fmt: skip
    return torch.tensor(list(weights) + [1.0] * environment_rewards, dtype=torch.float32)


def trains_on_policy(args: GRPOConfig) -> bool:
    """Whether every micro-batch is trained on before the optimizer step that follows its sampling: one pass
    (μ = 1) and each optimizer step's window holds whole generation batches. Otherwise π_old is needed."""
    return args.num_iterations == 1 and args.gradient_accumulation_steps % args.steps_per_generation == 0


def total_steps(args: GRPOConfig, train_dataset, num_processes: int) -> int:
    """max_steps, or the optimizer steps that num_train_epochs passes over the prompts take."""
    if args.max_steps > 0:
        return args.max_steps
    num_prompts = len(train_dataset)
    prompts_per_generation = args.generation_batch_size * num_processes // args.num_generations
    generations = math.ceil(args.num_train_epochs * num_prompts / prompts_per_generation)
    micro_batches = generations * args.steps_per_generation * args.num_iterations
    return max(math.ceil(micro_batches / args.gradient_accumulation_steps), 1)


def build_scheduler(optimizer, args: GRPOConfig, max_steps: int):
    from transformers import get_scheduler

    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * max_steps)
    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=max_steps,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs or None)  # fmt: skip


def best_metric_key(name: str, metrics: dict) -> str:
    """The evaluation metric metric_for_best_model names, as transformers reads it ('loss' is eval_loss) or by
    grpokit's own names ('reward' is eval/reward)."""
    for key in (name, f"eval_{name}", f"eval/{name}"):
        if key in metrics:
            return key
    raise ValueError(f"metric_for_best_model={name!r} is not among the evaluation's metrics: "
                     f"{sorted(k for k in metrics if k not in ('step', 'epoch'))}.")  # fmt: skip


def set_log_level(name: str) -> None:
    """transformers' logging verbosity by TrainingArguments' level name ('passive': leave it)."""
    if LOG_LEVELS[name] is not None:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity(LOG_LEVELS[name])


def activation_offload(args: GRPOConfig, device: torch.device) -> ActivationOffload | None:
    """The hooks that keep the training forward's saved tensors in host memory (activation_offloading), where there
    is an accelerator to take them off."""
    if not args.activation_offloading:
        return None
    if device.type == "cpu":
        warnings.warn("activation_offloading=True has no effect on a CPU: the activations are in host memory "
                      "already. It is left off; set it on GPU runs.", UserWarning, stacklevel=3)  # fmt: skip
        return None
    return ActivationOffload(device.type)


def warn_like_trl(args: GRPOConfig, model, quantization_config) -> None:
    """TRL's advisory warnings, with its wording's substance."""
    if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warnings.warn(f"importance_sampling_level='sequence' with loss_type={args.loss_type!r}: the loss sums "
                      f"per-token contributions, which weights each sequence by its length instead of optimising the "
                      f"per-sequence objective; GSPO's setup is loss_type='grpo'.", UserWarning, stacklevel=3)
    if not isinstance(model, str) and quantization_config is not None:
        warnings.warn("quantization_config is ignored: the model is already instantiated (quantize it when loading, "
                      "or pass the model as a path).", UserWarning, stacklevel=3)  # fmt: skip
    if not isinstance(model, str) and args.model_init_kwargs:
        warnings.warn("model_init_kwargs is ignored: the model is already instantiated.", UserWarning, stacklevel=3)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def as_steps(value: float, max_steps: int) -> int:
    """TrainingArguments allow a fraction of the run for logging/saving intervals."""
    return max(1, math.ceil(value * max_steps)) if 0 < value < 1 else max(1, int(value))

