"""Group-relative advantages (`grpokit.advantages`) against hand-computed numbers.

A = (r - group mean) / (std + 1e-4), Bessel-corrected std (TRL's convention); the expected values are written
out below with plain Python arithmetic.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpokit import group_advantages, process_advantages
from grpokit.advantages import teacher_advantages

ATOL = 1e-5  # the functions work in float32
EPS = 1e-4


def close(actual, expected, atol=ATOL):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), actual
    assert torch.allclose(actual, expected, atol=atol, rtol=0), f"\nactual   {actual}\nexpected {expected}"


# ------------------------------------------------------------------------------------------ group_advantages


def test_docstring_example():
    # [1, 0, 0, 1]: mean 0.5, deviations ±0.5, Bessel var = 4·0.25 / 3 = 1/3
    std = math.sqrt(1 / 3)  # 0.57735
    a = 0.5 / (std + EPS)  # 0.86588
    out = group_advantages([1, 0, 0, 1], num_generations=4)
    close(out, [a, -a, -a, a])
    assert abs(a - 0.8659) < 1e-4
    assert out.dtype == torch.float32 and out.shape == (4,)


def test_three_distinct_values_and_a_constant_group():
    # group 0 = [1, 2, 6]: mean 3, deviations -2, -1, 3, Bessel var = (4 + 1 + 9) / 2 = 7
    # group 1 = [0.5, 0.5, 0.5]: zero spread -> 0 (no NaN)
    s = math.sqrt(7) + EPS
    out = group_advantages([1.0, 2.0, 6.0, 0.5, 0.5, 0.5], num_generations=3)
    close(out, [-2 / s, -1 / s, 3 / s, 0.0, 0.0, 0.0])


def test_groups_are_consecutive_rows():
    # G = 2 on [1, 2, 6, 0]: groups [1, 2] (mean 1.5, std sqrt(0.5)) and [6, 0] (mean 3, std sqrt(18))
    s0 = math.sqrt(0.5) + EPS
    s1 = math.sqrt(18) + EPS
    close(group_advantages([1, 2, 6, 0], num_generations=2), [-0.5 / s0, 0.5 / s0, 3 / s1, -3 / s1])


REWARDS_2G = [1.0, 2.0, 6.0, 0.0, 0.0, 3.0]  # groups of 3: means 3 and 1
CENTRED_2G = [-2.0, -1.0, 3.0, -1.0, -1.0, 2.0]


def test_scale_group():
    s0 = math.sqrt((4 + 1 + 9) / 2) + EPS  # group 0 std sqrt(7)
    s1 = math.sqrt((1 + 1 + 4) / 2) + EPS  # group 1 [0, 0, 3]: mean 1, var 3
    expected = [c / s0 for c in CENTRED_2G[:3]] + [c / s1 for c in CENTRED_2G[3:]]
    close(group_advantages(REWARDS_2G, 3, scale_rewards="group"), expected)
    close(group_advantages(REWARDS_2G, 3, scale_rewards=True), expected)
    close(group_advantages(REWARDS_2G, 3), expected)  # the default


def test_scale_batch_uses_std_of_the_whole_batch_rewards():
    # std over all six rewards [1, 2, 6, 0, 0, 3]: mean 2, deviations -1, 0, 4, -2, -2, 1 -> var 26 / 5
    # (not the std of the centred values, which would be sqrt(20/5) = 2)
    s = math.sqrt(26 / 5) + EPS
    close(group_advantages(REWARDS_2G, 3, scale_rewards="batch"), [c / s for c in CENTRED_2G])


def test_scale_none_only_centres():
    close(group_advantages(REWARDS_2G, 3, scale_rewards="none"), CENTRED_2G)
    close(group_advantages(REWARDS_2G, 3, scale_rewards=False), CENTRED_2G)


def test_invalid_scale_rewards_raises():
    with pytest.raises(ValueError, match="'grop'"):
        group_advantages(REWARDS_2G, 3, scale_rewards="grop")


def test_tensor_input_int_and_float64():
    s = math.sqrt(7) + EPS
    close(group_advantages(torch.tensor([1, 2, 6]), 3), [-2 / s, -1 / s, 3 / s])
    close(group_advantages(torch.tensor([1.0, 2.0, 6.0], dtype=torch.float64), 3), [-2 / s, -1 / s, 3 / s])


# None as a list entry, NaN in a tensor: G = 3, three groups
#   group 0 = [1, None, 3]: valid [1, 3], mean 2, Bessel std sqrt(2) -> [-1/s, 0, 1/s]
#   group 1 = [None, None, None]                                      -> zeros
#   group 2 = [4, None, None]: one valid reward                        -> zeros
MISSING_LIST = [1.0, None, 3.0, None, None, None, 4.0, None, None]


def _expected_missing_group():
    s = math.sqrt(2) + EPS
    return [-1 / s, 0.0, 1 / s, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_none_rewards_list():
    close(group_advantages(MISSING_LIST, 3), _expected_missing_group())


def test_nan_rewards_tensor():
    rewards = torch.tensor([float("nan") if r is None else r for r in MISSING_LIST])
    close(group_advantages(rewards, 3), _expected_missing_group())


def test_none_rewards_excluded_from_mean():
    # [5, None, 1, 3] (G = 4): valid [5, 1, 3], mean 3 (a None counted as 0 would give mean 2.25)
    # var = (4 + 0 + 4) / 2 = 4, std 2
    s = 2 + EPS
    close(group_advantages([5, None, 1, 3], 4), [2 / s, 0.0, -2 / s, 0.0])
    close(group_advantages([5, None, 1, 3], 4, scale_rewards="none"), [2.0, 0.0, -2.0, 0.0])


def test_none_rewards_batch_scale():
    # centred: group 0 -> [-1, 0, 1], group 2 -> [0]; batch std over the valid rewards [1, 3, 4]:
    # mean 8/3, deviations -5/3, 1/3, 4/3 -> var (25 + 1 + 16) / 9 / 2 = 7/3
    s = math.sqrt(7 / 3) + EPS
    close(group_advantages(MISSING_LIST, 3, scale_rewards="batch"), [-1 / s, 0, 1 / s, 0, 0, 0, 0, 0, 0])
    close(group_advantages(MISSING_LIST, 3, scale_rewards="none"), [-1.0, 0, 1.0, 0, 0, 0, 0, 0, 0])


def test_all_none_batch_gives_zeros():
    for scale in ("group", "batch", "none"):
        close(group_advantages([None, None, None, None], 2, scale_rewards=scale), [0.0] * 4)


def test_zero_spread_groups_give_zeros():
    for scale in ("group", "batch", "none"):
        out = group_advantages([2.0, 2.0, 2.0, 2.0, -1.0, -1.0, -1.0, -1.0], 4, scale_rewards=scale)
        close(out, [0.0] * 8)


def test_wrong_length_raises():
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages([1.0, 0.0, 1.0, 0.0, 1.0], num_generations=4)
    with pytest.raises(ValueError):
        group_advantages(torch.ones(7), num_generations=2)


# ---------------------------------------------------------------------------------------- process_advantages


def test_process_docstring_example():
    # group rewards [1, 0, 1]: mean 2/3, Bessel var (1/9 + 4/9 + 1/9) / 2 = 1/3
    s = math.sqrt(1 / 3) + EPS
    hi = (1 - 2 / 3) / s  # 0.5773
    lo = (0 - 2 / 3) / s  # -1.1546
    out = process_advantages([[1, 0], [1]], [[2, 4], [3]], num_generations=2, completion_length=5)
    close(out, [[hi + lo, hi + lo, lo, lo, 0.0], [hi, hi, hi, 0.0, 0.0]])
    assert out.shape == (2, 5) and out.dtype == torch.float32
    assert abs(hi - 0.5773) < 1e-4 and abs(lo + 1.1546) < 1e-4


def test_process_two_groups_with_clamped_step_ends():
    # G = 2, two groups, T = 4.
    # group A (completions 0, 1): rewards [[3, 0], [0]], ends [[1, 4], [6]] (6 > T: clamped to 4)
    #   pooled [3, 0, 0]: mean 1, deviations 2, -1, -1 -> var 6/2 = 3 ; k = 1 / (sqrt(3) + 1e-4)
    #   normalised [2k, -k, -k]
    #   A[0, t] = sum over steps ending after t: t=0 -> 2k - k = k ; t=1..3 -> -k
    #   A[1, t] = -k for every t < min(6, 4)
    k = 1 / (math.sqrt(3) + EPS)
    # group B (completions 2, 3): rewards [[1, 1, 4], [2, 5]], ends [[1, 2, 3], [2, 4]]
    #   pooled [1, 1, 4, 2, 5]: mean 2.6, deviations -1.6 -1.6 1.4 -0.6 2.4 -> var 13.2 / 4 = 3.3
    s = math.sqrt(3.3) + EPS
    n = {r: (r - 2.6) / s for r in (1, 2, 4, 5)}
    #   A[2]: t=0 -> all three steps ; t=1 -> steps 2, 3 ; t=2 -> step 3 ; t=3 -> none
    #   A[3]: t=0,1 -> both steps ; t=2,3 -> the step ending at 4
    expected = [
        [k, -k, -k, -k],
        [-k, -k, -k, -k],
        [n[1] + n[1] + n[4], n[1] + n[4], n[4], 0.0],
        [n[2] + n[5], n[2] + n[5], n[5], n[5]],
    ]
    out = process_advantages(
        [[3, 0], [0], [1, 1, 4], [2, 5]],
        [[1, 4], [6], [1, 2, 3], [2, 4]],
        num_generations=2,
        completion_length=4,
    )
    close(out, expected)


def test_process_step_end_exactly_at_completion_length():
    # G = 2, T = 3: rewards [[2], [0]] ends [[3], [3]] -> pooled [2, 0], mean 1, var 2 -> std sqrt(2)
    s = math.sqrt(2) + EPS
    out = process_advantages([[2], [0]], [[3], [3]], num_generations=2, completion_length=3)
    close(out, [[1 / s] * 3, [-1 / s] * 3])


def test_process_mismatched_lengths_raise():
    with pytest.raises(ValueError):  # 2 reward lists, 3 end lists
        process_advantages([[1], [0]], [[1], [2], [3]], num_generations=2, completion_length=4)
    with pytest.raises(ValueError):  # not a multiple of num_generations
        process_advantages([[1], [0], [1]], [[1], [2], [3]], num_generations=2, completion_length=4)
    with pytest.raises(ValueError, match="completion 1"):  # one completion has 2 rewards but 1 end
        process_advantages([[1], [0, 1]], [[1], [2]], num_generations=2, completion_length=4)


# ------------------------------------------------------------------------------------------ estimators (float64)

F64 = torch.float64
ATOL64 = 1e-6
NAN = float("nan")


def t64(values):
    return torch.tensor([NAN if v is None else v for v in values], dtype=F64)


def test_estimator_table():
    from grpokit.advantages import ADVANTAGE_ESTIMATORS, ESTIMATOR_SCALE_REWARDS

    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce_pp_baseline"}
    assert ADVANTAGE_ESTIMATORS["grpo"] is group_advantages
    assert set(ESTIMATOR_SCALE_REWARDS) == set(ADVANTAGE_ESTIMATORS)
    assert ESTIMATOR_SCALE_REWARDS["reinforce_pp_baseline"] == ("batch", "none")


RLOO_REWARDS = [1.0, 0.0, 0.0, 2.0, 4.0, 9.0]  # groups of 3
# leave-one-out: group 0: 1 - 0, 0 - 0.5, 0 - 0.5 ; group 1: 2 - 6.5, 4 - 5.5, 9 - 3
RLOO_RAW = [1.0, -0.5, -0.5, -4.5, -1.5, 6.0]


def test_rloo_none_is_the_leave_one_out_difference():
    from grpokit.advantages import rloo_advantages

    close(rloo_advantages(t64(RLOO_REWARDS), 3), RLOO_RAW, atol=ATOL64)
    close(rloo_advantages(t64(RLOO_REWARDS), 3, scale_rewards=False), RLOO_RAW, atol=ATOL64)
    close(rloo_advantages([1, 0, 0], 3), [1.0, -0.5, -0.5])  # the docstring example, from a list


def test_rloo_group_and_batch_scaling():
    from grpokit.advantages import rloo_advantages

    # group: divided by the group's reward std; group 0 std sqrt(1/3), group 1 [2, 4, 9]: mean 5, var (9+1+16)/2
    s0, s1 = math.sqrt(1 / 3) + EPS, math.sqrt(13) + EPS
    group = rloo_advantages(t64(RLOO_REWARDS), 3, scale_rewards="group")
    close(group, [a / s0 for a in RLOO_RAW[:3]] + [a / s1 for a in RLOO_RAW[3:]], atol=ATOL64)
    # ... which is n/(n-1) = 3/2 times GRPO's advantage
    close(group, 1.5 * group_advantages(t64(RLOO_REWARDS), 3), atol=ATOL64)
    # batch (TRL RLOOTrainer normalize_advantages): mean 0, Bessel var (1 + .25 + .25 + 20.25 + 2.25 + 36) / 5 = 12
    s = math.sqrt(12) + EPS
    close(rloo_advantages(t64(RLOO_REWARDS), 3, scale_rewards="batch"), [a / s for a in RLOO_RAW], atol=ATOL64)


def test_rloo_missing_rewards():
    from grpokit.advantages import rloo_advantages

    # group 0 valid [1, 3]: 1 - 3, -, 3 - 1 ; group 1 all missing ; group 2 a lone valid reward -> 0
    rewards = t64(MISSING_LIST)
    close(rloo_advantages(rewards, 3), [-2.0, 0, 2.0, 0, 0, 0, 0, 0, 0], atol=ATOL64)
    close(rloo_advantages(MISSING_LIST, 3), [-2.0, 0, 2.0, 0, 0, 0, 0, 0, 0])
    # batch statistics over the valid advantages only: [-2, 2] -> mean 0, std sqrt(8)
    s = math.sqrt(8) + EPS
    close(rloo_advantages(rewards, 3, scale_rewards="batch"), [-2 / s, 0, 2 / s, 0, 0, 0, 0, 0, 0], atol=ATOL64)
    # a missing reward counts in no one's baseline: [5, None, 1, 3] -> 5 - 2, 0, 1 - 4, 3 - 3
    close(rloo_advantages(t64([5.0, None, 1.0, 3.0]), 4), [3.0, 0.0, -3.0, 0.0], atol=ATOL64)


def test_reinforce_pp_baseline_per_completion():
    from grpokit.advantages import reinforce_pp_baseline_advantages as rpp

    # the docstring example: c = [0.5, -0.5, 0, 0], mean 0, population var 0.125
    close(rpp(t64([1.0, 0.0, 3.0, 3.0]), 2), [math.sqrt(2), -math.sqrt(2), 0.0, 0.0], atol=ATOL64)
    close(rpp(t64([1.0, 0.0, 3.0, 3.0]), 2, scale_rewards="none"), [0.5, -0.5, 0.0, 0.0], atol=ATOL64)
    # missing: group 0 has one valid reward (c = 0, counted), the None is out; group 1 [3, 5] -> c = -1, 1
    #   mean 0, var (0 + 1 + 1) / 3
    s = math.sqrt(2 / 3)
    close(rpp(t64([1.0, None, 3.0, 5.0]), 2), [0.0, 0.0, -1 / s, 1 / s], atol=ATOL64)
    close(rpp([None, None, None, None], 2), [0.0] * 4)
    close(rpp(t64([2.0, 2.0, -1.0, -1.0]), 2), [0.0] * 4)  # zero spread: the 1e-8 floor, no NaN


def test_reinforce_pp_baseline_token_weighted():
    from grpokit.advantages import reinforce_pp_baseline_advantages as rpp

    counts = torch.tensor([2, 1, 1, 4])
    c = [0.5, -0.5, 0.0, 0.0]
    mean = (2 * 0.5 - 0.5) / 8  # 0.0625
    var = (2 * (0.5 - mean) ** 2 + (-0.5 - mean) ** 2 + 5 * mean**2) / 8
    close(rpp(t64([1.0, 0.0, 3.0, 3.0]), 2, token_counts=counts), [(x - mean) / math.sqrt(var) for x in c], atol=ATOL64)
    close(rpp(t64([1.0, 0.0, 3.0, 3.0]), 2, "none", token_counts=counts), [x - mean for x in c], atol=ATOL64)


def test_reinforce_pp_baseline_matches_openrlhf_token_whitening():
    """Naive twin: OpenRLHF whitens the [N, T] token advantages over the action mask."""
    from grpokit.advantages import reinforce_pp_baseline_advantages as rpp

    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=gen, dtype=F64)
    lengths = torch.randint(1, 7, (12,), generator=gen)
    grouped = rewards.view(-1, 4)
    centred = (grouped - grouped.mean(-1, keepdim=True)).view(-1)
    mask = (torch.arange(6)[None] < lengths[:, None]).to(F64)
    tokens = centred[:, None] * mask
    mean = (tokens * mask).sum() / mask.sum()
    var = ((tokens - mean).pow(2) * mask).sum() / mask.sum()
    whitened = (tokens - mean) * var.clamp(min=1e-8).rsqrt()
    ours = rpp(rewards, 4, token_counts=lengths)
    close((ours[:, None] * mask), whitened * mask, atol=1e-12)


def test_reinforce_pp_baseline_rejects_group_scaling():
    from grpokit.advantages import reinforce_pp_baseline_advantages as rpp

    for scale in ("group", True):
        with pytest.raises(ValueError, match="scale_rewards='batch'"):
            rpp([1.0, 0.0], 2, scale_rewards=scale)


# ---------------------------------------------------------------------------------- combine_and_normalize

SCORES = [[1.0, 0.0], [0.0, 3.0], [1.0, None], [0.0, 2.0], [None, None], [5.0, 1.0]]  # G = 2, F = 2
WEIGHTS = [1.0, 0.5]


def scores64(rows=SCORES):
    return torch.tensor([[NAN if v is None else v for v in row] for row in rows], dtype=F64)


def test_sum_then_normalize_grpo_is_todays_computation():
    from grpokit.advantages import combine_and_normalize, weighted_reward_sum
    from grpokit.rewards.base import combine_rewards

    scores, weights = scores64(), torch.tensor(WEIGHTS, dtype=F64)
    summed = weighted_reward_sum(scores, weights)
    # the weighted sum skips None; NaN only where every function is None
    close(summed.nan_to_num(-99.0), [1.0, 1.5, 1.0, 1.0, -99.0, 5.5], atol=ATOL64)
    assert torch.equal(summed.isnan(), combine_rewards(scores, weights).isnan())
    for scale in ("group", "batch", "none"):
        expected = group_advantages(combine_rewards(scores, weights), 2, scale)
        assert torch.equal(combine_and_normalize(scores, weights, 2, scale_rewards=scale), expected)


def test_sum_then_normalize_other_estimators():
    from grpokit.advantages import (
        combine_and_normalize,
        reinforce_pp_baseline_advantages,
        rloo_advantages,
        weighted_reward_sum,
    )

    scores, weights = scores64(), torch.tensor(WEIGHTS, dtype=F64)
    summed = weighted_reward_sum(scores, weights)
    close(
        combine_and_normalize(scores, WEIGHTS, 2, estimator="rloo", scale_rewards="none"),
        rloo_advantages(summed, 2, "none"),
        atol=0,
    )
    counts = torch.tensor([3, 1, 2, 2, 5, 4])
    close(
        combine_and_normalize(
            scores, WEIGHTS, 2, estimator="reinforce_pp_baseline", scale_rewards="batch", token_counts=counts
        ),
        reinforce_pp_baseline_advantages(summed, 2, "batch", token_counts=counts),
        atol=0,
    )


def test_normalize_then_sum_by_hand():
    from grpokit.advantages import combine_and_normalize

    # group 0: column 0 [1, 0] -> ±a ; column 1 [0, 3] -> ∓b          (a = 0.5/(sqrt(.5)+eps), b = 1.5/(sqrt(4.5)+eps))
    # group 1: column 0 [1, 0] -> ±a ; column 1 [None, 2]: one valid score -> [skipped, 0]
    # group 2: row 4 has no score (advantage 0, out of the batch statistics); row 5 has one valid score per
    #          column -> z = 0, 0 -> R = 0, which does take part in the batch statistics (as in TRL)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    b = 1.5 / (math.sqrt(4.5) + EPS)
    summed = [a - 0.5 * b, -a + 0.5 * b, a, -a, None, 0.0]
    valid = [r for r in summed if r is not None]
    mean = sum(valid) / len(valid)
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / (len(valid) - 1))
    expected = [0.0 if r is None else (r - mean) / (std + EPS) for r in summed]
    for scale in ("group", "batch", "none"):  # not used here, as in TRL
        out = combine_and_normalize(
            scores64(), WEIGHTS, 2, scale_rewards=scale, multi_objective_aggregation="normalize_then_sum"
        )
        close(out, expected, atol=ATOL64)


def test_normalize_then_sum_differs_from_sum_then_normalize():
    # GDPO's point: different reward combinations with the same sum no longer share one advantage. Column 0
    # succeeds once in the group (rare), column 1 twice; the sums [1, 1, 1, 0] give rows 0-2 the same advantage,
    # the per-column z-scores [1.5, -.5, -.5, -.5] + [-.866, .866, .866, -.866] favour the rare success.
    from grpokit.advantages import combine_and_normalize

    scores = scores64([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    summed = combine_and_normalize(scores, [1.0, 1.0], 4)
    close(summed[:3], [summed[0].item()] * 3, atol=ATOL64)
    decoupled = combine_and_normalize(scores, [1.0, 1.0], 4, multi_objective_aggregation="normalize_then_sum")
    close(decoupled[1], decoupled[2], atol=ATOL64)
    assert decoupled[0] > decoupled[1] + 0.2 > 0.2 > decoupled[3]


def test_combine_and_normalize_validation():
    from grpokit.advantages import combine_and_normalize

    scores = scores64()
    with pytest.raises(ValueError, match="'ppo'"):
        combine_and_normalize(scores, WEIGHTS, 2, estimator="ppo")
    with pytest.raises(ValueError, match="estimator='grpo'"):
        combine_and_normalize(scores, WEIGHTS, 2, estimator="rloo", multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="'mean_then_sum'"):
        combine_and_normalize(scores, WEIGHTS, 2, multi_objective_aggregation="mean_then_sum")
    with pytest.raises(ValueError, match="token_counts"):
        combine_and_normalize(scores, WEIGHTS, 2, token_counts=torch.ones(6))
    with pytest.raises(ValueError, match="num_generations"):
        combine_and_normalize(scores, WEIGHTS, 4)
    with pytest.raises(ValueError, match="scale_rewards='batch'"):
        combine_and_normalize(scores, WEIGHTS, 2, estimator="reinforce_pp_baseline")  # the default "group"


# ------------------------------------------------------------------------------------ a teacher's signal


def test_teacher_advantages_worked_example():
    # The docstring's example: 0.5 · -(logp - teacher) per token
    logprobs = torch.tensor([[-1.0, -0.5]], dtype=torch.float64)
    teacher = torch.tensor([[-0.25, -2.0]], dtype=torch.float64)
    close(teacher_advantages(logprobs, teacher, torch.ones(1, 2), coef=0.5), [[0.375, -0.75]])


def test_teacher_advantages_are_zero_off_the_mask_and_carry_no_gradient():
    # N = 2, T = 3; the second row's last token is padding with -inf log-probs, the first row's middle one a tool
    # output; coef 1: -(logp - teacher) = teacher - logp
    logprobs = torch.tensor([[-0.1, -3.0, -2.0], [-1.5, -0.7, -math.inf]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[-0.6, -0.2, -1.0], [-1.5, -0.2, -math.inf]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    advantages = teacher_advantages(logprobs, teacher, mask)
    close(advantages, [[-0.5, 0.0, 1.0], [0.0, 0.5, 0.0]])
    assert not advantages.requires_grad


def test_teacher_advantages_add_to_outcome_advantages():
    # Outcome A = [1, -1] per completion plus the teacher's per-token signal with coef 2
    outcome = torch.tensor([1.0, -1.0], dtype=torch.float64)
    logprobs = torch.tensor([[-1.0, -1.0], [-2.0, -0.5]], dtype=torch.float64)
    teacher = torch.tensor([[-0.5, -1.0], [-1.0, -1.5]], dtype=torch.float64)
    total = outcome[:, None] + teacher_advantages(logprobs, teacher, torch.ones(2, 2), coef=2.0)
    close(total, [[2.0, 1.0], [1.0, -3.0]])
