"""The scored rollout of one process: what dynamic sampling filters and joins before advantages are computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .rollout import Rollout


@dataclass
class ScoredRollout:
    """One process's sampled and scored rows (n of them) before advantages: what dynamic sampling filters."""

    rows: list[dict]
    prompts: list[Any]
    completions: list[Any]
    completion_lists: list[list[int]]
    prompt_ids: torch.Tensor  # [n, P] left-padded
    prompt_mask: torch.Tensor  # [n, P]
    rollout: Rollout
    scores: torch.Tensor  # [n, F]
    failures: dict[str, int]
    step_rewards: dict[int, list[list[float]]]  # process function index -> per row
    step_ends: list[list[int]]  # per row
    offset: int  # first row's index in the global batch

    def select(self, indices: list[int]) -> "ScoredRollout":
        pick = lambda values: [values[i] for i in indices]  # noqa: E731
        index = torch.tensor(indices, dtype=torch.long)
        r = self.rollout
        rollout = Rollout(r.prompt_ids[index], r.prompt_mask[index], r.completion_ids[index],
                          r.completion_mask[index], r.logprobs[index], r.is_truncated[index])  # fmt: skip
        return ScoredRollout(pick(self.rows), pick(self.prompts), pick(self.completions),
                             pick(self.completion_lists), self.prompt_ids[index], self.prompt_mask[index], rollout,
                             self.scores[index], dict(self.failures),
                             {k: pick(v) for k, v in self.step_rewards.items()}, pick(self.step_ends), self.offset)

    @staticmethod
    def concat(parts: list["ScoredRollout"]) -> "ScoredRollout":
        """Join parts, re-padding prompts on the left and completions on the right to a common width (the new
        padding is masked out everywhere, so its value does not matter)."""
        def pad(tensors, on_left: bool):
            width = max(t.shape[1] for t in tensors)
            sides = lambda t: (width - t.shape[1], 0) if on_left else (0, width - t.shape[1])  # noqa: E731
            return torch.cat([torch.nn.functional.pad(t, sides(t)) for t in tensors])

        left = lambda tensors: pad(tensors, True)  # noqa: E731
        right = lambda tensors: pad(tensors, False)  # noqa: E731
        rollout = Rollout(left([p.prompt_ids for p in parts]), left([p.prompt_mask for p in parts]),
                          right([p.rollout.completion_ids for p in parts]),
                          right([p.rollout.completion_mask for p in parts]),
                          right([p.rollout.logprobs for p in parts]),
                          torch.cat([p.rollout.is_truncated for p in parts]))  # fmt: skip
        failures: dict[str, int] = {}
        for p in parts:
            for k, v in p.failures.items():
                failures[k] = failures.get(k, 0) + v
        join = lambda name: [x for p in parts for x in getattr(p, name)]  # noqa: E731
        return ScoredRollout(join("rows"), join("prompts"), join("completions"), join("completion_lists"),
                             rollout.prompt_ids, rollout.prompt_mask, rollout,
                             torch.cat([p.scores for p in parts]), failures,
                             {k: [x for p in parts for x in p.step_rewards[k]] for k in parts[0].step_rewards},
                             join("step_ends"), parts[0].offset)  # fmt: skip
