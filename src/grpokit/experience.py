"""Experience: prompt rows → rollout (`RolloutRunner`) → scores (`RewardScorer`) → advantages → `TrainBatch` with
π_old and π_ref where the loss needs them; and evaluation, from the same parts.

`ExperienceMaker.make` returns everything one generation produced — the batch, its metrics (already reduced over
processes), the completions-log rows, the tokens it consumed and how many rollouts it drew — and writes nothing into
the trainer: the trainer decides what to record. That is what lets the maker run ahead of training (a producer) as
well as in step with it.

Batch semantics are TRL's: the processes generate `generation_batch_size` completions at a time, together (G per
prompt; a prompt's group may span processes, so advantages are computed over the whole global batch), and each
process's rows come shuffled so that each optimizer step sees a mix of groups.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .advantages import (
    combine_and_normalize,
    group_advantages,
    group_stats,
    process_advantages,
    sequence_kl,
    teacher_advantages,
)
from .batch import ScoredRollout, TrainBatch, per_token
from .config import GRPOConfig
from .cpu_memory import return_free_memory, trims_between_phases
from .data import dataset_rows, is_iterable_dataset, named_eval_datasets
from .dataloaders import evaluation_share, generation_share
from .distributed import gather_objects, is_sharded
from .evaluation import evaluation_metrics, group_records
from .logprobs import token_logprobs
from .logs import completion_metrics, generation_metrics, reduce_extremes
from .loss import logprob_gap, policy_loss, sampling_correction
from .models import reference_policy
from .multimodal import loggable_prompt
from .rewards.base import RewardFunctionError
from .rewards.scorer import RewardScorer
from .rollout import EVAL_SEED_OFFSET, DecodedRollout, RolloutRunner, group_counts, rollout_seed
from .served import check_processes, gap_totals, mean_gaps, sampler_names, skip_reason
from .signals import duplicate_ratio, sequence_keys
from .truncation_replay import needs_replay, replayed_sampling_mask

logger = logging.getLogger(__name__)


@dataclass
class Experience:
    """What one generation produced on this process."""

    batch: TrainBatch  # this process's rows, shuffled, with advantages (and π_old, π_ref where needed)
    metrics: dict[str, float]  # TRL's generation metrics and grpokit's, reduced over processes
    samples: list[dict] | None  # the completions-log rows (log_completions), else None
    num_tokens: int  # prompt + completion tokens of the whole global batch
    rollouts: int  # rollouts drawn (dynamic sampling may draw more than one); each took one rollout index


# Generation batches in a row in which every reward function raised on every row before the run stops (`make`).
FAILED_BATCHES_LIMIT = 3


def trains_on_policy(args: GRPOConfig) -> bool:
    """Whether every micro-batch is trained on before the optimizer step that follows its sampling: one pass
    (μ = 1) and each optimizer step's window holds whole generation batches. Otherwise π_old is needed."""
    return args.num_iterations == 1 and args.gradient_accumulation_steps % args.steps_per_generation == 0


@torch.no_grad()
def logprobs_in_chunks(model, batch: TrainBatch, args: GRPOConfig, autocast, replay_mask: bool = True) -> torch.Tensor:
    """Log-probs [N, T] of batch's completions under model (π_old, π_ref, or the policy in evaluation),
    per_device_train_batch_size rows at a time, under `autocast` (the accelerator's). replay_mask: renormalised over
    the batch's sampling mask where it has one (π_old, as π_θ is); False for the reference, whose KL term is the
    full vocabulary's."""
    out = []
    for part in batch.split(args.per_device_train_batch_size):
        with autocast():
            logprobs, _ = token_logprobs(
                model,
                part.input_ids,
                part.input_mask,
                part.completion_ids.shape[1],
                args.temperature,
                fp32_head=args.cast_lm_head_to_fp32,
                multimodal=part.multimodal,
                padding_free=args.padding_free,
                sampling_mask=part.sampling_mask if replay_mask else None,
            )
        out.append(logprobs.float())
    return torch.cat(out)


