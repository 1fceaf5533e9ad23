"""The loss-type table and issue 13's objectives (`grpokit.loss`) against hand-computed numbers.

Expected values are written out from each docstring's formula with plain Python arithmetic on small tensors;
gradients are either written out the same way or, where the objective detaches something, compared with autograd
of the written-out formula. float64 throughout, 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_loss import (  # the hand batch  # shared helpers
    ADV,
    ATOL,
    F64,
    GA_ADV,
    GA_LOG_RATIO,
    GA_MASK,
    GA_OLD,
    GA_REF_D,
    LENGTHS,
    MASK,
    OLD,
    RATIOS,
    REF_MINUS_LOGP,
    close,
    t,
)

from grpokit.loss import (
    AGGREGATIONS,
    LOSS_TYPES,
    AdaptiveEntropyController,
    load_balancing_loss,
    loss_type_warnings,
    off_policy_mask,
    policy_loss,
    update_entropy_coef,
    vespo_weights,
)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def k3(d):
    return math.exp(d) - d - 1.0


# The hand batch of tests/test_loss.py: N = 3, T = 4, lengths 3, 2, 4 (9 tokens), absurd ratios on padding.
LOGP = [[o + math.log(r) for o, r in zip(orow, rrow)] for orow, rrow in zip(OLD, RATIOS)]
TOKENS = [(i, j) for i in range(3) for j in range(LENGTHS[i])]


def make_inputs():
    return t(LOGP).requires_grad_(True), t(OLD)


def grid(fn):
    """[3, 4] nested list with fn(i, j) on the masked tokens and 0 on padding."""
    return [[fn(i, j) if j < LENGTHS[i] else 0.0 for j in range(4)] for i in range(3)]


# ------------------------------------------------------------------------------------------------ the table


def test_table_is_the_set_of_valid_loss_types():
    assert set(LOSS_TYPES) == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "rloo"}
    assert AGGREGATIONS is LOSS_TYPES  # the name config validation imports
    # each entry is one choice of objective, aggregation and statistics; loss types share pieces
    assert LOSS_TYPES["cispo"].aggregation is LOSS_TYPES["dapo"].aggregation
    assert LOSS_TYPES["vespo"].aggregation is LOSS_TYPES["dapo"].aggregation
    assert LOSS_TYPES["sapo"].aggregation is LOSS_TYPES["grpo"].aggregation
    assert LOSS_TYPES["luspo"].objective is LOSS_TYPES["grpo"].objective
    assert LOSS_TYPES["rloo"].objective is LOSS_TYPES["grpo"].objective  # TRL RLOO: its ratio is a sequence sum


def test_a_new_loss_type_is_valid_in_the_config():
    from grpokit import GRPOConfig

    for loss_type in ("cispo", "sapo", "luspo", "vespo"):
        assert GRPOConfig(loss_type=loss_type).loss_type == loss_type


def test_loss_type_warnings():
    assert loss_type_warnings("luspo", "sequence") == []
    assert "'sequence'" in loss_type_warnings("luspo", "token")[0]
    assert "'token'" in loss_type_warnings("vespo", "sequence")[0]
    assert "length" in loss_type_warnings("dapo", "sequence")[0]
    assert loss_type_warnings("grpo", "sequence") == []
    assert loss_type_warnings("rloo", "sequence_sum") == []  # TRL RLOOTrainer's summed sequence ratio
    assert "'sequence_sum'" in loss_type_warnings("rloo", "token")[0]
    assert "length" in loss_type_warnings("dapo", "sequence_sum")[0]
    assert "5.0" in loss_type_warnings("cispo", "token", epsilon_high=0.2)[0]
    assert loss_type_warnings("cispo", "token", epsilon_high=5.0) == []


# -------------------------------------------------------------------------------------------------- cispo


def test_cispo_value_gradient_and_stats():
    logprobs, old = make_inputs()
    # cap 1.2: weights min(r, 1.2) = seq 0: 1.1, 1.2, 0.7 ; seq 1: 0.9, 0.75 ; seq 2: 1.2, 1.0, 0.85, 1.15
    weight = grid(lambda i, j: min(RATIOS[i][j], 1.2))
    loss, stats = policy_loss(logprobs, old, None, t(ADV), t(MASK), loss_type="cispo", epsilon_high=1.2)
    # per token -w·A·logp, summed over the 9 tokens / 9 (dapo's aggregation)
    close(loss, sum(-weight[i][j] * ADV[i] * LOGP[i][j] for i, j in TOKENS) / 9)
    loss.backward()
    # the weight is detached: every token, the capped ones included, keeps -w·A/9
    close(logprobs.grad, grid(lambda i, j: -weight[i][j] * ADV[i] / 9))
    # ratio > 1.2 with A > 0: (0, 1) r = 1.3 and (2, 0) r = 1.25 (the padded 5.0 does not count)
    assert set(stats.as_dict()) == {"cispo_clip_ratio"}
    close(stats.objective["cispo_clip_ratio"], 2 / 9)
    assert "clip_ratio/region_mean" not in stats.objective


def test_cispo_gradient_matches_autograd_of_the_written_formula():
    logprobs, old = make_inputs()
    mask = t(MASK)
    loss, _ = policy_loss(logprobs, old, None, t(ADV), mask, loss_type="cispo", epsilon_high=1.2)
    loss.backward()
    twin = t(LOGP).requires_grad_(True)
    ratio = torch.exp(twin - old)
    written = (-(torch.clamp(ratio, max=1.2).detach()) * t(ADV)[:, None] * twin * mask).sum() / mask.sum()
    written.backward()
    close(loss.detach(), written.detach())
    close(logprobs.grad, twin.grad)


def test_cispo_default_cap_is_epsilon_itself():
    # TRL 1.16: clamp(ratio, max=epsilon_high), epsilon_high defaulting to epsilon = 0.2 -- not 1.2.
    logprobs, old = make_inputs()
    loss, stats = policy_loss(logprobs, old, None, t(ADV), t(MASK), loss_type="cispo")
    loss.backward()
    close(logprobs.grad, grid(lambda i, j: -0.2 * ADV[i] / 9))
    close(stats.objective["cispo_clip_ratio"], 7 / 9)  # every token of the two A > 0 sequences


def test_cispo_on_policy_is_reinforce():
    logprobs, _ = make_inputs()
    loss, _ = policy_loss(logprobs, None, None, t(ADV), t(MASK), loss_type="cispo", epsilon_high=5.0)
    close(loss, sum(-ADV[i] * LOGP[i][j] for i, j in TOKENS) / 9)
    loss.backward()
    close(logprobs.grad, grid(lambda i, j: -ADV[i] / 9))


# --------------------------------------------------------------------------------------------------- sapo


def sapo_gate(r, tau):
    return sigmoid(tau * (r - 1)) * 4 / tau


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_value_and_gradient(tau_pos, tau_neg):
    logprobs, old = make_inputs()
    loss, stats = policy_loss(
        logprobs,
        old,
        None,
        t(ADV),
        t(MASK),
        loss_type="sapo",
        sapo_temperature_pos=tau_pos,
        sapo_temperature_neg=tau_neg,
    )
    tau = [tau_pos if a > 0 else tau_neg for a in ADV]
    per_token = grid(lambda i, j: -sapo_gate(RATIOS[i][j], tau[i]) * ADV[i])
    # grpo's aggregation: mean over the 3 sequences of each one's token mean
    close(loss, sum(sum(per_token[i][: LENGTHS[i]]) / LENGTHS[i] for i in range(3)) / 3)
    loss.backward()

    # d/dlogp f(r) = σ'(τ(r-1)) · τ · 4/τ · r = 4 σ (1 - σ) r
    def grad(i, j):
        s = sigmoid(tau[i] * (RATIOS[i][j] - 1))
        return -ADV[i] * 4 * s * (1 - s) * RATIOS[i][j] / (LENGTHS[i] * 3)

    close(logprobs.grad, grid(grad))
    assert stats.as_dict() == {}  # TRL logs no clip ratios for sapo


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    # f(1) = 2/τ in value, f'(1) = 1: the gradient is -A/(len·N) whatever the temperature
    logprobs, _ = make_inputs()
    loss, _ = policy_loss(logprobs, None, None, t(ADV), t(MASK), loss_type="sapo", sapo_temperature_neg=1.5)
    tau = [1.0, 1.5, 1.0]
    close(loss, sum(-2 / tau[i] * ADV[i] for i in range(3)) / 3)
    loss.backward()
    close(logprobs.grad, grid(lambda i, j: -ADV[i] / (LENGTHS[i] * 3)))


# -------------------------------------------------------------------------------------------------- luspo

# mean log-ratios 0.2, -0.3, 0 (GSPO); padding carries 3.0
SEQ_LOG_RATIOS = [[0.3, 0.2, 0.1, 3.0], [-0.5, -0.1, 3.0, 3.0], [0.1, -0.1, 0.05, -0.05]]


def test_luspo_scales_each_sequence_by_its_length():
    old = t(OLD)
    logprobs = (old + t(SEQ_LOG_RATIOS)).requires_grad_(True)
    loss, stats = policy_loss(
        logprobs, old, None, t(ADV), t(MASK), loss_type="luspo", importance_sampling_level="sequence"
    )
    # sequence losses (clipped as GSPO): -1.2, 0.4, -2.0 ; times lengths 3, 2, 4 ; mean over 3 sequences
    close(loss, (-1.2 * 3 + 0.4 * 2 - 2.0 * 4) / 3)
    loss.backward()
    # seq 2 unclipped: loss_2 = 4 · (-A s), ds/dl_t = s/4 with s = 1 -> -A / 3 = -2/3 on each of its tokens
    close(logprobs.grad, [[0.0] * 4, [0.0] * 4, [-2 / 3] * 4])
    close(stats.objective["clip_ratio/high_mean"], 3 / 9)
    close(stats.objective["clip_ratio/low_mean"], 2 / 9)
    # with whole-batch counts the denominator is the number of sequences of the accumulated batch
    close(
        policy_loss(
            logprobs,
            old,
            None,
            t(ADV),
            t(MASK),
            loss_type="luspo",
            importance_sampling_level="sequence",
            num_sequences=6,
        )[0],
        (-1.2 * 3 + 0.4 * 2 - 2.0 * 4) / 6,
    )


def test_luspo_token_level_masks_before_summing():
    # TRL: importance_sampling_level="token" broadcasts to [N, T]; padding must not be summed
    logprobs, old = make_inputs()
    loss, _ = policy_loss(logprobs, old, None, t(ADV), t(MASK), loss_type="luspo")
    seq_sums = [-3.0, 0.85, -8.4]  # the clipped surrogate of test_loss.py, per sequence
    close(loss, sum(seq_sums) / 3)


# -------------------------------------------------------------------------------------------------- vespo

# token log-ratios with round sequence SUMS: -0.1, 0.3, 0 ; padding 3.0 (a leak would change w)
VESPO_LOG_RATIOS = [[0.1, -0.3, 0.1, 3.0], [0.2, 0.1, 3.0, 3.0], [0.25, -0.25, 0.5, -0.5]]
VESPO_OLD = [[-1.0, -0.5, -2.0, -1.0], [-0.25, -1.5, -1.0, -1.0], [-0.75, -1.0, -0.5, -2.0]]


def phi(log_w, k, lam):
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def test_vespo_weights_by_hand():
    mask = t(MASK)
    weights = vespo_weights(t(ADV)[:, None], t(VESPO_LOG_RATIOS), mask)
    # A >= 0 -> (k, λ) = (2, 3) ; A < 0 -> (3, 2)
    expected = [[phi(-0.1, 2, 3)], [phi(0.3, 3, 2)], [phi(0.0, 2, 3)]]
    close(weights, expected)
    assert abs(expected[2][0] - 1.0) < 1e-12  # φ(1) = 1
    # A = 0 takes the positive parameters; other parameters
    close(vespo_weights(t([[0.0]]), t([[0.5]]), t([[1.0]]), k_pos=1.5, lambda_pos=0.5), [[phi(0.5, 1.5, 0.5)]])
    close(vespo_weights(t([[-1.0]]), t([[0.5]]), t([[1.0]]), k_neg=0.5, lambda_neg=4.0), [[phi(0.5, 0.5, 4.0)]])


def test_vespo_weights_clamps():
    mask = t([[1, 1, 0]])
    # token log-ratio 25 -> 20, plus 1 -> sum 21 -> clamped to 20: w = e^20, φ = exp(3 + 40 - 3 e^20) = 0
    close(vespo_weights(t([[1.0]]), t([[25.0, 1.0, 0.0]]), mask), [[0.0]])
    # sum -30 -> clamped to log(1e-8): φ = exp(3 + 2 log 1e-8 - 3e-8)
    out = vespo_weights(t([[1.0]]), t([[-10.0, -20.0, 50.0]]), mask)
    assert out.item() == pytest.approx(math.exp(3 + 2 * math.log(1e-8) - 3e-8), rel=1e-9)
    # λ is clamped to >= 1e-4
    close(vespo_weights(t([[1.0]]), t([[0.0, 0.0, 0.0]]), mask, lambda_pos=0.0), [[1.0]])


def test_vespo_value_gradient_and_stats():
    old = t(VESPO_OLD)
    logprobs = (old + t(VESPO_LOG_RATIOS)).requires_grad_(True)
    lp = [[o + d for o, d in zip(orow, drow)] for orow, drow in zip(VESPO_OLD, VESPO_LOG_RATIOS)]
    weights = [phi(-0.1, 2, 3), phi(0.3, 3, 2), 1.0]
    loss, stats = policy_loss(logprobs, old, None, t(ADV), t(MASK), loss_type="vespo")
    close(loss, sum(-weights[i] * ADV[i] * lp[i][j] for i, j in TOKENS) / 9)
    loss.backward()
    close(logprobs.grad, grid(lambda i, j: -weights[i] * ADV[i] / 9))
    assert set(stats.as_dict()) == {"vespo/phi_seq_mean"}
    close(stats.objective["vespo/phi_seq_mean"], sum(weights) / 3)


def test_vespo_gradient_matches_autograd_of_the_written_formula():
    old, mask = t(VESPO_OLD), t(MASK)
    logprobs = (old + t(VESPO_LOG_RATIOS)).requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, None, t(ADV), mask, loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_neg=0.5)
    loss.backward()
    twin = (old + t(VESPO_LOG_RATIOS)).requires_grad_(True)
    log_w = ((twin - old) * mask).sum(-1, keepdim=True)
    adv = t(ADV)[:, None]
    k = torch.where(adv >= 0, 1.0, 3.0).to(F64)
    lam = torch.where(adv >= 0, 3.0, 0.5).to(F64)
    weight = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    written = (-(weight.detach()) * adv * twin * mask).sum() / mask.sum()
    written.backward()
    close(loss.detach(), written.detach())
    close(logprobs.grad, twin.grad)


# ---------------------------------------------------------------------------------------- off-policy mask

# N = 4, T = 3 with dyadic log-probs so that sampling - logp is exact. Advantages: +, -, -, 0.
OPM_MASK = [[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]]
OPM_LOGP = [[-1.0, -0.5, -2.0], [-0.25, -1.5, -1.0], [-0.75, -1.0, -0.5], [-2.0, -0.5, -1.0]]
# sampling - logp per token (padding 8.0 must be ignored; a NaN inside the mask counts as 0, as in TRL)
OPM_GAP = [[1.0, 0.5, 8.0], [0.5, 0.75, 0.25], [0.25, float("nan"), 8.0], [4.0, 8.0, 8.0]]
OPM_ADV = [1.0, -1.0, -0.5, 0.0]
# sequence KL means: 0.75 (A > 0: kept), 0.5 (A < 0: kept iff threshold >= 0.5), 0.125 (kept), 4.0 (A = 0: kept)


def opm_inputs():
    logprobs = t(OPM_LOGP).requires_grad_(True)
    sampling = t(OPM_LOGP) + t(OPM_GAP)
    return logprobs, sampling


@pytest.mark.parametrize("threshold, kept", [(0.5, [1, 1, 1, 1]), (0.4375, [1, 0, 1, 1]), (0.1, [1, 0, 0, 1])])
def test_off_policy_mask_function(threshold, kept):
    logprobs, sampling = opm_inputs()
    out = off_policy_mask(t(OPM_ADV)[:, None], logprobs, sampling, t(OPM_MASK), threshold)
    close(out, [[k] for k in kept])
    assert not out.requires_grad


def test_off_policy_mask_per_token_advantages():
    logprobs, sampling = opm_inputs()
    adv = t([[1.0, -1.0, 5.0], [-1.0, 2.0, -1.0], [0.5, -0.5, 0.0], [0.0, 0.0, 0.0]])
    out = off_policy_mask(adv, logprobs, sampling, t(OPM_MASK), 0.4375)
    # token-wise: keep where A >= 0 or the sequence's KL <= 0.4375 (rows 2 and 3 are low-KL / non-negative)
    close(out, [[1, 0, 1], [0, 1, 0], [1, 1, 1], [1, 1, 1]])


def test_off_policy_mask_in_the_loss():
    logprobs, sampling = opm_inputs()
    loss, _ = policy_loss(
        logprobs,
        None,
        None,
        t(OPM_ADV),
        t(OPM_MASK),
        loss_type="dapo",
        off_policy_mask_threshold=0.4375,
        sampling_logprobs=sampling,
    )
    # on-policy: -A per token; sequence 1 (3 tokens) dropped but its tokens still count in the denominator (8)
    close(loss, (-1.0 * 2 + 0.0 + 0.5 * 2 + 0.0) / 8)
    loss.backward()
    close(logprobs.grad, [[-1 / 8, -1 / 8, 0], [0, 0, 0], [0.5 / 8, 0.5 / 8, 0], [0, 0, 0]])


def test_off_policy_mask_defaults_to_old_logprobs():
    logprobs, sampling = opm_inputs()
    sampling = sampling.nan_to_num(nan=-0.5)  # as π_old they enter the ratio, which must stay finite
    args = (logprobs, sampling, None, t(OPM_ADV), t(OPM_MASK))
    # old_logprobs stand in for the sampler: same mask as passing them as sampling_logprobs
    via_old, _ = policy_loss(*args, off_policy_mask_threshold=0.4375)
    via_sampling, _ = policy_loss(*args, off_policy_mask_threshold=0.4375, sampling_logprobs=sampling)
    close(via_old, via_sampling)
    unmasked, _ = policy_loss(*args)
    assert abs(via_old.item() - unmasked.item()) > 1e-3
    # on-policy with no sampler log-probs: the KL is 0 and nothing is dropped
    close(
        policy_loss(logprobs, None, None, t(OPM_ADV), t(OPM_MASK), off_policy_mask_threshold=0.0)[0],
        policy_loss(logprobs, None, None, t(OPM_ADV), t(OPM_MASK))[0],
    )


# ----------------------------------------------------------------------------------- bias-corrected KL


def test_bias_corrected_kl_value_gradient_and_stat():
    beta = 0.04
    logprobs, old = make_inputs()
    ref = logprobs.detach() + t(REF_MINUS_LOGP)
    loss, stats = policy_loss(
        logprobs, old, ref, t(ADV), t(MASK), loss_type="dapo", beta=beta, use_bias_correction_kl=True
    )
    kl = grid(lambda i, j: RATIOS[i][j] * k3(REF_MINUS_LOGP[i][j]))
    close(loss, (-10.55 + beta * sum(map(sum, kl))) / 9)  # -10.55: the clipped surrogate's token sum
    close(stats.kl, sum(map(sum, kl)) / 9)  # the reported KL is the corrected one, as in TRL
    loss.backward()
    clipped = {(0, 1), (1, 1), (2, 0)}

    def grad(i, j):
        r, d = RATIOS[i][j], REF_MINUS_LOGP[i][j]
        g = beta * (r * k3(d) + r * (1 - math.exp(d)))  # d/dlogp [r · k3], the ratio is not detached
        return (g + (0.0 if (i, j) in clipped else -ADV[i] * r)) / 9

    close(logprobs.grad, grid(grad))


def test_bias_corrected_kl_matches_autograd_of_the_written_formula():
    beta = 0.1
    logprobs, old = make_inputs()
    ref = logprobs.detach() + t(REF_MINUS_LOGP)
    mask = t(MASK)
    loss, _ = policy_loss(logprobs, old, ref, torch.zeros(3, dtype=F64), mask, beta=beta, use_bias_correction_kl=True)
    loss.backward()
    twin = t(LOGP).requires_grad_(True)
    written = beta * (torch.exp(twin - old) * (torch.exp(ref - twin) - (ref - twin) - 1) * mask).sum() / 9
    written.backward()
    close(loss.detach(), written.detach())
    close(logprobs.grad, twin.grad)


def test_bias_corrected_kl_on_policy_changes_only_the_gradient():
    beta = 0.1
    logprobs, _ = make_inputs()
    ref = logprobs.detach() + t(REF_MINUS_LOGP)
    zero = torch.zeros(3, dtype=F64)
    plain, plain_stats = policy_loss(logprobs, None, ref, zero, t(MASK), beta=beta, use_bias_correction_kl=False)
    corrected, corrected_stats = policy_loss(logprobs, None, ref, zero, t(MASK), beta=beta, use_bias_correction_kl=True)
    close(plain, corrected)  # ratio = 1 in value
    close(plain_stats.kl, corrected_stats.kl)
    (g_plain,) = torch.autograd.grad(plain, logprobs)
    (g_corrected,) = torch.autograd.grad(corrected, logprobs)
    # the corrected gradient adds beta·k3(d) per token (dr/dlogp = r = 1)
    close(g_corrected - g_plain, grid(lambda i, j: beta * k3(REF_MINUS_LOGP[i][j]) / 9))


def test_bias_corrected_kl_sequence_level_broadcasts_the_sequence_ratio():
    beta = 0.5
    old = t(OLD)
    logprobs = (old + t(SEQ_LOG_RATIOS)).requires_grad_(True)
    ref = logprobs.detach() + t(REF_MINUS_LOGP)
    zero = torch.zeros(3, dtype=F64)
    loss, _ = policy_loss(
        logprobs, old, ref, zero, t(MASK), beta=beta, importance_sampling_level="sequence", use_bias_correction_kl=True
    )
    s = [math.exp(0.2), math.exp(-0.3), 1.0]
    close(loss, beta * sum(s[i] * k3(REF_MINUS_LOGP[i][j]) for i, j in TOKENS) / 9)


# ------------------------------------------------------------------------------------------ entropy bonus

ENTROPIES = [[0.5, 1.0, 1.5, 40.0], [2.0, 0.2, 40.0, 40.0], [0.1, 0.3, 0.6, 1.0]]  # masked sum 7.2


@pytest.mark.parametrize(
    "loss_type, policy_value", [("grpo", (-1.0 + 0.425 - 2.1) / 3), ("dr_grpo", -10.55 / 12), ("dapo", -10.55 / 9)]
)
def test_token_mean_entropy_bonus_is_the_same_for_every_loss_type(loss_type, policy_value):
    coef = 0.01
    logprobs, old = make_inputs()
    entropies = t(ENTROPIES).requires_grad_(True)
    loss, stats = policy_loss(
        logprobs,
        old,
        None,
        t(ADV),
        t(MASK),
        loss_type=loss_type,
        entropies=entropies,
        entropy_coef=coef,
        entropy_normalization="token_mean",
    )
    close(loss, policy_value - coef * 7.2 / 9)
    close(stats.policy_loss, policy_value)
    assert stats.as_dict()["policy_loss"] == pytest.approx(policy_value, abs=ATOL)
    loss.backward()
    close(entropies.grad, grid(lambda i, j: -coef / 9))


def test_token_mean_entropy_bonus_with_loss_weights_and_micro_batches():
    coef = 0.2
    logprobs, old = make_inputs()
    entropies = t(ENTROPIES).requires_grad_(True)
    weights = t([[1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 0, 0]])  # masked: 5 tokens kept, entropy 0.5+1.5+0.2+0.1+0.3
    loss, stats = policy_loss(
        logprobs,
        old,
        None,
        t(ADV),
        t(MASK),
        loss_type="dapo",
        entropies=entropies,
        entropy_coef=coef,
        entropy_normalization="token_mean",
        loss_weights=weights,
        num_micro_batches=4,
    )
    policy = (-1.1 - 0.7 + 0.4 - 2.4 - 2.0) / 9  # the kept tokens' clipped surrogate, over the 9 mask tokens
    close(loss, policy - coef * (2.6 / 5) / 4)
    close(stats.entropy, 7.2 / 9)  # the logged entropy is over the whole mask
    loss.backward()
    close(entropies.grad, [[-coef / 20 * w * m for w, m in zip(wr, mr)] for wr, mr in zip(weights.tolist(), MASK)])


def test_loss_type_entropy_bonus_is_aggregated_with_the_loss_and_the_default_is_trls():
    coef = 0.01
    logprobs, old = make_inputs()
    args = (logprobs, old, None, t(ADV), t(MASK))
    kwargs = {"loss_type": "grpo", "entropies": t(ENTROPIES), "entropy_coef": coef}
    aggregated, stats = policy_loss(*args, **kwargs, entropy_normalization="loss_type")
    ent_means = [3.0 / 3, 2.2 / 2, 2.0 / 4]  # aggregated as grpo: per-sequence means
    close(aggregated, (-1.0 + 0.425 - 2.1) / 3 - coef * sum(ent_means) / 3)
    assert stats.policy_loss is None and "policy_loss" not in stats.as_dict()
    default, _ = policy_loss(*args, **kwargs)  # TRL 1.16's "token_mean": the mask's token mean, 7.2 over 9 tokens
    close(default, (-1.0 + 0.425 - 2.1) / 3 - coef * 7.2 / 9)


def test_invalid_entropy_normalization_raises():
    logprobs, old = make_inputs()
    with pytest.raises(ValueError, match="'mean'"):
        policy_loss(logprobs, old, None, t(ADV), t(MASK), entropy_normalization="mean")


# ------------------------------------------------------------------------------------- adaptive entropy


def test_update_entropy_coef_rule():
    kw = {"target": 0.5, "delta": 0.05, "coef_min": 0.0, "coef_max": 0.2}
    assert update_entropy_coef(0.1, 0.4, **kw) == pytest.approx(0.15)  # below target: up
    assert update_entropy_coef(0.1, 0.5, **kw) == pytest.approx(0.15)  # at target: up (<=)
    assert update_entropy_coef(0.1, 0.6, **kw) == pytest.approx(0.05)  # above: down
    assert update_entropy_coef(0.18, 0.1, **kw) == 0.2  # capped
    assert update_entropy_coef(0.02, 0.9, **kw) == 0.0  # floored


def test_adaptive_entropy_controller_by_hand():
    ctrl = AdaptiveEntropyController(coef=0.1, target=0.5, delta=0.05, coef_min=0.0, coef_max=0.2)
    assert ctrl.coef_to_apply() == 0.0  # nothing measured yet (TRL starts from +inf)
    # window 1: two micro-batches, entropies (0.2 + 0.4) and 0.6 over 3 tokens -> 0.4 <= 0.5: up to 0.15
    ctrl.observe(t([[0.2, 0.4, 9.0]]), t([[1, 1, 0]]))
    ctrl.observe(t([[0.6, 9.0, 9.0]]), t([[1, 0, 0]]))
    assert ctrl.step() == pytest.approx(0.15)
    assert ctrl.last_entropy == pytest.approx(0.4)
    assert ctrl.coef_to_apply() == pytest.approx(0.15)
    # window 2 summed over two processes: (0.3 + 0.6) / 2 = 0.45 -> 0.2
    assert ctrl.step(torch.tensor([0.9, 2.0])) == pytest.approx(0.2)
    # window 3: 0.9 > 0.5 -> down to 0.15, and no bonus while entropy is above the target
    ctrl.observe(t([[0.9, 0.9]]), t([[1, 1]]))
    assert ctrl.window_totals().tolist() == pytest.approx([1.8, 2.0])
    assert ctrl.step() == pytest.approx(0.15)
    assert ctrl.coef_to_apply() == 0.0
    assert ctrl.window_totals().tolist() == [0.0, 0.0]


def test_adaptive_entropy_controller_resumes_exactly():
    def run(ctrl, windows):
        out = []
        for window in windows:
            for values in window:
                ctrl.observe(t([values]), torch.ones(1, len(values), dtype=F64))
            out.append((ctrl.step(), ctrl.coef_to_apply()))
        return out

    windows = [[[0.1, 0.2]], [[0.3], [0.9, 0.9]], [[0.05]], [[0.7, 0.6]], [[0.2]]]
    whole = run(AdaptiveEntropyController(coef=0.01, target=0.3, delta=0.02), windows)
    first = AdaptiveEntropyController(coef=0.01, target=0.3, delta=0.02)
    head = run(first, windows[:2])
    first.observe(t([[0.05]]), t([[1.0]]))  # a checkpoint mid-window keeps the window too
    second = AdaptiveEntropyController(coef=123.0, target=0.3, delta=0.02)  # config is not state
    second.load_state_dict(first.state_dict())
    tail = run(second, [[], *windows[3:]])
    assert head + tail == whole


# ----------------------------------------------------------------------------------- MoE load balancing

# E = 3 experts, 2 layers, B = 1, S = 3 (the last token is padding); logits = log p, so softmax gives p.
ROUTER_P = [
    [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.1, 0.7]],
    [[0.7, 0.2, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]],
]
ROUTER_MASK = [[1, 1, 0]]


def router_logits(requires_grad=False):
    return [torch.log(t(p)).requires_grad_(requires_grad) for p in ROUTER_P]


def test_load_balancing_loss_by_hand():
    logits = router_logits()
    # masked, top-1: choices e0, e1 (layer 1) and e0, e2 (layer 2) over 4 slots -> f = [0.5, 0.25, 0.25];
    # P = column sums of the 4 unmasked rows / 4 = [1.5, 1.4, 1.1] / 4 ; loss = 3 · sum f·P
    close(load_balancing_loss(logits, 3, 1, t(ROUTER_MASK)), 3 * (0.5 * 1.5 + 0.25 * 1.4 + 0.25 * 1.1) / 4)
    # top-2: (e0, e1), (e1, e2), (e0, e1), (e2, e1) -> f = [2, 4, 2] / 4 (sums to k)
    close(load_balancing_loss(logits, 3, 2, t(ROUTER_MASK)), 3 * (0.5 * 1.5 + 1.0 * 1.4 + 0.5 * 1.1) / 4)
    # no mask: the padded rows count (choices e2 and e0): f = [3, 1, 2] / 6, P = [2.3, 1.8, 1.9] / 6
    close(load_balancing_loss(logits, 3, 1), 3 * (3 * 2.3 + 1 * 1.8 + 2 * 1.9) / 36)
    # a stacked [L, B·S, E] tensor is the same; nothing gives 0
    close(load_balancing_loss(torch.stack(logits), 3, 1, t(ROUTER_MASK)), 3 * (0.5 * 1.5 + 0.25 * 1.4 + 0.25 * 1.1) / 4)
    assert load_balancing_loss(None, 3, 1).item() == 0.0
    # every expert chosen with equal probability (k = E): the minimum, k
    close(load_balancing_loss([torch.zeros(4, 4, dtype=F64)], 4, 4), 4.0)


def test_load_balancing_loss_gradient_flows_through_probabilities_only():
    logits = router_logits(requires_grad=True)
    loss = load_balancing_loss(logits, 3, 1, t(ROUTER_MASK))
    loss.backward()
    # d loss / d z_l,t,j = E · m_t / total · p_j · (f_j - sum_e f_e p_e), f constant (a count)
    f = [0.5, 0.25, 0.25]
    for layer, p_rows in enumerate(ROUTER_P):
        expected = []
        for row, p in enumerate(p_rows):
            m = ROUTER_MASK[0][row]
            fp = sum(fe * pe for fe, pe in zip(f, p))
            expected.append([3 * m / 4 * p[j] * (f[j] - fp) for j in range(3)])
        close(logits[layer].grad, expected)


def test_load_balancing_loss_matches_transformers():
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    gen = torch.Generator().manual_seed(0)
    B, S, E, L = 3, 5, 6, 3
    logits = tuple(torch.randn(B * S, E, generator=gen) for _ in range(L))
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    for top_k in (1, 2):
        for attention_mask in (None, mask):
            ours = load_balancing_loss(logits, E, top_k, attention_mask)
            theirs = modeling.load_balancing_loss_func(logits, E, top_k, attention_mask)
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------- gradient accumulation

# The accumulation batch of tests/test_loss.py (6 sequences, T = 5, ragged lengths 5, 1, 3, 4, 2, 5: 20 tokens;
# several ratios outside [0.8, 1.28]), with what the new options need besides.
GA_SAMPLING_GAP = [[0.9] * 5, [0.9] * 5, [0.1] * 5, [0.9] * 5, [0.1] * 5, [0.1] * 5]
GA_ENTROPY = [[0.1 * ((i + 2 * j) % 5) + 0.2 for j in range(5)] for i in range(6)]
GA_COUNTS = {"num_sequences": 6, "num_tokens": 20, "max_completion_length": 7}
SPLITS = [[[0, 1], [2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]], [[4, 0], [5, 2, 1, 3]]]


def _ga_loss(logprobs, entropies, rows, loss_type, **kw):
    idx = torch.tensor(rows)
    old = t(GA_OLD)[idx]
    ref = (t(GA_OLD) + t(GA_LOG_RATIO) + t(GA_REF_D))[idx]
    sampling = (t(GA_OLD) + t(GA_SAMPLING_GAP))[idx]
    level = "sequence" if loss_type == "luspo" else "token"
    return policy_loss(
        logprobs[idx],
        old,
        ref,
        t(GA_ADV)[idx],
        t(GA_MASK)[idx],
        loss_type=loss_type,
        beta=0.05,
        epsilon=0.2,
        epsilon_high=1.25 if loss_type == "cispo" else 0.28,
        importance_sampling_level=level,
        off_policy_mask_threshold=0.5,
        sampling_logprobs=sampling,
        use_bias_correction_kl=True,
        entropies=entropies[idx],
        **GA_COUNTS,
        **kw,
    )[0]


def _ga_leaves():
    return (t(GA_OLD) + t(GA_LOG_RATIO)).requires_grad_(True), t(GA_ENTROPY).requires_grad_(True)


def _whole_and_split(loss_type, split, **kw):
    whole_lp, whole_ent = _ga_leaves()
    whole = _ga_loss(whole_lp, whole_ent, list(range(6)), loss_type, **kw)
    whole.backward()
    micro_lp, micro_ent = _ga_leaves()
    total = sum(_ga_loss(micro_lp, micro_ent, rows, loss_type, **kw) for rows in split)
    total.backward()
    assert whole_lp.grad.abs().sum() > 0.1  # not trivially zero
    return (whole, whole_lp.grad, whole_ent.grad), (total, micro_lp.grad, micro_ent.grad)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
@pytest.mark.parametrize("split", SPLITS)
def test_gradient_accumulation_per_loss_type(loss_type, split):
    """Summing micro-batch losses with whole-batch counts gives the whole batch's loss and gradient, with the
    off-policy mask, the bias-corrected KL and a loss_type-aggregated entropy bonus on -- for every loss type whose
    table entry says so; the others (bnpo: a token mean per micro-batch) provably differ."""
    (whole, whole_grad, whole_ent_grad), (total, micro_grad, micro_ent_grad) = _whole_and_split(
        loss_type, split, entropy_coef=0.01, entropy_normalization="loss_type"
    )
    if LOSS_TYPES[loss_type].accumulation_invariant:
        close(total, whole.detach())
        close(micro_grad, whole_grad)
        close(micro_ent_grad, whole_ent_grad)
    else:
        assert abs(total.item() - whole.item()) > 1e-3
        assert (micro_grad - whole_grad).abs().max() > 1e-3


def test_only_bnpo_depends_on_the_split():
    assert [name for name, spec in LOSS_TYPES.items() if not spec.accumulation_invariant] == ["bnpo"]


def test_off_policy_mask_drops_something_in_the_accumulation_fixture():
    lp, _ = _ga_leaves()
    sampling = t(GA_OLD) + t(GA_SAMPLING_GAP)
    kept = off_policy_mask(t(GA_ADV)[:, None], lp, sampling, t(GA_MASK), 0.5).flatten().tolist()
    assert kept == [1, 0, 1, 0, 1, 1]  # the two negative-advantage sequences sampled far from π_θ


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_token_mean_entropy_bonus_accumulates_only_with_equal_token_counts(loss_type):
    """TRL's entropy bonus is each micro-batch's token mean / number of micro-batches: a mean of means, equal to
    the whole batch's token mean only when the micro-batches hold as many loss tokens each."""
    kw = {"entropy_coef": 0.5, "entropy_normalization": "token_mean"}
    whole_lp, whole_ent = _ga_leaves()
    whole = _ga_loss(whole_lp, whole_ent, list(range(6)), loss_type, num_micro_batches=1, **kw)
    whole.backward()
    close(whole_ent.grad, [[-0.5 / 20 * m for m in row] for row in GA_MASK])

    def split_grads(split):
        lp, ent = _ga_leaves()
        total = sum(_ga_loss(lp, ent, rows, loss_type, num_micro_batches=len(split), **kw) for rows in split)
        total.backward()
        return total, lp.grad, ent.grad

    # 10 + 10 tokens (lengths 5, 1, 4 | 3, 2, 5): the one-batch loss and gradient
    total, lp_grad, ent_grad = split_grads([[0, 1, 3], [2, 4, 5]])
    close(total, whole.detach())
    close(lp_grad, whole_lp.grad)
    close(ent_grad, whole_ent.grad)
    # 6 + 14 tokens: an entropy token weighs 1/(2·6) or 1/(2·14) instead of 1/20 -- not the one-batch gradient,
    # while the policy term itself still accumulates exactly
    total, lp_grad, ent_grad = split_grads([[0, 1], [2, 3, 4, 5]])
    close(ent_grad, [[-0.5 / (2 * (6 if i < 2 else 14)) * m for m in row] for i, row in enumerate(GA_MASK)])
    assert abs(total.item() - whole.item()) > 1e-3
    close(lp_grad, whole_lp.grad)


