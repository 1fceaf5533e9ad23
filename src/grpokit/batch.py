"""What flows from sampling to the loss: a process's scored rollout (before advantages), and the typed train batch
that the loss consumes.

Shapes: N rows (completions) of this process, P prompt tokens (left-padded), T completion tokens (right-padded).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .multimodal import MultimodalInputs
from .rollout import Rollout
from .sampling_mask import SamplingMask


@dataclass
class ScoredRollout:
    """One process's sampled and scored rows before advantages: what dynamic sampling filters and joins."""

    rows: list[dict]  # [N] the dataset rows
    prompts: list[Any]  # [N] as reward functions receive them
    completions: list[Any]  # [N] as reward functions receive them (text, messages or ids)
    completion_ids: list[list[int]]  # [N] real completion tokens
    rollout: Rollout
    scores: torch.Tensor  # [N, F] one column per reward function, NaN = None
    failures: dict[str, int]  # reward function name -> rows whose call raised (reward_fn_errors='none')
    step_rewards: dict[int, list[list[float]]]  # process reward function index -> per row, one reward per step
    step_ends: list[list[int]]  # [N] token position where each step ends
    offset: int  # first row's index in the global generation batch
    model_lengths: torch.Tensor  # [N] the tokens the model wrote (`rollout.runner.DecodedRollout.model_lengths`)

    def select(self, indices: list[int]) -> ScoredRollout:
        pick = lambda values: [values[i] for i in indices]  # noqa: E731
        index = torch.as_tensor(indices, dtype=torch.long)
        return ScoredRollout(
            pick(self.rows),
            pick(self.prompts),
            pick(self.completions),
            pick(self.completion_ids),
            self.rollout.select(indices),
            self.scores[indices],
            dict(self.failures),
            {k: pick(v) for k, v in self.step_rewards.items()},
            pick(self.step_ends),
            self.offset,
            self.model_lengths[index.to(self.model_lengths.device)],
        )

    @staticmethod
    def concat(parts: list[ScoredRollout]) -> ScoredRollout:
        failures: dict[str, int] = {}
        for p in parts:
            for k, v in p.failures.items():
                failures[k] = failures.get(k, 0) + v
        join = lambda name: [x for p in parts for x in getattr(p, name)]  # noqa: E731
        return ScoredRollout(
            join("rows"),
            join("prompts"),
            join("completions"),
            join("completion_ids"),
            Rollout.concat([p.rollout for p in parts]),
            torch.cat([p.scores for p in parts]),
            failures,
            {k: [x for p in parts for x in p.step_rewards[k]] for k in parts[0].step_rewards},
            join("step_ends"),
            parts[0].offset,
            torch.cat([p.model_lengths for p in parts]),
        )