class ExperienceMaker:
    """Turns the next prompt rows into an `Experience`.

    policy: returns the policy that samples (unwrapped); reference: the frozen reference model, or None (LoRA: the
    policy with its adapter off; beta = 0: none needed); draw_prompts(n): the next n distinct prompt rows;
    off_policy: the batch may be trained on after the policy moved (a producer running ahead), so the behaviour
    policy's log-probs always come with it as π_old; trim_heap: on a CPU, give the heap's free pages back to the OS
    after the rollout and the no-grad forwards, for a large enough policy (`cpu_memory.trims_between_phases`; False
    for a producer whose engine samples in another process: the trim would take the allocator's locks while the
    trainer allocates, and there is no decode heap to give back)."""

    def __init__(
        self,
        args: GRPOConfig,
        accelerator,
        runner: RolloutRunner,
        scorer: RewardScorer,
        policy: Callable[[], torch.nn.Module],
        reference,
        draw_prompts: Callable[[int], list[dict]],
        off_policy: bool = False,
        teacher: torch.nn.Module | None = None,
        trim_heap: bool = True,
    ):
        self.args, self.accelerator, self.runner, self.scorer = args, accelerator, runner, scorer
        self.policy, self.reference, self.draw_prompts, self.off_policy = policy, reference, draw_prompts, off_policy
        self.teacher = teacher  # GRPOTrainer(teacher_model=...): its signal joins the advantages
        self.trim_heap = trim_heap and accelerator.device.type == "cpu" and trims_between_phases(policy())
        self.failed_batches = 0  # consecutive generation batches in which no completion was scored (all raised)
        # The version of the weights the engine was last sent (the served-policy check's message); None: the
        # trainer's step (the synchronous loop pushes the policy's current weights). A producer sets its own.
        self.weights_version: Callable[[], int | None] | None = None
        self.served_skip_said = False  # why the check does not run is logged once

    def make(self, rollout_index: int, trainer_state=None, sampled: DecodedRollout | None = None) -> Experience:
        """The experience of the generation batch whose first rollout is `rollout_index` (the rollouts it draws take
        the indices rollout_index, rollout_index + 1, ...: each seeds one rollout, `rollout_seed`). `trainer_state`
        is what reward functions receive as their `trainer_state` argument.
        `sampled`: this batch's rollouts, already run (a producer streaming groups: one process), to be scored."""
        args, acc, device = self.args, self.accelerator, self.accelerator.device
        metrics: dict[str, float] = {}
        scored = (
            self._sample_and_score(rollout_index, trainer_state)
            if sampled is None
            else self._score(sampled, 0, trainer_state)
        )
        rollouts = 1
        if self.trim_heap:  # the rollout's freed heap (cpu_memory: its holes fit no later tensor)
            return_free_memory()
        if args.dynamic_sampling:
            scored, extra_rollouts, sampling_metrics = self._fill_with_varied_groups(
                scored, rollout_index + 1, trainer_state
            )
            rollouts += extra_rollouts
            metrics.update(sampling_metrics)
        rollout, offset, n = scored.rollout, scored.offset, len(scored.rows)
        all_scores = acc.gather(scored.scores.to(device)).cpu()
        # Nothing scores them in on-policy distillation: the loss compares with a teacher, not with rewards.
        rewards = self.scorer.outcome_rewards(all_scores) if self.scorer.functions else None
        loss_mask = rollout.loss_mask
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.is_truncated)[:, None].to(loss_mask.dtype)
        # The log-probs come first: with kl_in_reward (RLOO) the advantages need the KL to the reference.
        batch = TrainBatch.from_rollout(rollout, torch.zeros(n), loss_mask)
        logprob_metrics, reward_kl = self._add_old_and_ref_logprobs(
            batch, rollout.sampling_logprobs, streamed=sampled is not None
        )
        metrics.update(logprob_metrics)
        metrics.update(self._check_served(batch, rollout.sampling_logprobs, logprob_metrics, sampled, trainer_state))
        advantages = (
            self._advantages(scored, all_scores, reward_kl) if rewards is not None else torch.zeros(len(all_scores))
        )
        batch.advantages = per_token(advantages[offset : offset + n], rollout.completion_ids)
        if self.teacher is not None:
            metrics.update(self._add_teacher_signal(batch))
        if self.trim_heap:  # and the no-grad forwards' (π_old, π_ref), before the training forward
            return_free_memory()
        generated, num_tokens = self._generation_metrics(all_scores, rewards, scored)
        if rewards is not None:
            self._check_some_reward(all_scores, generated)
        metrics.update(generated)
        metrics.update(self.scorer.logs.flush_metrics(acc))
        metrics.update(self.runner.metrics(acc))
        extra = self.scorer.logs.flush_extra()
        samples = None
        if args.log_completions:
            shown = min(args.num_completions_to_print or args.num_generations, n)
            samples = [
                {
                    **loggable_prompt(scored.prompts[i], args.log_multimodal),
                    "completion": scored.completions[i],
                    **(
                        {
                            "rewards": {
                                name: _none_if_nan(all_scores[offset + i, j].item())
                                for j, name in enumerate(self.scorer.names)
                            },
                            "reward": _none_if_nan(rewards[offset + i].item()),
                            "advantage": advantages[offset + i].float().mean().item(),
                        }
                        if rewards is not None
                        else {}
                    ),
                    **({"extra": {k: v[i] for k, v in extra.items() if i < len(v)}} if extra else {}),
                }
                for i in range(shown)
            ]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + rollout_index + rollouts))
        return Experience(batch.select(order), metrics, samples, num_tokens, rollouts)

    # ------------------------------------------------------------------------------------------ the parts

    def sample_and_score(
        self, rows: list[dict], counts: list[int], seed: int, trainer_state=None
    ) -> tuple[DecodedRollout, Any]:
        """Sample rows with the current policy's weights and score them: (the decoded rollout, scores) (evaluation)."""
        self.runner.sync_weights(self.policy())
        decoded = self.runner.run(rows, counts, seed)
        return decoded, self._scores(decoded, trainer_state)

    def _sample_and_score(self, rollout_index: int, trainer_state) -> ScoredRollout:
        """Draw this process's next rows, sample their completions and score them."""
        offset = self.accelerator.process_index * self.args.generation_batch_per_process
        return self._score(self.sample(rollout_index), offset, trainer_state)

    def sample(self, rollout_index: int) -> DecodedRollout:
        """This process's next rows (each prompt G times), sampled with the policy's current weights, from the
        seed of rollout `rollout_index`."""
        args, acc = self.args, self.accelerator
        per_process = args.generation_batch_per_process
        prompts = self.draw_prompts(args.generation_batch_size // args.num_generations)
        offset = acc.process_index * per_process
        rows = generation_share(prompts, args.num_generations, acc.process_index, per_process)
        seed = rollout_seed(args.seed, rollout_index, acc.process_index)
        self.runner.sync_weights(self.policy())
        return self.runner.run(rows, group_counts(len(rows), args.num_generations, offset), seed)

    def _scores(self, sampled: DecodedRollout, trainer_state):
        """The scorer's scores of `sampled`; then what its driver lent it (environments) goes back."""
        try:
            return self.scorer.score(sampled.rows, sampled.completions, sampled.completion_ids, trainer_state)
        finally:
            self.runner.scored(sampled)

    def _score(self, sampled: DecodedRollout, offset: int, trainer_state) -> ScoredRollout:
        scores = self._scores(sampled, trainer_state)
        return ScoredRollout(
            sampled.rows,
            scores.prompts,
            sampled.completions,
            sampled.completion_ids,
            sampled.rollout,
            scores.scores,
            scores.failures,
            scores.step_rewards,
            scores.step_ends,
            offset,
            sampled.model_lengths,
        )

    def _fill_with_varied_groups(
        self, first: ScoredRollout, rollout_index: int, trainer_state
    ) -> tuple[ScoredRollout, int, dict]:
        """DAPO's dynamic sampling: keep only groups whose rewards vary, and sample more prompts until the batch
        is full (at most max_resample_rounds more rounds; then zero-spread groups fill the rest, counted).
        Returns (the batch, the rollouts drawn beyond the first, metrics)."""
        args, size, G = self.args, len(first.rows), self.args.num_generations

        def groups(scored: ScoredRollout, varied: bool) -> list[int]:
            _, std = group_stats(self.scorer.outcome_rewards(scored.scores), G)
            return [i for g, s in enumerate(std.tolist()) if (s > 0) == varied for i in range(g * G, (g + 1) * G)]

        kept, rounds, current = [], 0, first
        while True:
            kept.append(current.select(groups(current, varied=True)))
            if sum(len(k.rows) for k in kept) >= size or rounds >= args.max_resample_rounds:
                break
            current, rounds = self._sample_and_score(rollout_index + rounds, trainer_state), rounds + 1
        filled = ScoredRollout.concat(kept)
        missing = size - len(filled.rows)
        metrics = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/filled_groups": max(missing, 0) / G}
        if missing > 0:  # out of rounds: complete the batch with the first round's zero-spread groups
            filled = ScoredRollout.concat([filled, first.select(groups(first, varied=False)[:missing])])
        return filled.select(list(range(size))), rounds, metrics

    def _advantages(
        self, scored: ScoredRollout, all_scores: torch.Tensor, reward_kl: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N_global] or [N_global, T] (with process rewards): advantages over the whole global batch.
        reward_kl [N_global]: each completion's `sequence_kl`, subtracted from its reward times beta
        (kl_in_reward), or None."""
        args, acc, scorer = self.args, self.accelerator, self.scorer
        process = scorer.process_indices
        outcome = [i for i in range(len(scorer.functions)) if i not in process]
        if outcome:  # advantages.py: the estimator and the multi-objective aggregation (docs/objectives.md)
            token_counts = None
            if args.advantage_estimator == "reinforce_pp_baseline":
                token_counts = acc.gather(scored.rollout.loss_mask.sum(-1).to(acc.device)).cpu().float()
            advantages = combine_and_normalize(
                all_scores[:, outcome],
                scorer.weights[outcome],
                args.num_generations,
                estimator=args.advantage_estimator,
                scale_rewards=args.scale_rewards,
                token_counts=token_counts,
                reward_clip_range=args.reward_clip_range,
                kl_penalty=None if reward_kl is None else args.beta * reward_kl,
                multi_objective_aggregation=args.multi_objective_aggregation,
            )
        else:  # only process rewards: the per-token advantages below are the whole signal
            advantages = torch.zeros(len(all_scores))
        if process:
            advantages = self._add_process_advantages(
                advantages, process, scored.step_rewards, scored.step_ends, scored.rollout.completion_ids.shape[1]
            )
        return advantages

    def _add_process_advantages(self, advantages, process, step_rewards, step_ends, width) -> torch.Tensor:
        """Outcome advantages [N_global] broadcast over tokens, plus each process function's weighted token
        advantages; every process gathers the step rewards of the whole batch (groups may span processes)."""

        def gather(values):
            return gather_objects(self.accelerator, values)

        ends, width = gather(step_ends), max(gather([width]))
        token_advantages = advantages[:, None].expand(-1, width).clone()
        for index in process:
            token_advantages += self.scorer.weights[index] * process_advantages(
                gather(step_rewards[index]), ends, self.args.num_generations, width
            )
        return token_advantages

    def _add_old_and_ref_logprobs(
        self, batch: TrainBatch, sampling_logprobs, streamed: bool = False
    ) -> tuple[dict[str, float], torch.Tensor | None]:
        """π_old where some optimizer step trains on the batch after the policy moved (or vLLM's correction
        needs it, or the KL in the reward), the correction itself, and π_ref when beta > 0: on the batch for the
        loss's KL term, or, with kl_in_reward, turned into each completion's `sequence_kl` (gathered over
        processes) and TRL RLOO's `kl` metric. Returns (metrics, the sequence KL [N_global] or None).

        `streamed`: rollouts streamed group by group (grpokit.streaming), whose turns were sampled by whatever
        weights the engine held at each call: π_old is the log-prob each token was sampled with, recorded at
        sampling time (the engine's, or a forward of the sampling weights in the same call: BatchingEngine), never
        a forward at assembly time, when the weights may have moved on. There is then no π_old / π_sampler
        correction to make (the ratio is 1)."""
        args, acc = self.args, self.accelerator
        # With vLLM (TRL: use_vllm and its correction) π_old is always the training forward's; the sampler's
        # log-probs only feed the correction.
        corrected = args.use_vllm and args.vllm_importance_sampling_correction and not streamed
        reward_kl = args.kl_in_reward and args.beta > 0
        metrics = {}
        if streamed and sampling_logprobs is None:
            raise RuntimeError(
                "Streamed rollouts came without their sampling log-probs (π_old): the driver "
                "returned none. Its rollouts cannot be trained asynchronously; set max_staleness=None "
                "or 0."
            )
        if args.use_vllm and not streamed and sampling_logprobs is not None:
            params = self.runner.params
            if needs_replay(batch, params):  # vLLM's log-probs are of its kept sets, which it did not return
                rows = args.per_device_train_batch_size
                batch.sampling_mask = replayed_sampling_mask(self.policy(), batch, params, rows, acc.autocast)
        if streamed:
            batch.old_logprobs = sampling_logprobs
        elif not trains_on_policy(args) or corrected or self.off_policy or reward_kl:
            # The engine's log-probs serve as π_old only where they are the training forward's (the in-process
            # engine in float32, tested to 1e-5); otherwise π_old comes from a training-style forward.
            exact = self.runner.logprobs_match_training and sampling_logprobs is not None and not corrected
            batch.old_logprobs = (
                sampling_logprobs if exact else logprobs_in_chunks(self.policy(), batch, args, acc.autocast)
            )
        if corrected:
            if sampling_logprobs is None:
                raise ValueError(
                    f"vllm_importance_sampling_correction needs the engine's sampling log-probs, and "
                    f"{type(self.runner.engine).__name__} reports none: set "
                    f"vllm_importance_sampling_correction=False."
                )
            batch.sampling_ratio, stats = sampling_correction(
                batch.old_logprobs,
                sampling_logprobs,
                batch.loss_mask,
                mode=args.vllm_importance_sampling_mode,
                clip_min=args.vllm_importance_sampling_clip_min,
                clip_max=args.vllm_importance_sampling_clip_max,
            )
            metrics = reduce_extremes(acc, stats)
        if args.beta > 0:
            with reference_policy(self.policy(), self.reference) as reference:
                # The KL to the reference stays on the full vocabulary: it regularises the policy, not the sampler,
                # and the reference never sampled from the kept sets (docs/guides/objectives.md).
                ref_logprobs = logprobs_in_chunks(reference, batch, args, acc.autocast, replay_mask=False)
            if not reward_kl:
                batch.ref_logprobs = ref_logprobs
                return metrics, None
            old_logprobs = batch.old_logprobs
            if batch.sampling_mask is not None:  # the KL to the reference is the full vocabulary's (as the loss's)
                old_logprobs = logprobs_in_chunks(self.policy(), batch, args, acc.autocast, replay_mask=False)
            kl = sequence_kl(old_logprobs, ref_logprobs, batch.loss_mask)
            # TRL RLOO's `kl`: the mean per-token log-ratio over every process's loss tokens
            totals = acc.reduce(torch.stack([kl.sum(), batch.loss_mask.sum()]).double().to(acc.device), "sum")
            metrics["kl"] = (totals[0] / totals[1].clamp(min=1.0)).item()
            return metrics, acc.gather(kl.to(acc.device)).cpu()
        return metrics, None

    def _check_served(
        self, batch: TrainBatch, sampling_logprobs, logprob_metrics: dict, sampled, trainer_state
    ) -> dict[str, float]:
        """The served-policy check (grpokit.served) of a batch sampled with the weights just pushed. Where π_old came
        from a forward of those weights, its gap to the engine's log-probs is measured and checked now (with vLLM's
        correction it is already in `logprob_metrics`); where the batch is trained before the policy moves, its rows
        are marked for the training forward to measure (`TrainBatch.served_rows`). Returns the gap metrics."""
        args, acc = self.args, self.accelerator
        driver = self.runner.driver  # a multi-turn driver's log-probs are the engine's unless it says otherwise
        engines = driver is None or getattr(driver, "logprobs_match_training", False)
        skipped = "the engine reports no log-probs" if sampling_logprobs is None else None
        kept_sets = batch.sampling_mask is not None
        skipped = skipped or skip_reason(args, self.runner.params, engines, sampled is not None, kept_sets)
        if skipped:
            if not self.served_skip_said and acc.is_main_process and args.served_logprob_tolerance is not None:
                logger.warning(f"The served-policy check does not run on these batches: {skipped} (grpokit.served).")
            self.served_skip_said = True
            return {}
        metrics = {}
        if batch.old_logprobs is not None and batch.old_logprobs is not sampling_logprobs:  # a forward's π_old
            gap = logprob_gap(batch.old_logprobs, sampling_logprobs, batch.loss_mask)  # this process's
            metrics = {k: v for k, v in logprob_metrics.items() if k.startswith("sampling/sampling_logp_difference/")}
            metrics = metrics or reduce_extremes(acc, gap)
            version = self.weights_version() if self.weights_version is not None else None
            if version is None and trainer_state is not None:
                version = trainer_state.global_step
            tolerance, engine = args.served_logprob_tolerance, self.runner.engine
            # each sampler's own gap, where the engine says which drew each row (several servers)
            count = 1 if batch.sampler is None else max(1, len(sampler_names(engine)))
            totals = gap_totals(batch.old_logprobs, sampling_logprobs, batch.loss_mask, batch.sampler, count)
            check_processes(acc, mean_gaps(totals), tolerance, engine, version, "a forward's", self.policy())
        elif trains_on_policy(args) and not self.off_policy:  # the training forward's log-probs are π_old
            batch.served_rows = torch.ones(len(batch), dtype=torch.bool, device=batch.loss_mask.device)
        return metrics

    def _add_teacher_signal(self, batch: TrainBatch) -> dict[str, float]:
        """A teacher's per-token signal teacher_kl_coef · -(log π_student - log π_teacher) added to the batch's
        advantages (`advantages.teacher_advantages`): the sampled-token estimate of on-policy distillation's reverse
        KL, for tasks with both a verifier and a teacher. The student's log-probs are the sampler's where exact,
        else π_old, else a forward of the policy. Returns `teacher/reverse_kl`, its token mean over processes."""
        args, acc = self.args, self.accelerator
        if self.runner.logprobs_match_training and batch.sampling_logprobs is not None:
            student = batch.sampling_logprobs
        elif batch.old_logprobs is not None:
            student = batch.old_logprobs
        else:
            student = logprobs_in_chunks(self.policy(), batch, args, acc.autocast)
        teacher = logprobs_in_chunks(self.teacher, batch, args, acc.autocast, replay_mask=False)
        signal = teacher_advantages(student, teacher, batch.loss_mask, args.teacher_kl_coef)
        batch.advantages = batch.advantages + signal
        mask = batch.loss_mask != 0
        totals = torch.stack([((student - teacher) * mask).sum(), mask.sum()]).to(torch.float64).to(acc.device)
        totals = acc.reduce(totals, "sum")
        return {"teacher/reverse_kl": (totals[0] / totals[1].clamp(min=1)).item()}

    def _check_some_reward(self, all_scores: torch.Tensor, metrics: dict[str, float]) -> None:
        """With reward_fn_errors='none' a reward function that raises on every row gives every completion None: no
        advantage, no gradient, a run that trains on nothing. Stop after FAILED_BATCHES_LIMIT such batches in a
        row (a batch in which functions merely return None for every row only warns, as in TRL)."""
        errors = {
            k.removeprefix("rewards/").removesuffix("/errors"): int(v)
            for k, v in metrics.items()
            if k.endswith("/errors") and v
        }
        self.failed_batches = self.failed_batches + 1 if errors and bool(torch.isnan(all_scores).all()) else 0
        if self.failed_batches >= FAILED_BATCHES_LIMIT:
            raise RewardFunctionError(
                f"No completion got a reward in {self.failed_batches} generation batches in a row: the reward "
                f"functions raised ({', '.join(f'{name} on {count} rows' for name, count in errors.items())} of the "
                f"last {len(all_scores)}), and reward_fn_errors='none' scores such rows None, which trains on nothing. "
                f"Set reward_fn_errors='raise' to see the first error with its row, and fix the function."
            )

    def _generation_metrics(self, scores, rewards, scored: ScoredRollout) -> tuple[dict[str, float], int]:
        """TRL's generation metrics over the global batch (rewards None: the completions' only), and its prompt +
        completion token count."""
        args, acc, rollout = self.args, self.accelerator, scored.rollout
        lengths = acc.gather(scored.model_lengths.float()).cpu()
        truncated = acc.gather(rollout.is_truncated.float()).cpu()
        tokens = acc.gather((rollout.prompt_mask.sum() + rollout.attention_mask.sum()).reshape(1)).sum().item()
        if rewards is None:
            return completion_metrics(lengths, truncated), int(tokens)
        keys = torch.tensor(sequence_keys(rollout.completion_ids, rollout.attention_mask), device=acc.device)
        # Reward errors are counted where they happen: the metric is the total over the processes.
        names, failures = self.scorer.names, scored.failures
        errors = acc.reduce(
            torch.tensor([float(failures.get(name, 0)) for name in names], device=acc.device), "sum"
        ).tolist()
        metrics = generation_metrics(
            rewards,
            scores,
            names,
            lengths,
            truncated,
            args.num_generations,
            errors={n: e for n, e in zip(names, errors) if n in failures or e},
        )
        metrics["completions/duplicate_ratio"] = duplicate_ratio(acc.gather(keys).tolist(), args.num_generations)
        return metrics, int(tokens)


class Evaluator:
    """`GRPOTrainer.evaluate`'s sampling and scoring: num_generations_eval completions per prompt with fixed seeds
    (the same weights always give the same evaluation), scored by the training scorer, with the GRPO loss of those
    completions (on-policy: the ratio is 1, so the value is the aggregate of -A, + beta·KL, as TRL computes it in
    evaluation)."""

    def __init__(self, args: GRPOConfig, accelerator, maker: ExperienceMaker):
        self.args, self.accelerator, self.maker = args, accelerator, maker

    @torch.no_grad()
    def evaluate(self, dataset, prefix: str, trainer_state=None) -> tuple[dict[str, float], list[dict]]:
        """(metrics prefixed `prefix/` and `prefix_loss`, the per-prompt records of every process)."""
        args, acc, maker = self.args, self.accelerator, self.maker
        if is_iterable_dataset(dataset):
            dataset = dataset_rows(dataset)
        n, names = args.num_generations_eval, maker.scorer.names
        indices = evaluation_share(len(dataset), acc.process_index, acc.num_processes)
        prompts_per_batch = max(1, args.per_device_eval_batch_size // n)
        batches = math.ceil(len(indices) / prompts_per_batch)
        if is_sharded(maker.policy()):  # every process samples as many batches as the busiest one
            batches = math.ceil(math.ceil(len(dataset) / acc.num_processes) / prompts_per_batch)
        records, loss_sum, loss_count = [], 0.0, 0
        for batch_index in range(batches):
            chunk = indices[batch_index * prompts_per_batch : (batch_index + 1) * prompts_per_batch]
            # A process with no prompts left samples a discarded one, in step with the others.
            rows = [dataset[i] for i in (chunk or [0]) for _ in range(n)]
            seed = rollout_seed(args.seed + EVAL_SEED_OFFSET, batch_index, acc.process_index)
            sampled, scores = maker.sample_and_score(rows, [n] * (len(rows) // n), seed, trainer_state)
            rewards = maker.scorer.outcome_rewards(scores.scores)
            loss = self._loss(sampled.rollout, group_advantages(rewards, n, args.scale_rewards))
            if not chunk:
                continue
            loss_sum, loss_count = loss_sum + loss, loss_count + 1
            records += group_records(
                scores.prompts,
                sampled.completions,
                scores.scores,
                rewards,
                sampled.rollout.lengths,
                sampled.rollout.is_truncated,
                names,
                n,
            )
        maker.scorer.logs.flush_extra()
        logged = maker.scorer.logs.flush_metrics(acc)
        totals = acc.reduce(torch.tensor([loss_sum, float(loss_count)], dtype=torch.float64, device=acc.device), "sum")
        samples = gather_objects(acc, records)
        metrics = evaluation_metrics(samples, names, args.pass_threshold, prefix=f"{prefix}/")
        metrics.update({f"{prefix}/{k}": v for k, v in logged.items()})
        metrics.update({f"{prefix}/{k}": v for k, v in maker.runner.metrics(acc).items()})
        metrics[f"{prefix}_loss"] = (totals[0] / totals[1].clamp(min=1)).item()
        return metrics, samples

    def evaluate_sets(self, dataset, prefix: str, trainer_state=None) -> tuple[dict[str, float], list[dict]]:
        """`evaluate` of each set of `dataset`: one, or named sets (a dict / DatasetDict) one by one, their metrics
        prefixed `<prefix>_<name>`. Returns the metrics of all and the records of the last."""
        metrics, samples = {}, []
        for name, one in named_eval_datasets(dataset).items():
            found, samples = self.evaluate(one, prefix if name is None else f"{prefix}_{name}", trainer_state)
            metrics.update(found)
        return metrics, samples

    def _loss(self, rollout, advantages: torch.Tensor) -> float:
        args, maker, autocast = self.args, self.maker, self.accelerator.autocast
        batch = TrainBatch.from_rollout(rollout, advantages)
        logprobs = logprobs_in_chunks(maker.policy(), batch, args, autocast)
        ref = full_vocabulary = None
        if args.beta > 0:
            with reference_policy(maker.policy(), maker.reference) as reference:
                ref = logprobs_in_chunks(reference, batch, args, autocast, replay_mask=False)
            if batch.sampling_mask is not None:  # the KL term's, as in training
                full_vocabulary = logprobs_in_chunks(maker.policy(), batch, args, autocast, replay_mask=False)
        loss, _ = policy_loss(
            logprobs,
            None,
            ref,
            batch.advantages,
            batch.loss_mask,
            kl_logprobs=full_vocabulary,
            **args.objective_options(),
        )
        return loss.item()


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value
