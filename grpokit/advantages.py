"""Group-relative advantages, as pure functions of rewards.

Completions come in groups of G = `num_generations` consecutive rows (all the samples of one prompt). A reward of
None (NaN in a tensor) means "this reward does not apply to this completion": it takes no part in its group's
mean and standard deviation, and the completion's advantage is 0 (no policy-gradient signal either way).

Worked example (G = 4, scale_rewards="group"):
    rewards = [1, 0, 0, 1]  -> mean 0.5, std (Bessel) 0.5774
    advantages = (r - 0.5) / (0.5774 + 1e-4) = [0.8659, -0.8659, -0.8659, 0.8659]
"""

from __future__ import annotations

from typing import Sequence

import torch

EPS = 1e-4
SCALE_REWARDS = ("group", "batch", "none")


def as_reward_tensor(rewards) -> torch.Tensor:
    """A float tensor from a tensor or a list of numbers / None (None -> NaN)."""
    if isinstance(rewards, torch.Tensor):
        return rewards.to(torch.float32) if not rewards.is_floating_point() else rewards
    return torch.tensor([float("nan") if r is None else float(r) for r in rewards], dtype=torch.float32)


def normalize_scale_rewards(scale_rewards) -> str:
    """TRL also accepts booleans: True = "group", False = "none"."""
    if scale_rewards is True:
        return "group"
    if scale_rewards is False:
        return "none"
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"Unknown scale_rewards {scale_rewards!r}; choose one of {list(SCALE_REWARDS)}.")
    return scale_rewards


def _nan_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaN; 0 where fewer than two values are present."""
    valid = ~values.isnan()
    count = valid.sum(dim) if dim is not None else valid.sum()
    mean = values.nanmean(dim, keepdim=dim is not None) if dim is not None else values.nanmean()
    squared = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values))
    total = squared.sum(dim) if dim is not None else squared.sum()
    return torch.where(count > 1, total / (count - 1).clamp(min=1), torch.zeros_like(total)).sqrt()


def group_stats(rewards, num_generations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and Bessel std of the valid rewards: two tensors of shape [N / G]."""
    grouped = as_reward_tensor(rewards).view(-1, num_generations)
    mean = torch.where(grouped.isnan().all(-1), torch.zeros(grouped.shape[0]), grouped.nanmean(-1))
    return mean, _nan_std(grouped, dim=-1)


def group_advantages(rewards, num_generations: int, scale_rewards="group") -> torch.Tensor:
    """Advantages [N] of rewards [N] (tensor with NaN, or list with None) in groups of `num_generations`.

    A = (r - group mean) / (std + 1e-4), with std the group's (scale_rewards="group"), the whole batch's
    ("batch") or 1 without the epsilon ("none", Dr. GRPO). Missing rewards get advantage 0.
    """
    rewards = as_reward_tensor(rewards)
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"group_advantages: expected a flat list of rewards whose length ({rewards.numel()}) is a multiple of "
            f"num_generations ({num_generations})."
        )
    scale_rewards = normalize_scale_rewards(scale_rewards)
    mean, group_std = group_stats(rewards, num_generations)
    centred = rewards - mean.repeat_interleave(num_generations)
    if scale_rewards == "group":
        centred = centred / (group_std.repeat_interleave(num_generations) + EPS)
    elif scale_rewards == "batch":
        centred = centred / (_nan_std(rewards) + EPS)
    return torch.nan_to_num(centred, nan=0.0)


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    num_generations: int,
    completion_length: int,
) -> torch.Tensor:
    """Token advantages [N, T] from step-level (process) rewards (DeepSeekMath §4.1.3).

    step_rewards[i][j] is the reward of step j of completion i; step_ends[i][j] the token position (exclusive)
    where that step ends. Inside each group the step rewards of all its completions are normalised together,
    r~ = (r - mean) / (std + 1e-4) (Bessel std), and a token's advantage is the sum of the normalised rewards of
    the steps that end after it: A[i, t] = sum_j r~[i][j] for step_ends[i][j] > t (0 after the last step).

    Example (G = 2): step_rewards = [[1, 0], [1]], step_ends = [[2, 4], [3]], T = 5: the group's rewards are
    [1, 0, 1] (mean 2/3, std 0.5774), normalised [0.5773, -1.1546, 0.5773]; so A[0] = [-0.5773, -0.5773,
    -1.1546, -1.1546, 0] and A[1] = [0.5773, 0.5773, 0.5773, 0, 0].
    """
    if len(step_rewards) != len(step_ends) or len(step_rewards) % num_generations:
        raise ValueError(
            f"process_advantages: {len(step_rewards)} step-reward lists and {len(step_ends)} step-end lists; both "
            f"must have one entry per completion and a length that is a multiple of num_generations "
            f"({num_generations})."
        )
    advantages = torch.zeros(len(step_rewards), completion_length, dtype=torch.float32)
    for start in range(0, len(step_rewards), num_generations):
        members = range(start, start + num_generations)
        pooled = torch.tensor([float(r) for i in members for r in step_rewards[i]], dtype=torch.float32)
        if pooled.numel() == 0:
            continue
        mean = pooled.mean()
        std = pooled.std() if pooled.numel() > 1 else torch.tensor(0.0)
        for i in members:
            if len(step_rewards[i]) != len(step_ends[i]):
                raise ValueError(
                    f"process_advantages: completion {i} has {len(step_rewards[i])} step rewards but "
                    f"{len(step_ends[i])} step ends."
                )
            for reward, end in zip(step_rewards[i], step_ends[i]):
                normalised = (float(reward) - mean) / (std + EPS)
                advantages[i, : min(int(end), completion_length)] += normalised
    return advantages