@dataclass
class TrainBatch:
    """The rows the loss is computed on: a whole generation batch, or a micro-batch of it (`split`).

    π_old (`old_logprobs`) is present when some optimizer step trains on these rows after the policy has moved
    (μ > 1, or a generation batch spread over several optimizer steps); otherwise the ratio is exp(logp -
    logp.detach()), and always with vLLM's correction. π_ref (`ref_logprobs`) is present when beta > 0.
    """

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, T] right-padded
    attention_mask: torch.Tensor  # [N, T] every real completion token
    loss_mask: torch.Tensor  # [N, T] the tokens trained on (sampled by the policy, not masked out)
    lengths: torch.Tensor  # [N] real completion tokens
    advantages: torch.Tensor  # [N, T] per token (a completion's advantage repeated, plus process advantages)
    old_logprobs: torch.Tensor | None = None  # [N, T] π_old
    ref_logprobs: torch.Tensor | None = None  # [N, T] π_ref
    sampling_logprobs: torch.Tensor | None = None  # [N, T] the behaviour policy's, as the engine reported them
    multimodal: MultimodalInputs | None = None  # the prompts' images as the model takes them (index: [N])
    # [N, T] or [N, 1] the correction π_old / π_sampler for an engine that samples from other kernels (vLLM:
    # `loss.sampling_correction`), None when not asked for
    sampling_ratio: torch.Tensor | None = None
    # The sampler's kept sets (kept_ids [N, T, K]): π_θ and π_old are renormalised over them (keep_sampling_mask);
    # None where the sampling log-probs are the policy's full-vocabulary ones.
    sampling_mask: SamplingMask | None = None
    # [N] bool: rows sampled with the weights the training forward runs with, whose π_old is that forward's own; the
    # micro-batch loss measures their sampling log-prob gap on it (grpokit.served). None: nothing to measure there
    served_rows: torch.Tensor | None = None
    # [N] int64: which of the engine's samplers drew each row (`Rollout.sampler`); None: the engine samples as one
    sampler: torch.Tensor | None = None

    @classmethod
    def from_rollout(
        cls, rollout: Rollout, advantages: torch.Tensor, loss_mask: torch.Tensor | None = None
    ) -> TrainBatch:
        """The batch of a rollout's rows: `advantages` [N] (a completion's, repeated over its tokens) or [N, ≥T] (per
        token); `loss_mask` replaces the rollout's (mask_truncated_completions)."""
        return cls(
            rollout.prompt_ids,
            rollout.prompt_mask,
            rollout.completion_ids,
            rollout.attention_mask,
            rollout.loss_mask if loss_mask is None else loss_mask,
            rollout.lengths,
            per_token(advantages, rollout.completion_ids),
            sampling_logprobs=rollout.sampling_logprobs,
            multimodal=rollout.multimodal,
            sampling_mask=rollout.sampling_mask,
            sampler=rollout.sampler,
        )

    @classmethod
    def from_trl_inputs(cls, inputs: dict, with_advantages: bool = True) -> TrainBatch:
        """The batch of TRL's layout (a dict as TRL's `_generate_and_score_completions` returns it: prompt_ids,
        prompt_mask, completion_ids, completion_mask, advantages [N] or [N, T], and where present
        old_per_token_logps, ref_per_token_logps, sampling_per_token_logps, importance_sampling_ratio, tool_mask).
        TRL's completion_mask is both the attention and the loss mask; its tool_mask takes tool tokens out of the
        loss only. with_advantages=False: a distillation batch, which has none (they are zero)."""
        required = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        missing = [
            key for key in (*required, "advantages") if key not in inputs and (with_advantages or key in required)
        ]
        if missing:
            layout = ", ".join(required + (("advantages", "...") if with_advantages else ()))
            raise ValueError(
                f"compute_loss was given a dict without {missing}: pass a TrainBatch, or a dict in TRL's "
                f"layout ({layout})."
            )
        if any(key in inputs for key in ("pixel_values", "image_grid_thw", "num_images")):
            raise ValueError(
                "compute_loss with TRL's dict of a vision-language batch is not supported: pass the "
                "TrainBatch the loop makes (its images are encoded once per group)."
            )
        completion_ids, attention_mask = inputs["completion_ids"], inputs["completion_mask"]
        loss_mask = attention_mask * inputs["tool_mask"] if "tool_mask" in inputs else attention_mask
        present = attention_mask.bool()
        # the last real token's position + 1 (TRL's mask covers the completion up to its EOS)
        lengths = torch.where(present.any(1), present.shape[1] - present.flip(1).int().argmax(1), 0)
        return cls(
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            completion_ids,
            attention_mask,
            loss_mask,
            lengths,
            per_token(
                inputs["advantages"]
                if with_advantages
                else completion_ids.new_zeros(len(completion_ids), dtype=torch.float32),
                completion_ids,
            ),
            inputs.get("old_per_token_logps"),
            inputs.get("ref_per_token_logps"),
            inputs.get("sampling_per_token_logps"),
            sampling_ratio=inputs.get("importance_sampling_ratio"),
        )

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def _map(self, fn, multimodal_fn=lambda m: m) -> TrainBatch:
        """fn applied to every tensor field (the sampling mask's kept ids included), multimodal_fn to the images
        (selected by row, not sliced by column)."""
        return TrainBatch(
            **{
                f.name: None
                if (value := getattr(self, f.name)) is None
                else multimodal_fn(value)
                if f.name == "multimodal"
                else value.map(fn)
                if f.name == "sampling_mask"
                else fn(value)
                for f in dataclasses.fields(self)
            }
        )

    def select(self, index: torch.Tensor | slice) -> TrainBatch:
        """Rows `index` (a permutation, a slice)."""
        return self._map(
            lambda t: t[index.to(t.device) if torch.is_tensor(index) else index], lambda m: m.select(index)
        )

    def split(self, size: int) -> list[TrainBatch]:
        """Consecutive micro-batches of `size` rows (the last may be smaller)."""
        return [self.select(slice(start, start + size)) for start in range(0, len(self), size)]

    def to(self, device) -> TrainBatch:
        return self._map(lambda t: t.to(device), lambda m: m.to(device))

    def trimmed(self) -> TrainBatch:
        """Without the completion columns past the longest real completion (padding shared by every row)."""
        width = int(self.lengths.max().clamp(min=1)) if len(self) else 1
        return self._map(
            lambda t: t[:, :width] if t.dim() >= 2 and t is not self.prompt_ids and t is not self.prompt_mask else t
        )

    @property
    def input_ids(self) -> torch.Tensor:  # [N, P + T]
        return torch.cat([self.prompt_ids, self.completion_ids], 1)

    @property
    def input_mask(self) -> torch.Tensor:  # [N, P + T]
        return torch.cat([self.prompt_mask, self.attention_mask], 1)

    def state_dict(self) -> dict:
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.multimodal is not None:
            state["multimodal"] = self.multimodal.state_dict()
        if self.sampling_mask is not None:
            state["sampling_mask"] = self.sampling_mask.state_dict()
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> TrainBatch:
        state = dict(state)
        if state.get("multimodal") is not None:
            state["multimodal"] = MultimodalInputs.from_state_dict(state["multimodal"])
        if state.get("sampling_mask") is not None:
            state["sampling_mask"] = SamplingMask(**state["sampling_mask"])
        return cls(**state)


