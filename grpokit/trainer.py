"""GRPOTrainer: rollout → rewards → advantages → μ optimisation passes → optimizer step, on accelerate.

Batch semantics are TRL's: a process generates `generation_batch_size` = per_device_train_batch_size ×
steps_per_generation completions at a time (G per prompt; a prompt's group may span processes), splits them into
steps_per_generation micro-batches, and takes one optimizer step every gradient_accumulation_steps micro-batches;
the generation batch is reused num_iterations (μ) times. Micro-batch losses are normalised by the counts of the
whole optimizer step's batch, so gradient accumulation does not change the update (except for `bnpo`, which is a
per-micro-batch mean by definition).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .advantages import group_advantages, group_stats, process_advantages
from .batch import ScoredRollout
from .config import GRPOConfig
from .data import PromptSampler, check_dataset, dataset_columns, is_conversational, pad_left, tokenize_prompts
from .distributed import (
    all_processes_done,
    build_accelerator,
    configure_deepspeed,
    deepspeed_stage,
    is_sharded,
    is_zero3,
    zero3_inference_engine,
)
from .evaluation import evaluation_metrics, group_records
from .logs import MetricSink, MetricWindow, generation_metrics
from .loss import high_entropy_mask, policy_loss
from .policy import (
    apply_peft,
    check_context_length,
    disable_dropout,
    frozen_copy,
    is_peft_model,
    load_causal_lm,
    load_tokenizer,
    mix_into_reference,
    reference_policy,
    token_logprobs,
)
from .rewards.base import (
    RewardFunction,
    check_required_columns,
    combine_rewards,
    compute_rewards,
    reward_name,
    routes_from_column,
)
from .rewards.model import RewardModel
from .rewards.process import step_token_ends
from .rollout import SamplingParams, generate
from .saving import Checkpointing, TrainerState
from .signals import duplicate_ratio, guard_message, sequence_keys


class GRPOTrainer(Checkpointing):
    def __init__(
        self,
        model,
        reward_funcs,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        peft_config=None,
        callbacks=None,
    ):
        from accelerate.utils import set_seed

        self.args = args = args or GRPOConfig()
        if eval_dataset is not None:
            check_dataset(eval_dataset, "eval_dataset")
        elif args.eval_strategy != "no":
            raise ValueError(f"eval_strategy={args.eval_strategy!r} needs an eval_dataset: pass "
                             f"GRPOTrainer(eval_dataset=...), or set eval_strategy='no'.")  # fmt: skip
        self.eval_dataset = eval_dataset
        if callbacks:
            raise NotImplementedError("callbacks are not supported yet; read trainer.state.log_history instead.")
        if args.dynamic_sampling and (args.generation_batch_size % args.num_generations):
            raise ValueError("dynamic_sampling keeps or drops whole groups: make the per-process generation batch a "
                             "multiple of num_generations.")  # fmt: skip
        if args.dynamic_sampling and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise NotImplementedError("dynamic_sampling runs in one process only for now: processes would draw "
                                      "different numbers of prompt batches and fall out of step.")  # fmt: skip
        # Everything a user can get wrong in the data or rewards is checked before the model is loaded.
        check_dataset(train_dataset)
        self.train_dataset = train_dataset
        self.reward_functions = self._build_reward_functions(reward_funcs, reward_processing_classes)
        check_required_columns(self.reward_functions, dataset_columns(train_dataset))
        weights = args.reward_weights or [1.0] * len(self.reward_functions)
        if len(weights) != len(self.reward_functions):
            raise ValueError(
                f"reward_weights has {len(weights)} entries for {len(self.reward_functions)} reward functions; give "
                f"one weight per function."
            )
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

        self.accelerator = build_accelerator(args)
        args.check_batch(self.accelerator.num_processes)
        set_seed(args.seed)

        self.model, self.processing_class = self._build_policy(model, processing_class, peft_config)
        check_context_length(self.model, args)
        # With LoRA the reference is the same model with its adapter disabled: no second copy of the weights.
        self.reference = None
        if args.beta > 0 and not is_peft_model(self.model):
            self.reference = self._reference_for(model)
        if args.sync_ref_model and is_peft_model(self.model):
            raise ValueError(
                "sync_ref_model with LoRA is not supported: the reference is the base model with the adapter off, "
                "and the base weights never change. Train without LoRA to refresh the reference, or turn "
                "sync_ref_model off."
            )
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {"use_reentrant": False}
            )
            if is_peft_model(self.model):  # frozen embeddings would cut the graph through checkpointed blocks
                self.model.enable_input_require_grads()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
        )  # fmt: skip
        if self.accelerator.is_fsdp2 and is_peft_model(self.model):
            raise NotImplementedError("LoRA under FSDP2 is not supported yet: train LoRA with DDP (plain torchrun "
                                      "or examples/accelerate/ddp.yaml), or train all weights with FSDP2.")  # fmt: skip
        # Under DeepSpeed the engine takes the optimizer step inside backward(); see _optimizer_step.
        self._deepspeed = deepspeed_stage(self.accelerator) is not None
        if self._deepspeed:
            if is_peft_model(self.model):
                raise NotImplementedError("LoRA under DeepSpeed is not supported yet: train LoRA with DDP (plain "
                                          "torchrun or examples/accelerate/ddp.yaml).")  # fmt: skip
            configure_deepspeed(self.accelerator, args)
            if deepspeed_stage(self.accelerator) == 3 and args.sync_ref_model:
                raise NotImplementedError("sync_ref_model under ZeRO-3 is not supported yet (the policy's weights "
                                          "are partitioned); use ZeRO-2 or FSDP2.")  # fmt: skip
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        if self.reference is not None and is_zero3(self.reference):  # partitioned as loaded: ZeRO-3 hooks too
            self.reference = zero3_inference_engine(self.reference, self.model)
        elif self.reference is not None and self.accelerator.is_fsdp2:
            from accelerate.utils import fsdp2_prepare_model

            self.reference = fsdp2_prepare_model(self.accelerator, self.reference)  # sharded like the policy
        elif self.reference is not None:
            self.reference = self.reference.to(self.accelerator.device)
        # With sharded parameters every forward is a collective: the processes sample in step (see generate()).
        self._all_done = all_processes_done if is_sharded(self.unwrapped_model) else None
        for function in self.reward_functions:
            if isinstance(function.fn, RewardModel):
                function.fn.to(self.accelerator.device)

        self.state = TrainerState(max_steps=self._total_steps())
        self.scheduler = self._build_scheduler()
        self.sampler = PromptSampler(len(train_dataset), args.data_seed or args.seed, args.shuffle_dataset)
        self.window = MetricWindow()
        self._generation: dict[str, Any] | None = None  # the current generation batch, split in micro-batches
        self._micro_step = 0  # micro-steps taken on the current generation batch (over all μ passes)
        if eval_dataset is not None:
            check_required_columns(self.reward_functions, dataset_columns(eval_dataset))

    # ------------------------------------------------------------------------------------------------ setup

    def _build_reward_functions(self, reward_funcs, processing_classes) -> list[RewardFunction]:
        """Callables keep TRL's contract; a path / hub id or a PreTrainedModel is a reward model."""
        from transformers import PreTrainedModel

        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty: pass at least one reward function.")
        classes = list(processing_classes) if isinstance(processing_classes, (list, tuple)) else [processing_classes]
        classes = classes + [None] * (len(funcs) - len(classes))
        out = []
        for f, tokenizer in zip(funcs, classes):
            if isinstance(f, (str, PreTrainedModel)):
                f = RewardModel(f, tokenizer, batch_size=self.args.per_device_train_batch_size)
            elif not callable(f):
                raise TypeError(f"Reward {f!r} is neither a function, a reward model nor a path to one.")
            out.append(RewardFunction(reward_name(f), f))
        names = [f.name for f in out]
        if len(set(names)) != len(names):
            raise ValueError(f"Reward functions need distinct names (their metrics are keyed by name): {names}.")
        return out

    def _reference_for(self, model_argument):
        """A frozen copy of the policy; under ZeRO-3 with the model loaded partitioned (accelerate's zero.Init), a
        second load of it, partitioned the same way (a partitioned model cannot be copied)."""
        if not is_zero3(self.model):
            return frozen_copy(self.model)
        if not isinstance(model_argument, str):
            raise NotImplementedError("Under ZeRO-3 the model was loaded already partitioned, so its reference "
                                      "cannot be copied from it: pass the model as a path or hub id "
                                      "(GRPOTrainer(model=...)), or set beta=0.")  # fmt: skip
        reference = load_causal_lm(model_argument, self.args.model_init_kwargs)
        if self.args.disable_dropout:
            disable_dropout(reference)
        return reference.requires_grad_(False).eval()

    def _build_policy(self, model, processing_class, peft_config=None):
        if isinstance(model, str):
            name = model
            model = load_causal_lm(name, self.args.model_init_kwargs)
            processing_class = processing_class or load_tokenizer(name)
        if processing_class is None and hasattr(model, "config"):
            name = getattr(model.config, "_name_or_path", "")
            processing_class = load_tokenizer(name) if name else None
        if processing_class is not None:
            processing_class.padding_side = "left"
            if processing_class.pad_token is None:
                processing_class.pad_token = processing_class.eos_token
                warnings.warn("The tokenizer has no pad token: using its EOS token for padding.", stacklevel=3)
        if self.args.disable_dropout:
            disable_dropout(model)
        if peft_config is not None:
            model = apply_peft(model, peft_config)
        return model, processing_class

    def _total_steps(self) -> int:
        args = self.args
        steps_per_generation = args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
        if args.max_steps > 0:
            return args.max_steps
        prompts_per_generation = args.generation_batch_size * self.accelerator.num_processes // args.num_generations
        generations = math.ceil(args.num_train_epochs * len(self.train_dataset) / prompts_per_generation)
        return max(generations * steps_per_generation, 1)

    def _build_scheduler(self):
        from transformers import get_scheduler

        args = self.args
        warmup = args.warmup_steps or math.ceil(args.warmup_ratio * self.state.max_steps)
        return get_scheduler(
            args.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup,
            num_training_steps=self.state.max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs or None,
        )  # fmt: skip

    @property
    def unwrapped_model(self):
        return self.accelerator.unwrap_model(self.model)

    # ------------------------------------------------------------------------------------------- generation

    def _sampling_params(self) -> SamplingParams:
        args, tokenizer = self.args, self.processing_class
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(getattr(self.unwrapped_model, "generation_config", None), "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        pad = getattr(tokenizer, "pad_token_id", None)
        return SamplingParams(
            max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            eos_token_ids=eos_ids, pad_token_id=pad if pad is not None else (eos_ids[0] if eos_ids else 0),
        )  # fmt: skip

    def _draw_rows(self) -> tuple[list[dict], int]:
        """This process's rows of the next generation batch (each prompt repeated G times) and its offset."""
        args, acc = self.args, self.accelerator
        per_process = args.generation_batch_size
        prompt_indices = self.sampler.draw(per_process * acc.num_processes // args.num_generations)
        expanded = [i for i in prompt_indices for _ in range(args.num_generations)]
        offset = acc.process_index * per_process
        local = expanded[offset : offset + per_process]
        return [self.train_dataset[i] for i in local], offset

    def _prompt_tensors(self, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        if "prompt_ids" in rows[0]:
            return pad_left([list(r["prompt_ids"]) for r in rows], self._sampling_params().pad_token_id,
                            self.args.max_prompt_length)  # fmt: skip
        return tokenize_prompts([r["prompt"] for r in rows], self.processing_class, self.args.max_prompt_length,
                                self.args.chat_template_kwargs)  # fmt: skip

    def _completions_as_given(self, rows, completion_ids, completion_mask):
        ids = [c[m.bool()].tolist() for c, m in zip(completion_ids, completion_mask)]
        if self.processing_class is None:
            return ids, ids
        texts = self.processing_class.batch_decode(ids, skip_special_tokens=True)
        if rows and is_conversational(rows[0].get("prompt")):
            return [[{"role": "assistant", "content": t}] for t in texts], ids
        return texts, ids

    @torch.no_grad()
    def _logprobs_in_chunks(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        size = self.args.per_device_train_batch_size
        out = []
        for start in range(0, len(prompt_ids), size):
            batch = slice(start, start + size)
            ids = torch.cat([prompt_ids[batch], completion_ids[batch]], 1)
            mask = torch.cat([prompt_mask[batch], completion_mask[batch]], 1)
            with self.accelerator.autocast():
                logprobs, _ = token_logprobs(model, ids, mask, completion_ids.shape[1], self.args.temperature)
            out.append(logprobs.float())
        return torch.cat(out)

    def _sample_and_score(self) -> ScoredRollout:
        """Draw this process's next rows, sample their completions and score them."""
        args, acc, device = self.args, self.accelerator, self.accelerator.device
        rows, offset = self._draw_rows()
        prompt_ids, prompt_mask = (t.to(device) for t in self._prompt_tensors(rows))
        generator = torch.Generator(device=device).manual_seed(
            args.seed * 1_000_003 + self.state.generations * 1009 + acc.process_index
        )
        self.state.generations += 1
        with acc.autocast():
            rollout = generate(self.unwrapped_model, prompt_ids, prompt_mask, self._sampling_params(),
                               generator=generator, num_generations=args.num_generations,
                               all_done=self._all_done)  # fmt: skip
        completions, completion_lists = self._completions_as_given(rows, rollout.completion_ids, rollout.completion_mask)
        prompts, scores, failures, step_rewards, step_ends = self._score(rows, completions, completion_lists)
        return ScoredRollout(rows, prompts, completions, completion_lists, prompt_ids, prompt_mask, rollout, scores,
                             failures, step_rewards, step_ends, offset)  # fmt: skip

    @property
    def _process_indices(self) -> list[int]:
        return [i for i, f in enumerate(self.reward_functions) if f.is_process]

    def _outcome_rewards(self, scores: torch.Tensor) -> torch.Tensor:
        weights = self.reward_weights.clone()
        weights[self._process_indices] = 0.0  # process rewards enter as token advantages, not here
        return combine_rewards(scores, weights)

    def _fill_with_varied_groups(self, first: ScoredRollout) -> ScoredRollout:
        """DAPO's dynamic sampling: keep only groups whose rewards vary, and sample more prompts until the batch
        is full (at most max_resample_rounds more rounds; then zero-spread groups fill the rest, counted)."""
        args, size = self.args, len(first.rows)
        kept, rounds, current = [], 0, first
        while True:
            _, std = group_stats(self._outcome_rewards(current.scores), args.num_generations)
            varied = [i for g, s in enumerate(std.tolist()) if s > 0 for i in range(g * args.num_generations,
                                                                                    (g + 1) * args.num_generations)]
            kept.append(current.select(varied))
            if sum(len(k.rows) for k in kept) >= size or rounds >= args.max_resample_rounds:
                break
            current, rounds = self._sample_and_score(), rounds + 1
        filled = ScoredRollout.concat(kept)
        missing = size - len(filled.rows)
        self.window.add({"dynamic_sampling/rounds": rounds, "dynamic_sampling/filled_groups": max(missing, 0) / args.num_generations})
        if missing > 0:  # out of rounds: complete the batch with the first round's zero-spread groups
            _, std = group_stats(self._outcome_rewards(first.scores), args.num_generations)
            flat = [i for g, s in enumerate(std.tolist()) if s == 0 for i in range(g * args.num_generations,
                                                                                   (g + 1) * args.num_generations)]
            filled = ScoredRollout.concat([filled, first.select(flat[:missing])])
        return filled.select(list(range(size)))

    def _generate_batch(self) -> dict[str, Any]:
        args, acc, device = self.args, self.accelerator, self.accelerator.device
        scored = self._sample_and_score()
        if args.dynamic_sampling:
            scored = self._fill_with_varied_groups(scored)
        rows, prompts, completions, offset = scored.rows, scored.prompts, scored.completions, scored.offset
        prompt_ids, prompt_mask, rollout = scored.prompt_ids, scored.prompt_mask, scored.rollout
        failures, step_rewards, step_ends = scored.failures, scored.step_rewards, scored.step_ends
        model, process = self.unwrapped_model, self._process_indices
        # A group may span processes: its statistics need every process's scores.
        all_scores = acc.gather(scored.scores.to(device)).cpu()
        rewards = self._outcome_rewards(all_scores)
        local = slice(offset, offset + len(rows))
        if len(process) < len(self.reward_functions):
            advantages = group_advantages(rewards, args.num_generations, args.scale_rewards)
        else:  # only process rewards: the per-token advantages below are the whole signal
            advantages = torch.zeros(len(rewards))
        if process:
            advantages = self._add_process_advantages(advantages, process, step_rewards, step_ends,
                                                      rollout.completion_ids.shape[1])  # fmt: skip

        completion_mask = rollout.completion_mask
        if args.mask_truncated_completions:
            completion_mask = completion_mask * (~rollout.is_truncated)[:, None].long()
        batch = {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": rollout.completion_ids,
            "completion_mask": completion_mask, "advantages": advantages[local].to(device),
        }  # fmt: skip
        off_policy = args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
        if off_policy:
            # In float32 the sampling log-probs are the training forward's (tested to 1e-5); under autocast the
            # incremental decode rounds differently, so the old log-probs come from a training-style forward.
            batch["old_logprobs"] = rollout.logprobs if not (args.bf16 or args.fp16) else self._logprobs_in_chunks(
                model, prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask)
        if args.beta > 0:
            with reference_policy(model, self.reference) as reference:
                batch["ref_logprobs"] = self._logprobs_in_chunks(
                    reference, prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask)
        self._log_generation(all_scores, rewards, rollout, prompt_mask, failures)
        if args.log_completions:
            shown = args.num_completions_to_print or args.num_generations
            self._samples = [
                {"prompt": prompts[i], "completion": completions[i],
                 "rewards": {f.name: _none_if_nan(all_scores[offset + i, j].item())
                             for j, f in enumerate(self.reward_functions)},
                 "reward": _none_if_nan(rewards[offset + i].item()),
                 "advantage": advantages[offset + i].float().mean().item()}
                for i in range(min(shown, len(rows)))
            ]  # fmt: skip
        # Shuffle before splitting so that each optimizer step sees a mix of groups (as TRL does).
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed + self.state.generations))
        return {key: value[order.to(value.device)] for key, value in batch.items()}

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

    def _log_generation(self, scores, rewards, rollout, prompt_mask, failures) -> None:
        args, acc = self.args, self.accelerator
        lengths = acc.gather(rollout.completion_lengths.float()).cpu()
        truncated = acc.gather(rollout.is_truncated.float()).cpu()
        tokens = acc.gather((prompt_mask.sum() + rollout.completion_mask.sum()).reshape(1)).sum().item()
        self.state.num_tokens += int(tokens)
        keys = torch.tensor(sequence_keys(rollout.completion_ids, rollout.completion_mask), device=acc.device)
        # Reward errors are counted where they happen: the metric is the total over the processes.
        errors = acc.reduce(torch.tensor([float(failures.get(f.name, 0)) for f in self.reward_functions],
                                         device=acc.device), "sum").tolist()  # fmt: skip
        names = [f.name for f in self.reward_functions]
        self.window.add(generation_metrics(rewards, scores, names, lengths, truncated, args.num_generations,
                                           errors={n: e for n, e in zip(names, errors) if n in failures or e}))
        self.window.add({"completions/duplicate_ratio": duplicate_ratio(acc.gather(keys).tolist(),
                                                                        args.num_generations)})  # fmt: skip

    # ------------------------------------------------------------------------------------------- training

    def _micro_batches(self) -> list[dict[str, torch.Tensor]]:
        size = self.args.per_device_train_batch_size
        n = len(self._generation["advantages"])
        return [{k: v[s : s + size] for k, v in self._generation.items()} for s in range(0, n, size)]

    def _train_micro_batch(self, batch, num_sequences, num_tokens) -> tuple[float, dict]:
        args = self.args
        width = int(batch["completion_mask"].sum(-1).max().clamp(min=1))  # trim padding shared by the batch
        completion_ids, completion_mask = batch["completion_ids"][:, :width], batch["completion_mask"][:, :width]
        ids = torch.cat([batch["prompt_ids"], completion_ids], 1)
        mask = torch.cat([batch["prompt_mask"], completion_mask], 1)
        with self.accelerator.autocast():
            logprobs, entropies = token_logprobs(self.model, ids, mask, width, args.temperature, with_entropy=True,
                                                 entropy_grad=args.entropy_coef != 0)  # fmt: skip
        old = batch["old_logprobs"][:, :width] if "old_logprobs" in batch else None
        ref = batch["ref_logprobs"][:, :width] if "ref_logprobs" in batch else None
        loss_weights = None
        if args.top_entropy_quantile < 1.0:
            loss_weights = high_entropy_mask(entropies.detach(), completion_mask, args.top_entropy_quantile)
        advantages = batch["advantages"] if batch["advantages"].dim() == 1 else batch["advantages"][:, :width]
        loss, stats = policy_loss(
            logprobs, old, ref, advantages, completion_mask,
            loss_type=args.loss_type, beta=args.beta, epsilon=args.epsilon, epsilon_high=args.epsilon_high,
            importance_sampling_level=args.importance_sampling_level,
            max_completion_length=args.max_completion_length, num_sequences=num_sequences, num_tokens=num_tokens,
            delta=args.delta, entropies=entropies, entropy_coef=args.entropy_coef, loss_weights=loss_weights,
        )  # fmt: skip
        # The loss is already normalised over the whole optimizer step: DeepSpeed must not divide it again.
        self.accelerator.backward(loss, **({"scale_wrt_gas": False} if self._deepspeed else {}))
        return loss.item(), stats.as_dict()

    def _optimizer_step(self) -> None:
        args, acc = self.args, self.accelerator
        if self._generation is None or self._micro_step == args.steps_per_generation * args.num_iterations:
            self._generation, self._micro_step = self._generate_batch(), 0
        micro_batches = self._micro_batches()
        first = self._micro_step % args.steps_per_generation
        window = micro_batches[first : first + args.gradient_accumulation_steps]
        # Counts over the whole optimizer step (all micro-batches, all processes) normalise each micro-batch's
        # loss; DDP averages gradients over processes, so each process's share is multiplied back.
        local_counts = torch.tensor([sum(len(b["advantages"]) for b in window),
                                     sum(b["completion_mask"].sum().item() for b in window)],
                                    dtype=torch.float64, device=acc.device)  # fmt: skip
        num_sequences, num_tokens = (acc.reduce(local_counts, "sum") / acc.num_processes).tolist()

        loss_total, stats = 0.0, []
        for index, batch in enumerate(window):
            sync = index == len(window) - 1
            if self._deepspeed:  # DeepSpeed steps inside the backward of the window's last micro-batch
                acc.gradient_state._set_sync_gradients(sync)
            with acc.no_sync(self.model) if not sync else contextlib.nullcontext():
                loss, batch_stats = self._train_micro_batch(batch, num_sequences, num_tokens)
            loss_total += loss
            stats.append(batch_stats)
            self._micro_step += 1
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), args.max_grad_norm if args.max_grad_norm > 0
                                        else float("inf"))  # fmt: skip
        learning_rate = self.scheduler.get_last_lr()[0]
        # A NaN/inf loss or gradient (on any process) skips the update rather than poisoning the weights.
        # (accelerate's reduce knows "sum", "mean" and "max" only: any other name silently sums.)
        finite = math.isfinite(loss_total) and math.isfinite(float(grad_norm))
        if self._deepspeed and not finite:  # the engine has already applied it: stop rather than go on poisoned
            raise FloatingPointError(
                f"Step {self.state.global_step + 1}: non-finite loss or gradient norm under DeepSpeed, which takes "
                f"the optimizer step inside backward(), so the update could not be skipped; resume from the last "
                f"checkpoint with a lower learning rate, or use DDP/FSDP2, where such steps are skipped."
            )
        if acc.reduce(torch.tensor(float(not finite), device=acc.device), "max").item() == 0.0:
            self.optimizer.step()
            self.state.nonfinite_in_a_row = 0
        else:
            self.state.nonfinite_steps += 1
            self.state.nonfinite_in_a_row += 1
            warnings.warn(f"Step {self.state.global_step + 1}: non-finite loss or gradient norm; update skipped "
                          f"({self.state.nonfinite_in_a_row} in a row).", RuntimeWarning, stacklevel=2)  # fmt: skip
            if self.state.nonfinite_in_a_row >= args.max_nonfinite_steps:
                raise FloatingPointError(
                    f"{self.state.nonfinite_in_a_row} optimizer steps in a row had a NaN/inf loss or gradient; "
                    f"training stopped (max_nonfinite_steps={args.max_nonfinite_steps}). Lower the learning rate, "
                    f"check the rewards and inputs, or use bf16 instead of fp16."
                )
        with warnings.catch_warnings():  # a skipped update still advances the schedule, on purpose
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        self.state.epoch = self.sampler.epochs_done
        if args.sync_ref_model and self.reference is not None and self.state.global_step % args.ref_model_sync_steps == 0:
            mix_into_reference(self.reference, self.unwrapped_model, args.ref_model_mixup_alpha)
        metrics = {"loss": loss_total, "learning_rate": learning_rate, "grad_norm": float(grad_norm),
                   "nonfinite_steps": self.state.nonfinite_steps,
                   **{key: sum(s[key] for s in stats) / len(stats) for key in stats[0]}}  # fmt: skip
        # One all-reduce for all metrics. Every process has the same keys (sorted, so in the same order): a NaN is
        # kept through the reduction (the window drops it after), never dropped on one process only.
        names = sorted(metrics)
        means = acc.reduce(torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64, device=acc.device),
                           "mean")  # fmt: skip
        self.window.add(dict(zip(names, means.tolist())))

    def train(self, resume_from_checkpoint: bool | str | None = None):
        from tqdm.auto import tqdm

        args, acc = self.args, self.accelerator
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        if resume in ("true", "True"):
            resume = True
        if resume:
            self._resume(resume)
        sink = MetricSink(args.output_dir, args.report_to, args.run_name, args.logging_dir, args.to_dict(),
                          enabled=acc.is_main_process)  # fmt: skip
        sink.truncate_after(self.state.global_step)
        if acc.is_main_process:
            args.save(Path(args.output_dir) / "grpo_config.json")
        logging_steps = _as_steps(args.logging_steps, self.state.max_steps)
        save_steps = _as_steps(args.save_steps, self.state.max_steps)
        eval_steps = _as_steps(args.eval_steps or args.logging_steps, self.state.max_steps)
        bar = tqdm(total=self.state.max_steps, initial=self.state.global_step, desc="GRPO",
                   disable=args.disable_tqdm or not acc.is_main_process, dynamic_ncols=True)  # fmt: skip
        self.model.train()
        started = time.perf_counter()
        last_epoch = int(self.state.epoch)
        while self.state.global_step < self.state.max_steps:
            step_started = time.perf_counter()
            self._optimizer_step()
            self.window.add({"step_time": time.perf_counter() - step_started})
            step = self.state.global_step
            bar.update(1)
            if step % logging_steps == 0 or step == self.state.max_steps or (step == 1 and args.logging_first_step):
                record = {"step": step, "epoch": round(self.state.epoch, 4), **self.window.flush(),
                          "num_tokens": self.state.num_tokens}  # fmt: skip
                self.state.log_history.append(record)
                bar.set_postfix(reward=f"{record.get('reward', float('nan')):.3f}")
                sink.write(record)
                self._check_guard()
                if args.log_completions:
                    self._write_completions(step, sink)
            if args.eval_strategy == "steps" and step % eval_steps == 0:  # before saving: the checkpoint holds it
                self._log_evaluation(step, sink)
            epoch_ended = int(self.state.epoch) > last_epoch
            last_epoch = int(self.state.epoch)
            if (args.save_strategy == "steps" and step % save_steps == 0) or (args.save_strategy == "epoch" and epoch_ended):
                self._save_checkpoint()
        bar.close()
        sink.close()
        self.train_runtime = time.perf_counter() - started
        return self.state

    def _write_completions(self, step: int, sink: MetricSink) -> None:
        """The last generation's first completions with their rewards (completions.jsonl, console, trackers)."""
        if self.accelerator.is_main_process and getattr(self, "_samples", None):
            sink.write_completions(step, self._samples)

    # ------------------------------------------------------------------------------------------ evaluation

    def _score(self, rows, completions, completion_lists):
        """(prompts, scores [N, F], failures, step rewards, step ends) of the completions of rows, with the
        reward routing and process-reward handling of training (evaluation scores through this)."""
        args = self.args
        columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt",)}
        prompts = [r.get("prompt", r.get("prompt_ids")) for r in rows]
        names = [f.name for f in self.reward_functions]
        routes = (routes_from_column(columns[args.reward_routing_column], names, args.reward_routing_column)
                  if args.reward_routing_column in columns else None)  # fmt: skip
        step_ends = ([step_token_ends(ids, self.processing_class, args.step_separator) for ids in completion_lists]
                     if self._process_indices else [[] for _ in rows])  # fmt: skip
        scores, failures, step_rewards = compute_rewards(
            self.reward_functions, prompts, completions, completion_lists, columns, on_error=args.reward_fn_errors,
            routes=routes, step_counts=[len(e) for e in step_ends],
        )  # fmt: skip
        return prompts, scores, failures, step_rewards, step_ends

    def evaluate(self, eval_dataset=None) -> dict[str, float]:
        """The `eval/...` metrics (grpokit.evaluation) of num_generations_eval completions per prompt of
        eval_dataset (default: the trainer's). Sampling uses the training settings and a fixed seed, so the same
        weights always give the same completions; they are kept, with their rewards, in `self.eval_samples`."""
        from accelerate.utils import gather_object

        args, acc = self.args, self.accelerator
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("No eval_dataset: pass one to GRPOTrainer(eval_dataset=...) or to evaluate().")
        n = args.num_generations_eval
        names = [f.name for f in self.reward_functions]
        indices = list(range(acc.process_index, len(dataset), acc.num_processes))
        prompts_per_batch = max(1, args.per_device_eval_batch_size // n)
        generator = torch.Generator(device=acc.device).manual_seed(args.seed + 1_000_000_007 * (1 + acc.process_index))
        records, batches = [], math.ceil(len(indices) / prompts_per_batch)
        if self._all_done is not None:  # sharded: every process samples as many batches as the busiest one
            batches = math.ceil(math.ceil(len(dataset) / acc.num_processes) / prompts_per_batch)
        for start in range(0, batches * prompts_per_batch, prompts_per_batch):
            chunk = indices[start : start + prompts_per_batch]
            # A process with no prompts left samples a discarded one, in step with the others.
            rows = [dataset[i] for i in (chunk or [0]) for _ in range(n)]
            prompt_ids, prompt_mask = (t.to(acc.device) for t in self._prompt_tensors(rows))
            with acc.autocast():  # generate() puts the model in eval mode and back
                rollout = generate(self.unwrapped_model, prompt_ids, prompt_mask, self._sampling_params(),
                                   generator=generator, num_generations=n, all_done=self._all_done)  # fmt: skip
            if not chunk:
                continue
            completions, completion_lists = self._completions_as_given(rows, rollout.completion_ids,
                                                                       rollout.completion_mask)  # fmt: skip
            prompts, scores, *_ = self._score(rows, completions, completion_lists)
            records += group_records(prompts, completions, scores, self._outcome_rewards(scores),
                                     rollout.completion_lengths, rollout.is_truncated, names, n)  # fmt: skip
        self.eval_samples = gather_object(records) if acc.num_processes > 1 else records
        return evaluation_metrics(self.eval_samples, names, args.pass_threshold)

    def _log_evaluation(self, step: int, sink: MetricSink) -> None:
        record = {"step": step, "epoch": round(self.state.epoch, 4), **self.evaluate()}
        self.state.log_history.append(record)
        sink.write(record, console=False)
        if self.accelerator.is_main_process:
            shown = " ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in record.items()
                             if k == "eval/reward" or "/pass@" in k)  # fmt: skip
            print(f"[step {step}] eval: {shown}", file=sys.stderr, flush=True)
        self._check_guard()

    def _check_guard(self) -> None:
        """Warn, once per guard_window logging steps, when the reward rises while guard_metric falls."""
        args = self.args
        if args.guard_metric is None or not self.accelerator.is_main_process:  # one warning is enough
            return
        step, message = guard_message(self.state.log_history, args.guard_metric, args.guard_window)
        if message and getattr(self, "_guard_warned_step", None) != step:
            self._guard_warned_step = step
            warnings.warn(message, RuntimeWarning, stacklevel=2)


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


def _as_steps(value: float, max_steps: int) -> int:
    """TrainingArguments allow a fraction of the run for logging/saving intervals."""
    return max(1, math.ceil(value * max_steps)) if 0 < value < 1 else max(1, int(value))
