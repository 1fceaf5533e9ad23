"""Group-relative advantages, as pure functions of rewards.

Completions come in groups of G = `num_generations` consecutive rows (all the samples of one prompt). A reward of
None (NaN in a tensor) means "this reward does not apply to this completion": it takes no part in its group's
baseline and standard deviation, nor in any batch statistic, and the completion's advantage is 0 (no
policy-gradient signal either way).

Worked example (G = 4, scale_rewards="group"):
    rewards = [1, 0, 0, 1]  -> mean 0.5, std (Bessel) 0.5774
    advantages = (r - 0.5) / (0.5774 + 1e-4) = [0.8659, -0.8659, -0.8659, 0.8659]

Estimators (`ADVANTAGE_ESTIMATORS`, one name each):
    grpo                   (r - group mean) / (group std | batch std | 1)            DeepSeekMath §4.1.2, TRL
    rloo                   r_i - mean_{j != i} r_j, then scale_rewards               Ahmadian et al. 2024, TRL RLOO
    reinforce_pp_baseline  r - group mean, then whitened over the batch              REINFORCE++ (Hu et al. 2025)

Several reward functions (`combine_and_normalize`): "sum_then_normalize" weights and sums the functions' scores,
then applies the estimator; "normalize_then_sum" (GDPO) z-scores each function inside its group, weights and sums,
then whitens over the batch (TRL 1.16).

A KL penalty in the reward (TRL RLOOTrainer's, `kl_in_reward`): before the estimator, a completion's reward is
clipped to `reward_clip_range` and loses beta times its sequence KL, `sequence_kl` = sum_t (log π_old - log π_ref),
the first-order (k1) estimate (Ahmadian et al. 2024, §3; `shape_rewards`).

Process rewards compose by addition: the estimator gives each completion's outcome advantage [N] from the outcome
reward functions only (process functions' columns left out, or weighted 0); `process_advantages` normalises the
step rewards of each process function inside the group (DeepSeekMath §4.1.3) whatever the estimator, and the token
advantage is outcome[:, None] + sum_k weight_k · process_k [N, T].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def _check_flat(rewards: torch.Tensor, num_generations: int, name: str) -> None:
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"{name}: expected a flat list of rewards whose length ({rewards.numel()}) is a multiple of "
            f"num_generations ({num_generations})."
        )


def rloo_advantages(rewards, num_generations: int, scale_rewards="none") -> torch.Tensor:
    """REINFORCE leave-one-out advantages [N] (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740), as TRL
    1.16's RLOOTrainer computes them:

        A_i = r_i - (sum_{j valid} r_j - r_i) / (n_valid - 1)     over the valid (non-None) rewards of i's group

    then, by `scale_rewards`:
        "none"  : nothing more — TRL RLOOTrainer's default (normalize_advantages=False), verl and OpenRLHF `rloo`
        "batch" : (A - batch mean of A) / (batch std of A + 1e-4) — TRL RLOOTrainer's normalize_advantages=True
                  (the centring is a no-op: leave-one-out advantages sum to 0 in every group)
        "group" : A / (group std of r + 1e-4), grpokit's extension, so that rloo composes with GRPO's default;
                  then A = n/(n-1) times GRPO's advantage, n the group's valid count
    A group with one valid reward gives it 0 (no sibling to compare with), like a missing reward.

    Example (G = 3, "none"): [1, 0, 0] -> [1 - 0, 0 - 0.5, 0 - 0.5] = [1, -0.5, -0.5].
    """
    rewards = as_reward_tensor(rewards)
    _check_flat(rewards, num_generations, "rloo_advantages")
    scale_rewards = normalize_scale_rewards(scale_rewards)
    grouped = rewards.view(-1, num_generations)
    count = (~grouped.isnan()).sum(-1, keepdim=True)
    total = grouped.nansum(-1, keepdim=True)
    # (count - 1) = 0 gives 0/0 = NaN for a lone valid reward: zeroed below with the missing ones.
    advantages = (grouped - (total - grouped) / (count - 1)).view(-1)
    if scale_rewards == "group":
        advantages = advantages / (group_stats(rewards, num_generations)[1].repeat_interleave(num_generations) + EPS)
    elif scale_rewards == "batch":
        advantages = (advantages - advantages.nanmean()) / (_nan_std(advantages) + EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def reinforce_pp_baseline_advantages(
    rewards, num_generations: int, scale_rewards="batch", token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++-baseline advantages [N] (Hu et al. 2025, arXiv 2501.03262, §3; OpenRLHF's
    `advantage_estimator="reinforce_baseline"`): subtract the group mean, then whiten over the whole batch:

        c_i = r_i - mean of the valid rewards of i's group
        A_i = (c_i - μ) / sqrt(max(σ², 1e-8)),   μ = sum_i w_i c_i / sum_i w_i,   σ² = sum_i w_i (c_i - μ)² / sum_i w_i

    with w_i = token_counts[i] (OpenRLHF whitens over every completion token, so a completion weighs its length)
    or 1 when token_counts is None, and w = 0 for missing rewards. σ² is the population variance and 1e-8 its
    floor, as in OpenRLHF (verl's variant uses the Bessel correction). scale_rewards: "batch" (the method) or
    "none" (only centre on μ: OpenRLHF's no_advantage_std_norm); "group" is an error — the batch is the point.

    Example (G = 2, w = 1): [1, 0, 3, 3] -> c = [0.5, -0.5, 0, 0], μ = 0, σ² = 0.125 -> [1.4142, -1.4142, 0, 0].
    """
    rewards = as_reward_tensor(rewards)
    _check_flat(rewards, num_generations, "reinforce_pp_baseline_advantages")
    scale_rewards = normalize_scale_rewards(scale_rewards)
    if scale_rewards == "group":
        raise ValueError(
            "reinforce_pp_baseline normalises over the batch (REINFORCE++): use scale_rewards='batch', or 'none' to "
            "only centre the advantages."
        )
    mean, _ = group_stats(rewards, num_generations)
    centred = rewards - mean.to(rewards.dtype).repeat_interleave(num_generations)
    valid = ~centred.isnan()
    weights = torch.ones_like(rewards) if token_counts is None else torch.as_tensor(token_counts).to(rewards.dtype)
    weights = torch.where(valid, weights, torch.zeros_like(weights))
    values = torch.nan_to_num(centred, nan=0.0)
    batch_mean = (weights * values).sum() / weights.sum()
    advantages = centred - batch_mean
    if scale_rewards == "batch":
        variance = (weights * (values - batch_mean) ** 2).sum() / weights.sum()
        advantages = advantages * variance.clamp(min=1e-8).rsqrt()
    return torch.nan_to_num(advantages, nan=0.0)


