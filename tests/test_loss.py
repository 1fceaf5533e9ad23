"""The GRPO objective (`grpokit.loss`) against hand-computed numbers.

Every expected value below is written out from the formula (DESIGN.md, TRL's GRPO trainer) on small tensors,
with plain Python arithmetic; nothing is computed by calling the code under test a second way.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpokit import policy_loss, selective_log_softmax  # the log-prob helper is grpokit.logprobs'
from grpokit.loss import PolicyLossSettings, aggregate, aggregate_token_loss, kl_k3, token_loss

F64 = torch.float64
ATOL = 1e-6  # float64 checks
ATOL32 = 1e-5  # float32 checks


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=ATOL):
    actual = torch.as_tensor(actual, dtype=F64)
    expected = torch.as_tensor(expected, dtype=F64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), f"\nactual   {actual}\nexpected {expected}"


# --------------------------------------------------------------------------------------------- the fixture
#
# N = 3 completions, T = 4 tokens, ragged mask (lengths 3, 2, 4; 9 tokens). The importance ratios are chosen
# directly; logprobs = old + log(ratio). Padding positions carry absurd ratios (5, 9) so that any leak of a
# padded token into a sum or a mean changes the result.
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
LENGTHS = [3, 2, 4]
RATIOS = [[1.1, 1.3, 0.7, 5.0], [0.9, 0.75, 9.0, 9.0], [1.25, 1.0, 0.85, 1.15]]
OLD = [[-1.0, -1.5, -0.5, -2.0], [-0.7, -1.2, -3.0, -3.0], [-0.2, -0.9, -1.1, -0.4]]
ADV = [1.0, -0.5, 2.0]
# ref - logp per token, for the k3 KL
REF_MINUS_LOGP = [[0.1, -0.2, 0.3, 2.0], [0.0, 0.5, 1.0, 1.0], [-0.1, 0.2, -0.3, 0.4]]

# Hand-computed per-token losses -min(r·A, clip(r, 0.8, 1.2)·A) for epsilon = epsilon_high = 0.2:
#   seq 0 (A=1):    r=1.1 -> -1.1;  r=1.3 -> -min(1.3, 1.2) = -1.2;  r=0.7 -> -min(0.7, 0.8) = -0.7     sum -3.0
#   seq 1 (A=-.5):  r=0.9 -> 0.45;  r=0.75 -> -min(-0.375, -0.4) = 0.4                                   sum 0.85
#   seq 2 (A=2):    r=1.25 -> -min(2.5, 2.4) = -2.4;  r=1 -> -2;  r=0.85 -> -1.7;  r=1.15 -> -2.3        sum -8.4
SEQ_SUMS = [-3.0, 0.85, -8.4]
TOTAL = -10.55  # sum over the 9 tokens


def make_inputs(ratios=RATIOS, old=OLD, requires_grad=True):
    old_t = t(old)
    logprobs = t([[o + math.log(r) for o, r in zip(orow, rrow)] for orow, rrow in zip(old, ratios)])
    logprobs.requires_grad_(requires_grad)
    return logprobs, old_t


def ref_from(logprobs, ref_minus_logp=REF_MINUS_LOGP):
    """The reference log-probs as a constant tensor (no graph link to logprobs)."""
    return logprobs.detach() + t(ref_minus_logp)


def k3(d):
    return math.exp(d) - d - 1.0


# -------------------------------------------------------------------------------------- loss types (value)


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        # mean over sequences of each sequence's token mean: (-3/3 + 0.85/2 - 8.4/4) / 3
        ("grpo", {}, (-1.0 + 0.425 - 2.1) / 3),
        # token sum over this batch's token count
        ("bnpo", {}, TOTAL / 9),
        # token sum over (N · max_completion_length)
        ("dr_grpo", {"max_completion_length": 4}, TOTAL / (3 * 4)),
        ("dr_grpo", {"max_completion_length": 10}, TOTAL / (3 * 10)),
        # token sum over the batch's token count (default: this batch)
        ("dapo", {}, TOTAL / 9),
    ],
)
def test_loss_value_per_loss_type(loss_type, kwargs, expected):
    logprobs, old = make_inputs()
    loss, stats = policy_loss(logprobs, old, None, t(ADV), t(MASK), loss_type=loss_type, epsilon=0.2, **kwargs)
    close(loss, expected)
    assert stats.kl is None and stats.entropy is None


def test_loss_value_defaults_and_batch_counts():
    logprobs, old = make_inputs()
    args = (logprobs, old, None, t(ADV), t(MASK))
    # default loss_type is dapo, default epsilon 0.2
    close(policy_loss(*args)[0], TOTAL / 9)
    # dr_grpo without max_completion_length uses the padded length T = 4
    close(policy_loss(*args, loss_type="dr_grpo")[0], TOTAL / 12)
    # whole-batch counts replace this batch's own
    close(policy_loss(*args, loss_type="grpo", num_sequences=5)[0], (-1.0 + 0.425 - 2.1) / 5)
    close(policy_loss(*args, loss_type="dapo", num_tokens=20)[0], TOTAL / 20)
    close(policy_loss(*args, loss_type="dr_grpo", num_sequences=6, max_completion_length=4)[0], TOTAL / 24)
    # bnpo ignores the whole-batch counts: it is this micro-batch's token mean by definition
    close(policy_loss(*args, loss_type="bnpo", num_sequences=6, num_tokens=20)[0], TOTAL / 9)


def test_aggregate_direct():
    per_token = t([[1.0, 2.0, 3.0, 100.0], [4.0, 6.0, 100.0, 100.0], [-1.0, -2.0, -3.0, -6.0]])
    mask = t(MASK)
    # token sums per sequence: 6, 10, -12 ; means 2, 5, -3 ; total 4 over 9 tokens
    close(aggregate(per_token, mask, "grpo"), (2 + 5 - 3) / 3)
    close(aggregate(per_token, mask, "bnpo"), 4 / 9)
    close(aggregate(per_token, mask, "dapo"), 4 / 9)
    close(aggregate(per_token, mask, "dr_grpo"), 4 / 12)
    close(aggregate(per_token, mask, "dr_grpo", max_completion_length=8), 4 / 24)
    close(aggregate(per_token, mask, "grpo", num_sequences=4), 4 / 4)
    close(aggregate(per_token, mask, "dapo", num_tokens=16), 4 / 16)
    # a boolean / integer mask works the same
    close(aggregate(per_token, mask.bool(), "grpo"), 4 / 3)
    # a fully masked row contributes 0 to grpo (no division by zero) but still counts as a sequence
    mask0 = t([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    close(aggregate(per_token, mask0, "grpo"), (2 + 0 - 3) / 3)


# ------------------------------------------------------------------------------- importance sampling level


# Sequence-level (GSPO) fixture: log-ratios chosen so that the per-sequence mean is round.
#   seq 0: mean(0.3, 0.2, 0.1) = 0.2  -> s = e^0.2 = 1.2214 > 1.2, A = 1 > 0    -> clipped to 1.2
#   seq 1: mean(-0.5, -0.1) = -0.3    -> s = e^-0.3 = 0.7408 < 0.8, A = -.5 < 0 -> clipped to 0.8
#   seq 2: mean(0.1, -0.1, 0.05, -0.05) = 0 -> s = 1
# The padded positions carry log-ratio 3.0: a mean over all T would be very different.
SEQ_LOG_RATIOS = [[0.3, 0.2, 0.1, 3.0], [-0.5, -0.1, 3.0, 3.0], [0.1, -0.1, 0.05, -0.05]]


def make_sequence_inputs():
    old = t(OLD)
    logprobs = (old + t(SEQ_LOG_RATIOS)).requires_grad_(True)
    return logprobs, old


def test_sequence_level_value_stats_and_grad():
    logprobs, old = make_sequence_inputs()
    loss, stats = policy_loss(
        logprobs, old, None, t(ADV), t(MASK), loss_type="dapo", importance_sampling_level="sequence"
    )
    # per-token losses: seq 0: -1.2 (x3), seq 1: -min(-0.5·0.7408, -0.5·0.8) = 0.4 (x2), seq 2: -2 (x4)
    close(loss, (-1.2 * 3 + 0.4 * 2 - 2.0 * 4) / 9)
    # one ratio per sequence, broadcast over its tokens: 3 high-clipped tokens, 2 low-clipped
    close(stats.objective["clip_ratio/high_mean"], 3 / 9)
    close(stats.objective["clip_ratio/low_mean"], 2 / 9)
    close(stats.objective["clip_ratio/region_mean"], 5 / 9)
    close(stats.ratio_mean, (3 * math.exp(0.2) + 2 * math.exp(-0.3) + 4 * 1.0) / 9)
    # gradient: seq 0 and 1 are clipped (zero grad); seq 2 contributes 4 tokens of -A·s each, ds/dl_t = s/len:
    # d/dl_t = 4 · (-A · s / 4) / 9 = -2/9 on each of its tokens
    loss.backward()
    expected = [[0, 0, 0, 0], [0, 0, 0, 0], [-2.0 / 9] * 4]
    close(logprobs.grad, expected)


def test_sequence_level_grpo_value_and_differs_from_token_level():
    logprobs, old = make_sequence_inputs()
    args = (logprobs, old, None, t(ADV), t(MASK))
    seq_loss, _ = policy_loss(*args, loss_type="grpo", importance_sampling_level="sequence")
    close(seq_loss, (-1.2 + 0.4 - 2.0) / 3)
    # token level on the same numbers: seq 0: -min(e^.3,1.2) - min(e^.2,1.2) - e^.1 ; seq 1: A<0,
    # e^-.5 = 0.6065 < 0.8 -> clipped -0.4 -> 0.4 ; e^-.1 = 0.905 -> 0.5·0.905 ; seq 2: -2·e^x per token
    # (0.1 -> min(2·1.105, 2.4) = 2.2103, -0.1 -> 1.8097, 0.05 -> 2.1025, -0.05 -> 1.9025)
    s0 = (-1.2 - 1.2 - math.exp(0.1)) / 3
    s1 = (0.4 + 0.5 * math.exp(-0.1)) / 2
    s2 = -2 * (math.exp(0.1) + math.exp(-0.1) + math.exp(0.05) + math.exp(-0.05)) / 4
    tok_loss, _ = policy_loss(*args, loss_type="grpo", importance_sampling_level="token")
    close(tok_loss, (s0 + s1 + s2) / 3)


def test_sequence_level_unclipped_gradient():
    # A single unclipped sequence with s != 1: mean(0.1, 0.0, -0.04) = 0.02, s = e^0.02; A = 0.5.
    # grpo, N = 1: loss = -A·s ; d/dl_t = -A·s/len on the 3 masked tokens; the pad gets 0.
    old = t([[-1.0, -2.0, -0.5, -0.3]])
    logprobs = (old + t([[0.1, 0.0, -0.04, 2.0]])).requires_grad_(True)
    loss, stats = policy_loss(
        logprobs, old, None, t([0.5]), t([[1, 1, 1, 0]]), loss_type="grpo", importance_sampling_level="sequence"
    )
    s = math.exp(0.02)
    close(loss, -0.5 * s)
    close(stats.ratio_mean, s)
    loss.backward()
    close(logprobs.grad, [[-0.5 * s / 3] * 3 + [0.0]])


def test_sequence_level_dr_grpo_default_max_completion_length():
    # Without max_completion_length, dr_grpo divides by N · T (T = padded length = 4), whatever the
    # importance-sampling level -- exactly as for token level (test_loss_value_defaults_and_batch_counts).
    logprobs, old = make_sequence_inputs()
    args = (logprobs, old, None, t(ADV), t(MASK))
    total = -1.2 * 3 + 0.4 * 2 - 2.0 * 4  # -10.8
    explicit, _ = policy_loss(*args, loss_type="dr_grpo", importance_sampling_level="sequence", max_completion_length=4)
    close(explicit, total / 12)
    default, _ = policy_loss(*args, loss_type="dr_grpo", importance_sampling_level="sequence")
    close(default, total / 12)


# ------------------------------------------------------------------------------------------------ KL, beta


def test_beta_zero_with_reference_reports_kl_but_does_not_add_it():
    logprobs, old = make_inputs()
    ref = ref_from(logprobs)
    loss, stats = policy_loss(
        logprobs, old, ref, t(ADV), t(MASK), loss_type="dapo", beta=0.0, use_bias_correction_kl=False
    )
    close(loss, TOTAL / 9)
    masked_kl = [k3(d) for row, m in zip(REF_MINUS_LOGP, MASK) for d, keep in zip(row, m) if keep]
    assert len(masked_kl) == 9
    close(stats.kl, sum(masked_kl) / 9)
    assert stats.as_dict()["kl"] == pytest.approx(sum(masked_kl) / 9, abs=ATOL)


def test_kl_k3_per_token():
    logp = t([[-1.0, -2.0, -0.5]])
    ref = t([[-1.5, -1.0, -0.5]])
    # d = ref - logp = -0.5, 1.0, 0.0
    expected = [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]]
    close(kl_k3(logp, ref), expected)
    assert (kl_k3(logp, ref) >= 0).all()
    # not symmetric: swapping the arguments gives exp(-d) + d - 1
    close(kl_k3(ref, logp), [[math.exp(0.5) - 0.5 - 1, math.exp(-1.0) + 1.0 - 1, 0.0]])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_beta_positive_adds_k3_per_token_after_clipping(loss_type):
    beta = 0.04
    logprobs, old = make_inputs()
    ref = ref_from(logprobs)
    loss, stats = policy_loss(
        logprobs, old, ref, t(ADV), t(MASK), loss_type=loss_type, beta=beta, epsilon=0.2, use_bias_correction_kl=False
    )
    # per-token: clipped surrogate (SEQ_SUMS above) + beta·k3(d), d = ref - logp
    kl_rows = [[k3(d) for d, keep in zip(row, m) if keep] for row, m in zip(REF_MINUS_LOGP, MASK)]
    seq_sums = [s + beta * sum(k) for s, k in zip(SEQ_SUMS, kl_rows)]
    if loss_type == "grpo":
        expected = sum(s / n for s, n in zip(seq_sums, LENGTHS)) / 3
    else:
        expected = sum(seq_sums) / 9
    close(loss, expected)
    close(stats.kl, sum(sum(k) for k in kl_rows) / 9)
    # gradient: clipped tokens keep only the KL gradient beta·(1 - e^d); unclipped get -A·r + beta·(1 - e^d)
    loss.backward()
    clipped = {(0, 1), (1, 1), (2, 0)}
    grad = [[0.0] * 4 for _ in range(3)]
    for i in range(3):
        norm = LENGTHS[i] * 3 if loss_type == "grpo" else 9
        for j in range(LENGTHS[i]):
            g = beta * (1 - math.exp(REF_MINUS_LOGP[i][j]))
            if (i, j) not in clipped:
                g += -ADV[i] * RATIOS[i][j]
            grad[i][j] = g / norm
    close(logprobs.grad, grad)


def test_beta_positive_without_reference_raises():
    logprobs, old = make_inputs()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, None, t(ADV), t(MASK), beta=0.1)


# ---------------------------------------------------------------------------------------------- clipping


def test_clip_higher_tokens_and_stats():
    logprobs, old = make_inputs()
    loss, stats = policy_loss(logprobs, old, None, t(ADV), t(MASK), loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    # clip range [0.8, 1.28]:
    #   seq 0 (A=1): 1.1 -> -1.1; 1.3 -> -min(1.3, 1.28) = -1.28; 0.7 -> -0.7              sum -3.08
    #   seq 1 (A=-.5): 0.9 -> 0.45; 0.75 -> 0.4 (clipped at 0.8)                           sum 0.85
    #   seq 2 (A=2): 1.25 -> -2.5 (NOT clipped now); 1 -> -2; 0.85 -> -1.7; 1.15 -> -2.3    sum -8.5
    close(loss, (-3.08 + 0.85 - 8.5) / 9)
    # high: ratio > 1.28 and A > 0 -> only (0, 1) [1.25 < 1.28; the padded 5.0 does not count]
    # low:  ratio < 0.8 and A < 0  -> only (1, 1) [(0, 2) = 0.7 has A > 0; the padded 9.0 has ratio > 1]
    close(stats.objective["clip_ratio/high_mean"], 1 / 9)
    close(stats.objective["clip_ratio/low_mean"], 1 / 9)
    close(stats.objective["clip_ratio/region_mean"], 2 / 9)
    d = stats.as_dict()
    assert d["clip_ratio/high_mean"] == pytest.approx(1 / 9, abs=ATOL)
    assert d["clip_ratio/low_mean"] == pytest.approx(1 / 9, abs=ATOL)
    assert d["clip_ratio/region_mean"] == pytest.approx(2 / 9, abs=ATOL)
    assert "kl" not in d and "entropy" not in d
    # which tokens are clipped: exactly those have zero gradient
    loss.backward()
    expected = [
        [-1.0 * 1.1 / 9, 0.0, -1.0 * 0.7 / 9, 0.0],
        [0.5 * 0.9 / 9, 0.0, 0.0, 0.0],
        [-2 * 1.25 / 9, -2 * 1.0 / 9, -2 * 0.85 / 9, -2 * 1.15 / 9],
    ]
    close(logprobs.grad, expected)


def test_symmetric_clip_stats():
    logprobs, old = make_inputs()
    _, stats = policy_loss(logprobs, old, None, t(ADV), t(MASK), epsilon=0.2)
    # high: (0,1) r=1.3 and (2,0) r=1.25 (both A > 0); low: (1,1) r=0.75 (A < 0)
    close(stats.objective["clip_ratio/high_mean"], 2 / 9)
    close(stats.objective["clip_ratio/low_mean"], 1 / 9)
    close(stats.objective["clip_ratio/region_mean"], 3 / 9)


def test_swapped_epsilons_are_not_equivalent():
    # epsilon=0.28, epsilon_high=0.2 -> range [0.72, 1.2]: (1,1) r=0.75 is no longer low-clipped
    # (-min(-0.375, -0.36) = 0.375), (2,0) r=1.25 is high-clipped again (-2.4)
    logprobs, old = make_inputs()
    loss, stats = policy_loss(logprobs, old, None, t(ADV), t(MASK), loss_type="dapo", epsilon=0.28, epsilon_high=0.2)
    close(loss, ((-1.1 - 1.2 - 0.7) + (0.45 + 0.375) + (-2.4 - 2.0 - 1.7 - 2.3)) / 9)
    close(stats.objective["clip_ratio/low_mean"], 0.0)
    close(stats.objective["clip_ratio/high_mean"], 2 / 9)


def test_gradients_zero_in_clipped_region_symmetric():
    logprobs, old = make_inputs()
    loss, _ = policy_loss(logprobs, old, None, t(ADV), t(MASK), loss_type="dapo", epsilon=0.2)
    loss.backward()
    # clipped: (0,1) r=1.3 A>0, (1,1) r=0.75 A<0, (2,0) r=1.25 A>0 -> 0.
    # (0,2) r=0.7 with A>0 is below the range but min picks the unclipped r·A: gradient -A·r/9.
    expected = [
        [-1.1 / 9, 0.0, -0.7 / 9, 0.0],
        [0.5 * 0.9 / 9, 0.0, 0.0, 0.0],
        [0.0, -2 * 1.0 / 9, -2 * 0.85 / 9, -2 * 1.15 / 9],
    ]
    close(logprobs.grad, expected)


# ------------------------------------------------------------------------------------ on-policy (PR #2565)


@pytest.mark.parametrize(
    "loss_type, norm",
    [
        ("grpo", [[3 * 3] * 4, [2 * 3] * 4, [4 * 3] * 4]),  # len_i · N
        ("bnpo", [[9] * 4] * 3),
        ("dr_grpo", [[3 * 4] * 4] * 3),  # N · max_completion_length
        ("dapo", [[9] * 4] * 3),
    ],
)
@pytest.mark.parametrize("adv", [[1.0, -0.5, 2.0], [-1.5, -0.25, -3.0]])
def test_on_policy_value_and_policy_gradient(loss_type, norm, adv):
    logprobs, _ = make_inputs()
    mask = t(MASK)
    kw = {"max_completion_length": 4} if loss_type == "dr_grpo" else {}
    loss, stats = policy_loss(logprobs, None, None, t(adv), mask, loss_type=loss_type, **kw)
    # ratio = exp(logp - logp.detach()) = 1 in value: per-token loss -A_i, aggregated
    if loss_type == "grpo":
        expected = -sum(adv) / 3
    elif loss_type == "dr_grpo":
        expected = -sum(a * n for a, n in zip(adv, LENGTHS)) / 12
    else:
        expected = -sum(a * n for a, n in zip(adv, LENGTHS)) / 9
    close(loss, expected)
    close(stats.ratio_mean, 1.0)
    close(stats.objective["clip_ratio/region_mean"], 0.0)
    loss.backward()
    # the policy gradient: d loss / d logp = -A · mask / normaliser
    grad = [[-adv[i] * MASK[i][j] / norm[i][j] for j in range(4)] for i in range(3)]
    close(logprobs.grad, grad)


@pytest.mark.parametrize("adv", [[1.0, -1.0, 0.5, -0.5], [-2.0, 2.0, -0.1, 0.1]])
def test_on_policy_value_is_beta_kl_with_zero_mean_advantages(adv):
    # TRL PR #2565: with old = logp.detach() the value of the clipped term is -A per token; with group-centred
    # advantages and the sequence mean (grpo) it cancels, so the loss VALUE is beta·KL -- but the gradient is
    # still the policy gradient -A/(len·N) plus beta's KL gradient.
    beta = 0.1
    mask_rows = [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    lens = [3, 1, 2, 3]
    d = [[0.2, -0.1, 0.4], [0.3, 5.0, 5.0], [-0.2, 0.1, 5.0], [0.0, 0.5, -0.5]]
    logprobs = t([[-1.0, -0.5, -2.0], [-0.3, -0.7, -0.9], [-1.2, -0.1, -0.6], [-0.8, -0.4, -1.5]]).requires_grad_(True)
    ref = logprobs.detach() + t(d)
    loss, stats = policy_loss(
        logprobs, None, ref, t(adv), t(mask_rows), loss_type="grpo", beta=beta, use_bias_correction_kl=False
    )
    kl_means = [sum(k3(d[i][j]) for j in range(lens[i])) / lens[i] for i in range(4)]
    close(loss, beta * sum(kl_means) / 4)
    close(stats.kl, sum(k3(d[i][j]) for i in range(4) for j in range(lens[i])) / 9)
    loss.backward()
    grad = [
        [(-adv[i] + beta * (1 - math.exp(d[i][j]))) / (lens[i] * 4) if j < lens[i] else 0.0 for j in range(3)]
        for i in range(4)
    ]
    close(logprobs.grad, grad)


# ------------------------------------------------------------------------- delta, entropy, weights, per-token A


def test_delta_two_sided_clipping():
    # N = 2, T = 3; seq 0 (A=-1): r = 3, 1.1, 0.5 ; seq 1 (A=+1): r = 2, 1.3, [pad 4]
    ratios = [[3.0, 1.1, 0.5], [2.0, 1.3, 4.0]]
    old = [[-1.0, -2.0, -0.5], [-0.3, -0.6, -0.9]]
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv = t([-1.0, 1.0])
    logprobs, old_t = make_inputs(ratios, old)
    # without delta: seq 0: -min(-3, -1.2) = 3 ; -min(-1.1,-1.1) = 1.1 ; -min(-0.5, -0.8) = 0.8 -> 4.9
    #                seq 1: -min(2, 1.2) = -1.2 ; -min(1.3, 1.2) = -1.2                        -> -2.4
    plain, _ = policy_loss(logprobs, old_t, None, adv, mask, loss_type="dapo", epsilon=0.2)
    close(plain, (4.9 - 2.4) / 5)
    # delta = 1.25 caps the unclipped ratio: (0,0): -min(-1.25, -1.2) = 1.25 ; A > 0 tokens unchanged
    capped, _ = policy_loss(logprobs, old_t, None, adv, mask, loss_type="dapo", epsilon=0.2, delta=1.25)
    close(capped, (1.25 + 1.1 + 0.8 - 2.4) / 5)
    capped.backward()
    # (0,0) capped -> 0; (0,1) unclipped -> -A·r/5 = 1.1/5; (0,2) clipped (A<0, r<0.8) -> 0; seq 1 clipped -> 0
    close(logprobs.grad, [[0.0, 1.1 / 5, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_entropy_bonus(loss_type):
    coef = 0.01
    logprobs, old = make_inputs()
    ent_rows = [[0.5, 1.0, 1.5, 40.0], [2.0, 0.2, 40.0, 40.0], [0.1, 0.3, 0.6, 1.0]]
    entropies = t(ent_rows).requires_grad_(True)
    loss, stats = policy_loss(
        logprobs,
        old,
        None,
        t(ADV),
        t(MASK),
        loss_type=loss_type,
        entropies=entropies,
        entropy_coef=coef,
        entropy_normalization="loss_type",
    )
    ent_sums = [sum(row[:n]) for row, n in zip(ent_rows, LENGTHS)]  # 3.0, 2.2, 2.0
    if loss_type == "grpo":
        expected = sum((s - coef * e) / n for s, e, n in zip(SEQ_SUMS, ent_sums, LENGTHS)) / 3
    else:
        expected = (TOTAL - coef * sum(ent_sums)) / 9
    close(loss, expected)
    close(stats.entropy, sum(ent_sums) / 9)
    assert stats.as_dict()["entropy"] == pytest.approx(7.2 / 9, abs=ATOL)
    loss.backward()
    norm = [n * 3 for n in LENGTHS] if loss_type == "grpo" else [9] * 3
    close(entropies.grad, [[-coef * MASK[i][j] / norm[i] for j in range(4)] for i in range(3)])


def test_entropies_without_coef_only_logged():
    logprobs, old = make_inputs()
    entropies = t([[0.5, 1.0, 1.5, 40.0], [2.0, 0.2, 40.0, 40.0], [0.1, 0.3, 0.6, 1.0]])
    loss, stats = policy_loss(logprobs, old, None, t(ADV), t(MASK), entropies=entropies)
    close(loss, TOTAL / 9)
    close(stats.entropy, 7.2 / 9)


def test_loss_weights_apply_to_policy_term_only():
    beta = 0.5
    logprobs, old = make_inputs()
    ref = ref_from(logprobs)
    weights = t([[1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 0, 0]])
    loss, _ = policy_loss(
        logprobs,
        old,
        ref,
        t(ADV),
        t(MASK),
        loss_type="dapo",
        beta=beta,
        loss_weights=weights,
        use_bias_correction_kl=False,
    )
    # policy term of the kept tokens: seq 0: -1.1 - 0.7 ; seq 1: 0.4 ; seq 2: -2.4 - 2.0  -> -5.8
    # KL on every masked token, weighted or not; the denominator is still the 9 mask tokens
    kl_total = sum(k3(REF_MINUS_LOGP[i][j]) for i in range(3) for j in range(LENGTHS[i]))
    close(loss, (-5.8 + beta * kl_total) / 9)


def test_per_token_advantages():
    logprobs, old = make_inputs()
    adv = t([[1.0, -1.0, 0.5, 7.0], [2.0, -0.5, 7.0, 7.0], [0.5, 1.0, -1.0, -2.0]])
    loss, stats = policy_loss(logprobs, old, None, adv, t(MASK), loss_type="grpo", epsilon=0.2)
    # seq 0: r=1.1,A=1 -> -1.1 ; r=1.3,A=-1 -> -min(-1.3,-1.2) = 1.3 ; r=0.7,A=.5 -> -min(.35,.4) = -0.35
    # seq 1: r=0.9,A=2 -> -1.8 ; r=0.75,A=-.5 -> 0.4
    # seq 2: r=1.25,A=.5 -> -min(.625,.6) = -0.6 ; r=1,A=1 -> -1 ; r=.85,A=-1 -> 0.85 ; r=1.15,A=-2 -> 2.3
    close(loss, ((-1.1 + 1.3 - 0.35) / 3 + (-1.8 + 0.4) / 2 + (-0.6 - 1.0 + 0.85 + 2.3) / 4) / 3)
    # low: (1,1) r=.75 A<0 ; high: (2,0) r=1.25 A>0 [(0,1) r=1.3 has A<0 now]
    close(stats.objective["clip_ratio/low_mean"], 1 / 9)
    close(stats.objective["clip_ratio/high_mean"], 1 / 9)
    close(stats.objective["clip_ratio/region_mean"], 2 / 9)


def test_per_token_advantages_equal_to_broadcast_sequence_advantages():
    logprobs, old = make_inputs()
    adv_tok = t(ADV)[:, None].expand(3, 4).contiguous()
    loss_tok, _ = policy_loss(logprobs, old, None, adv_tok, t(MASK), loss_type="grpo")
    close(loss_tok, (-1.0 + 0.425 - 2.1) / 3)


# ------------------------------------------------------------------------------------ gradient accumulation

# 6 sequences, T = 5, ragged lengths 5, 1, 3, 4, 2, 5 (20 tokens). Hand-picked log-ratios so that several
# tokens fall outside [0.8, 1.2] with each sign of A.
GA_MASK = [
    [1, 1, 1, 1, 1],
    [1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0],
    [1, 1, 1, 1, 0],
    [1, 1, 0, 0, 0],
    [1, 1, 1, 1, 1],
]
GA_LOG_RATIO = [
    [0.05, 0.3, -0.4, 0.1, -0.02],
    [0.25, 1.0, 1.0, 1.0, 1.0],
    [-0.3, 0.02, 0.15, 2.0, 2.0],
    [0.4, -0.1, 0.0, -0.25, 2.0],
    [-0.05, 0.22, 2.0, 2.0, 2.0],
    [0.1, -0.35, 0.3, 0.01, -0.15],
]
GA_OLD = [[-0.1 * (i + j + 1) for j in range(5)] for i in range(6)]
GA_REF_D = [[0.1 * ((i * 5 + j) % 7) - 0.3 for j in range(5)] for i in range(6)]
GA_ADV = [1.2, -0.7, 0.4, -1.5, 2.0, -0.3]


def _ga_call(logprobs, rows, loss_type, **kw):
    idx = torch.tensor(rows)
    old = t(GA_OLD)[idx]
    ref = (t(GA_OLD) + t(GA_LOG_RATIO) + t(GA_REF_D))[idx]
    return policy_loss(
        logprobs[idx],
        old,
        ref,
        t(GA_ADV)[idx],
        t(GA_MASK)[idx],
        loss_type=loss_type,
        beta=0.05,
        epsilon=0.2,
        epsilon_high=0.28,
        use_bias_correction_kl=False,
        **kw,
    )[0]


def _ga_leaf():
    return (t(GA_OLD) + t(GA_LOG_RATIO)).requires_grad_(True)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("split", [[[0, 1], [2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]], [[4, 0], [5, 2, 1, 3]]])
def test_gradient_accumulation_invariant(loss_type, split):
    counts = {"num_sequences": 6, "num_tokens": 20, "max_completion_length": 7}
    whole_lp = _ga_leaf()
    whole = _ga_call(whole_lp, list(range(6)), loss_type, **counts)
    whole.backward()

    micro_lp = _ga_leaf()
    total = sum(_ga_call(micro_lp, rows, loss_type, **counts) for rows in split)
    total.backward()

    close(total, whole.detach())
    close(micro_lp.grad, whole_lp.grad)
    # sanity: the gradient is not trivially zero
    assert whole_lp.grad.abs().sum() > 0.1


def test_gradient_accumulation_whole_batch_defaults_match_explicit_counts():
    for loss_type, kw in [
        ("grpo", {"num_sequences": 6}),
        ("dapo", {"num_tokens": 20}),
        ("dr_grpo", {"num_sequences": 6, "max_completion_length": 5}),
    ]:
        lp = _ga_leaf()
        close(_ga_call(lp, list(range(6)), loss_type), _ga_call(lp, list(range(6)), loss_type, **kw))


@pytest.mark.parametrize("split", [[[0, 1], [2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]]])
def test_bnpo_depends_on_the_split(split):
    counts = {"num_sequences": 6, "num_tokens": 20, "max_completion_length": 5}
    whole_lp = _ga_leaf()
    whole = _ga_call(whole_lp, list(range(6)), "bnpo", **counts)
    whole.backward()
    micro_lp = _ga_leaf()
    total = sum(_ga_call(micro_lp, rows, "bnpo", **counts) for rows in split)
    total.backward()
    assert abs(total.item() - whole.item()) > 1e-3
    assert (micro_lp.grad - whole_lp.grad).abs().max() > 1e-3


@pytest.mark.parametrize("split", [[[0, 1], [2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]]])
def test_bnpo_micro_batch_is_its_own_token_mean(split):
    # On-policy, beta = 0: the per-token value is -A_i, so a micro-batch's bnpo loss is
    # -sum_i A_i·len_i / sum_i len_i over ITS sequences, whatever whole-batch counts are passed.
    lens = [sum(r) for r in GA_MASK]
    lp = _ga_leaf()
    for rows in split:
        idx = torch.tensor(rows)
        loss, _ = policy_loss(
            lp[idx], None, None, t(GA_ADV)[idx], t(GA_MASK)[idx], loss_type="bnpo", num_sequences=6, num_tokens=20
        )
        expected = -sum(GA_ADV[i] * lens[i] for i in rows) / sum(lens[i] for i in rows)
        close(loss, expected)


# ----------------------------------------------------------------------------------- selective log-softmax


def test_selective_log_softmax_hand_example():
    logits = t([[1.0, 2.0, 3.0]])
    lse = math.log(math.e + math.e**2 + math.e**3)  # 3.40760596
    close(selective_log_softmax(logits, torch.tensor([2])), [3.0 - lse])
    close(selective_log_softmax(logits, torch.tensor([0])), [1.0 - lse])
    close(selective_log_softmax(logits.float(), torch.tensor([1])), [2.0 - lse], atol=ATOL32)
    assert abs((3.0 - lse) - (-0.40760596)) < 1e-7


# (dtype, atol, rtol) against the same-dtype log_softmax + gather, and against a float64 reference computed
# from the same (already rounded) logits. bf16 keeps 8 significant bits (~0.4 % relative), fp16 11 bits.
DTYPE_TOLS = [
    (torch.float64, 1e-12, 0.0, 1e-12, 0.0),
    (torch.float32, 1e-5, 0.0, 1e-5, 0.0),
    (torch.bfloat16, 0.05, 0.0, 0.05, 1e-2),
    (torch.float16, 5e-3, 0.0, 5e-3, 2e-3),
]


@pytest.mark.parametrize("dtype, atol_same, rtol_same, atol_64, rtol_64", DTYPE_TOLS)
@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 1024])
def test_selective_log_softmax_matches_log_softmax(dtype, atol_same, rtol_same, atol_64, rtol_64, chunk_rows):
    gen = torch.Generator().manual_seed(0)
    N, T, V = 3, 5, 11  # 15 rows: chunk sizes 1, 4, 7 split them unevenly
    logits = (torch.randn(N, T, V, generator=gen, dtype=F64) * 3).to(dtype)
    index = torch.randint(0, V, (N, T), generator=gen)
    out = selective_log_softmax(logits, index, chunk_rows=chunk_rows)
    assert out.shape == (N, T) and out.dtype == dtype
    same = torch.log_softmax(logits, -1).gather(-1, index[..., None]).squeeze(-1)
    torch.testing.assert_close(out, same, atol=atol_same, rtol=rtol_same)
    ref64 = torch.log_softmax(logits.double(), -1).gather(-1, index[..., None]).squeeze(-1)
    torch.testing.assert_close(out.double(), ref64, atol=atol_64, rtol=rtol_64)
    assert (out.double() <= 1e-6 + atol_64).all()


def test_selective_log_softmax_chunking_row_order():
    # every row has a distinct answer; a chunk written to the wrong place would be caught
    V = 4
    logits = torch.zeros(2, 3, V, dtype=F64)
    index = torch.zeros(2, 3, dtype=torch.long)
    expected = []
    for k in range(6):
        logits.view(-1, V)[k, 0] = float(k)  # logits (k, 0, 0, 0), index 0 -> k - log(e^k + 3)
        expected.append(k - math.log(math.exp(k) + 3))
    out = selective_log_softmax(logits, index, chunk_rows=4)
    close(out, t(expected).view(2, 3))


def test_selective_log_softmax_gradient():
    # d/dz_v [z_i - lse(z)] = 1[v = i] - softmax(z)_v
    logits = t([[1.0, 2.0, 3.0]]).requires_grad_(True)
    out = selective_log_softmax(logits, torch.tensor([1]), chunk_rows=1)
    out.sum().backward()
    z = sum(math.exp(v) for v in (1.0, 2.0, 3.0))
    close(logits.grad, [[-math.e / z, 1 - math.e**2 / z, -(math.e**3) / z]])


# ---------------------------------------------------------------------------------------------- validation


def test_invalid_loss_type_raises():
    logprobs, old = make_inputs()
    with pytest.raises(ValueError, match="'grpoo'"):
        policy_loss(logprobs, old, None, t(ADV), t(MASK), loss_type="grpoo")
    with pytest.raises(ValueError, match="'mean'"):
        aggregate(t([[1.0]]), t([[1.0]]), "mean")


def test_invalid_importance_sampling_level_raises():
    logprobs, old = make_inputs()
    with pytest.raises(ValueError, match="'sentence'"):
        policy_loss(logprobs, old, None, t(ADV), t(MASK), importance_sampling_level="sentence")


def test_selective_log_softmax_upcasts_chunk_by_chunk():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 7, 50, generator=gen) * 3).to(torch.bfloat16)
    index = torch.randint(0, 50, (5, 7), generator=gen)
    out = selective_log_softmax(logits, index, chunk_rows=4, dtype=torch.float32)
    expected = torch.log_softmax(logits.float(), -1).gather(-1, index[..., None]).squeeze(-1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------- settings, objective, aggregation


def test_settings_object_keywords_and_the_two_steps_give_one_loss():
    """`policy_loss(settings=...)`, `policy_loss(**fields)` and `token_loss` then `aggregate_token_loss` are one
    computation: equal to the last bit, and equal to the hand value (clipped surrogate + beta·k3, grpo)."""
    beta = 0.04
    logprobs, old = make_inputs()
    ref = ref_from(logprobs)
    values = {"loss_type": "grpo", "beta": beta, "epsilon": 0.2, "use_bias_correction_kl": False}
    settings = PolicyLossSettings(**values)
    by_object, _ = policy_loss(logprobs, old, ref, t(ADV), t(MASK), settings=settings)
    by_keywords, _ = policy_loss(logprobs, old, ref, t(ADV), t(MASK), **values)
    two_steps, policy_part = aggregate_token_loss(token_loss(logprobs, old, ref, t(ADV), t(MASK), settings), settings)
    assert torch.equal(by_object, by_keywords) and torch.equal(by_object, two_steps) and policy_part is None
    kl_rows = [[k3(d) for d, keep in zip(row, m) if keep] for row, m in zip(REF_MINUS_LOGP, MASK)]
    close(by_object, sum((s + beta * sum(k)) / n for s, k, n in zip(SEQ_SUMS, kl_rows, LENGTHS)) / 3)


def test_settings_are_given_one_way_and_checked_when_made():
    logprobs, old = make_inputs()
    args = (logprobs, old, None, t(ADV), t(MASK))
    with pytest.raises(TypeError, match="one way"):
        policy_loss(*args, settings=PolicyLossSettings(), beta=0.1)
    with pytest.raises(TypeError, match="'betta'"):
        policy_loss(*args, betta=0.1)
    with pytest.raises(ValueError, match="'mean'"):
        PolicyLossSettings(entropy_normalization="mean")
    with pytest.raises(ValueError, match="not defined for loss_type='vespo'"):
        PolicyLossSettings(loss_type="vespo", off_policy_correction="decoupled")