# ------------------------------------------------------------------------------------------ TRL's own code


@pytest.mark.slow  # importing TRL's trainer takes ~15 s
def test_parity_with_trl_static_methods():
    """The off-policy mask and VESPO's weights against TRL 1.16's own static methods, on random inputs."""
    trainer = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer
    gen = torch.Generator().manual_seed(0)
    N, T = 8, 6
    logprobs = -torch.rand(N, T, generator=gen, dtype=F64) * 2
    sampling = logprobs - torch.randn(N, T, generator=gen, dtype=F64) * 0.5
    sampling[0, 1] = float("nan")
    mask = (torch.rand(N, T, generator=gen) > 0.3).to(F64)
    advantages = torch.randn(N, 1, generator=gen, dtype=F64)
    advantages[2] = 0.0
    log_ratio = torch.randn(N, T, generator=gen, dtype=F64) * 0.3
    for threshold in (0.0, 0.2, 0.5):
        close(
            off_policy_mask(advantages, logprobs, sampling, mask, threshold),
            trainer.get_off_policy_mask(advantages, logprobs, sampling, mask, threshold),
        )
    for k_pos, lambda_pos, k_neg, lambda_neg in [(2.0, 3.0, 3.0, 2.0), (1.0, 0.5, 4.0, 0.0)]:
        ours = vespo_weights(
            advantages, log_ratio, mask, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg
        )
        theirs = trainer.get_gamma_weights(
            advantages, log_ratio, mask, None, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg
        )
        close(ours, theirs)