# name -> (rewards [N], num_generations, scale_rewards) -> advantages [N]
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": group_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}
# The scale_rewards values each estimator accepts (for config validation).
ESTIMATOR_SCALE_REWARDS = {"grpo": SCALE_REWARDS, "rloo": SCALE_REWARDS, "reinforce_pp_baseline": ("batch", "none")}
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def sequence_kl(old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's KL to the reference [N], as TRL's RLOOTrainer puts it in the reward: the k1 estimate
    (the log-ratio of the sampled tokens, which may be negative) summed over the completion's tokens,

        KL_i = sum_t m_t · (log π_old(y_t) - log π_ref(y_t))

    old_logprobs, ref_logprobs, mask: [N, T], the log-probs under the policy that sampled (π_old) and the
    reference. Example: old = [[-1, -2]], ref = [[-1.5, -1]], mask = [[1, 1]] -> [0.5 - 1] = [-0.5].
    """
    # where(), not a product: padded positions may hold -inf log-probs, and 0 · inf is NaN
    per_token = torch.where(mask != 0, old_logprobs - ref_logprobs, torch.zeros_like(old_logprobs))
    return per_token.sum(-1)


def shape_rewards(
    rewards: torch.Tensor, *, reward_clip_range: Sequence[float] | None = None, kl_penalty: torch.Tensor | None = None
) -> torch.Tensor:
    """Rewards [N] as TRL's RLOOTrainer feeds them to the estimator: clipped to `reward_clip_range` (lo, hi), then
    minus `kl_penalty` [N] (beta · `sequence_kl`). The clip comes first, so the penalty is never clipped; a missing
    reward (NaN) stays missing.

    Example: rewards [3, -1, NaN], clip (-0.5, 2), kl_penalty [0.1, -0.2, 0.3] -> [1.9, -0.3, NaN].
    """
    if reward_clip_range:  # TRL tests the range's truth: None or an empty range is no clipping
        rewards = rewards.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    if kl_penalty is not None:
        rewards = rewards - kl_penalty.to(rewards.dtype)
    return rewards


def weighted_reward_sum(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over functions [N, F] -> [N], skipping None (NaN); NaN only where every function is None."""
    weighted = (scores * weights[None]).nansum(-1)
    return torch.where(scores.isnan().all(-1), torch.full_like(weighted, float("nan")), weighted)


def normalize_then_sum(scores: torch.Tensor, weights: torch.Tensor, num_generations: int) -> torch.Tensor:
    """GDPO's decoupled normalisation (arXiv 2601.05242; TRL 1.16 `multi_objective_aggregation=
    "normalize_then_sum"`), advantages [N] from scores [N, F]:

        z_i,f = (s_i,f - group mean_f) / (group std_f + 1e-4)      each function inside each group (Bessel std)
        R_i   = sum_f w_f · z_i,f                                  (None scores skipped; NaN where all are None)
        A_i   = (R_i - batch mean R) / (batch std R + 1e-4)        then a batch normalisation, as TRL does

    A function with a single valid score in a group contributes 0 there. Missing rows get 0.
    """
    grouped = scores.view(-1, num_generations, scores.shape[-1])
    mean = grouped.nanmean(1, keepdim=True)
    std = _nan_std(grouped, dim=1)[:, None, :]
    normalised = ((grouped - mean) / (std + EPS)).view_as(scores)
    rewards = weighted_reward_sum(normalised, weights)
    advantages = (rewards - rewards.nanmean()) / (_nan_std(rewards) + EPS)
    return torch.nan_to_num(advantages, nan=0.0)


def combine_and_normalize(
    scores: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    num_generations: int,
    *,
    estimator: str = "grpo",
    scale_rewards="group",
    multi_objective_aggregation: str = "sum_then_normalize",
    token_counts: torch.Tensor | None = None,
    reward_clip_range: Sequence[float] | None = None,
    kl_penalty: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages [N] of the outcome scores [N, F] (NaN = None) of F reward functions with weights [F]; the
    trainer's one call. Pass only the outcome functions' columns (or weight the process ones 0).

    "sum_then_normalize": ADVANTAGE_ESTIMATORS[estimator](weighted_reward_sum(scores, weights), num_generations,
                          scale_rewards) — with estimator "grpo" exactly `group_advantages` of today.
    "normalize_then_sum": `normalize_then_sum` (GDPO); it defines its own normalisation, so `scale_rewards` is not
                          used (as in TRL 1.16) and the estimator must be "grpo".
    token_counts [N]: loss tokens per completion, for reinforce_pp_baseline's token-weighted whitening only.
    reward_clip_range, kl_penalty [N]: `shape_rewards` of the summed reward before the estimator (TRL RLOO).
    """
    scores = torch.as_tensor(scores)
    scores = scores.to(torch.float32) if not scores.is_floating_point() else scores
    if scores.dim() != 2 or scores.shape[0] % num_generations:
        raise ValueError(
            f"combine_and_normalize: expected scores [N, F] with N a multiple of num_generations ({num_generations}), "
            f"got shape {tuple(scores.shape)}."
        )
    weights = torch.as_tensor(weights, dtype=scores.dtype)
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"Unknown advantage estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}.")
    if token_counts is not None and estimator != "reinforce_pp_baseline":
        raise ValueError(f"token_counts weights reinforce_pp_baseline's whitening only; estimator is {estimator!r}.")
    if multi_objective_aggregation == "normalize_then_sum":
        if reward_clip_range or kl_penalty is not None:
            raise ValueError(
                "reward_clip_range and a KL penalty in the reward apply to the summed reward; "
                "multi_objective_aggregation='normalize_then_sum' has none: use 'sum_then_normalize'."
            )
        if estimator != "grpo":
            raise ValueError(
                f"multi_objective_aggregation='normalize_then_sum' (GDPO) normalises each reward inside its group "
                f"itself; it takes estimator='grpo', not {estimator!r}."
            )
        return normalize_then_sum(scores, weights, num_generations)
    if multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(
            f"Unknown multi_objective_aggregation {multi_objective_aggregation!r}; "
            f"choose one of {list(MULTI_OBJECTIVE_AGGREGATIONS)}."
        )
    rewards = shape_rewards(
        weighted_reward_sum(scores, weights), reward_clip_range=reward_clip_range, kl_penalty=kl_penalty
    )
    if estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards, num_generations, scale_rewards, token_counts=token_counts)
    return ADVANTAGE_ESTIMATORS[estimator](rewards, num_generations, scale_rewards)


def process_advantages(
    step_rewards: Sequence[Sequence[float]],
    step_ends: Sequence[Sequence[int]],
    num_generations: int,
    completion_length: int,
) -> torch.Tensor:
    """Token advantages [N, T] from step-level (process) rewards (DeepSeekMath §4.1.3).

    `step_rewards[i][j]` is the reward of step j of completion i; `step_ends[i][j]` the token position (exclusive)
    where that step ends. Inside each group the step rewards of all its completions are normalised together,
    `r~ = (r - mean) / (std + 1e-4)` (Bessel std), and a token's advantage is the sum of the normalised rewards of
    the steps that end after it: `A[i, t] = sum_j r~[i][j] for step_ends[i][j] > t` (0 after the last step).

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


def teacher_advantages(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, coef: float = 1.0
) -> torch.Tensor:
    """A teacher's per-token signal to add to the reward advantages [N, T] (issue 37): the sampled-token estimate
    of the reverse KL's negative, coef · -(log π_student - log π_teacher), and 0 where `mask` is 0.

    logprobs: [N, T] the log-probs of the sampled tokens under the policy that sampled them (π_old, or the
    sampler's own); teacher_logprobs: [N, T] the teacher's of the same tokens; mask: [N, T] (completion · tools).
    A token the teacher finds likelier than the student did gets a positive advantage. Summed over a completion it
    is the single-sample estimate of -KL(π_student ‖ π_teacher), so the policy gradient with these advantages is
    on-policy distillation's reverse-KL gradient (Agarwal et al. 2024; Thinking Machines' "On-Policy Distillation",
    2025, which uses coef = 1 and no reward). It is a constant for the loss, like every advantage: detached.
    Composes by addition: A = outcome[:, None] + process + teacher_advantages(...).

    Example: logprobs = [-1.0, -0.5], teacher = [-0.25, -2.0], mask = [1, 1], coef = 0.5:
        0.5 · [-(-1.0 + 0.25), -(-0.5 + 2.0)] = [0.375, -0.75]
    """
    signal = coef * (teacher_logprobs.detach() - logprobs.detach())
    # where(), not a product: padded positions may hold -inf log-probs, and 0 · inf is NaN
    return torch.where(mask != 0, signal, torch.zeros_like(signal))