def trl_loss_counts(
    batch: TrainBatch, num_items_in_batch, accumulation: int, steps_per_generation: int, num_processes: int
) -> tuple[float, float, int]:
    """(sequences, tokens, micro-batches) of the window that give grpokit's loss of `batch`, a micro-batch in TRL's
    layout, TRL's value: TRL divides a micro-batch's loss by `accumulation` (its gradient accumulation steps; 1 in
    evaluation) and, for the token-summed losses (dapo, cispo), the tokens by the generation batch's
    (`num_items_in_batch`, all processes) / num_processes × accumulation / steps_per_generation (1 in evaluation)."""
    if num_items_in_batch is None:
        tokens = batch.loss_mask.sum().item() * accumulation
    else:
        tokens = max(float(num_items_in_batch), 1.0) / num_processes * accumulation / steps_per_generation
    return len(batch) * accumulation, tokens, accumulation


def trl_micro_batch(inputs: dict, args, training: bool, num_processes: int) -> tuple[TrainBatch, tuple]:
    """(batch, counts): a micro-batch in TRL's layout (`TrainBatch.from_trl_inputs`) and the counts that give its
    loss TRL's value (`trl_loss_counts`), in TRL's mode: accumulated over args' gradient_accumulation_steps and
    steps_per_generation in `training`, not at all in evaluation."""
    batch = TrainBatch.from_trl_inputs(inputs)
    accumulation, steps = (args.gradient_accumulation_steps, args.steps_per_generation) if training else (1, 1)
    return batch, trl_loss_counts(batch, inputs.get("num_items_in_batch"), accumulation, steps, num_processes)


def per_token(advantages: torch.Tensor, completion_ids: torch.Tensor) -> torch.Tensor:
    """[N, T] advantages for completions [N, T]: a completion's advantage [N] repeated over its tokens, or per-token
    advantages [N, >= T] cut to T; on the completions' device."""
    width = completion_ids.shape[1]
    token_advantages = advantages[:, :width] if advantages.dim() == 2 else advantages[:, None].expand(-1, width)
    return token_advantages.to(completion_ids.device).contiguous()
