"""`off_policy_correction` (grpokit.loss.behaviour_weight, policy_loss): "decoupled", AReaL's decoupled PPO, against
hand-computed float64 numbers, value and gradient; "behaviour" is the loss as it was; the configuration refuses what
is not defined by name; an asynchronous run on the letter task trains with it and logs what it does.

Every expected number is written out with plain Python arithmetic from the formula (Fu et al. 2025, arXiv 2505.24298
eq. 5): per token -w·A·min(r, clip(r, 1-ε, 1+ε_high)), r = π_θ/π_prox = 1 in value (π_prox is the forward's own
log-probs, detached), w = π_prox/π_behav, 0 where w > cap; the gradient of each token's term is -w·A times the
aggregation's weight of that token.
"""

from __future__ import annotations

import math

import pytest
import torch
from letters import letter_config, letter_dataset, repeat_letter, tiny_letter_model

from grpokit import GRPOConfig, GRPOTrainer, policy_loss
from grpokit.loss import LOSS_TYPES, behaviour_weight

F64 = torch.float64
TOL = 1e-12

# N = 3 completions, T = 4 tokens, lengths 3, 4, 2 (9 loss tokens). LOG_WEIGHTS = log π_prox - log π_behav, chosen
# directly; behaviour = logprobs - LOG_WEIGHTS. Padding carries NaN behaviour log-probs (an engine may report NaN
# there), so a padded token that reached the weight would turn the loss into NaN.
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
LENGTHS = [3, 4, 2]
LOGPROBS = [[-0.5, -1.0, -0.2, -2.0], [-0.3, -0.8, -1.5, -0.1], [-1.2, -0.4, -0.9, -0.7]]
NAN = float("nan")
LOG_WEIGHTS = [[0.1, 1.0, -0.5, NAN], [-0.2, 0.3, 0.9, -1.0], [0.5, -0.3, NAN, NAN]]
ADV = [1.5, -0.7, 0.4]  # mixed signs
CAP = 2.0  # e^1.0 = 2.718 (sequence 0, token 1) and e^0.9 = 2.460 (sequence 1, token 2) are dropped

# The weights after the cap, by hand: e^x, or 0 above the cap; padding 0 (it has no share in the loss).
KEPT = [
    [math.exp(0.1), 0.0, math.exp(-0.5), 0.0],
    [math.exp(-0.2), math.exp(0.3), 0.0, math.exp(-1.0)],
    [math.exp(0.5), math.exp(-0.3), 0.0, 0.0],
]
RAW_MEAN = sum(math.exp(x) for row, m in zip(LOG_WEIGHTS, MASK) for x, on in zip(row, m) if on) / 9


def inputs():
    logprobs = torch.tensor(LOGPROBS, dtype=F64, requires_grad=True)
    behaviour = torch.tensor(LOGPROBS, dtype=F64) - torch.tensor(LOG_WEIGHTS, dtype=F64)
    return logprobs, behaviour, torch.tensor(ADV, dtype=F64), torch.tensor(MASK, dtype=F64)


def decoupled(loss_type="dapo", **kwargs):
    logprobs, behaviour, advantages, mask = inputs()
    loss, stats = policy_loss(
        logprobs,
        behaviour,
        None,
        advantages,
        mask,
        loss_type=loss_type,
        off_policy_correction="decoupled",
        off_policy_correction_cap=CAP,
        **kwargs,
    )
    loss.backward()
    return loss.item(), logprobs.grad, stats


def assert_close(actual, expected):
    expected = torch.tensor(expected, dtype=F64)
    assert actual.shape == expected.shape
    assert torch.allclose(actual, expected, atol=TOL, rtol=0), f"\nactual   {actual}\nexpected {expected}"


def per_token(function):
    """[[function(i, t) for each token t] for each sequence i], 0 on padding."""
    return [[function(i, t) if MASK[i][t] else 0.0 for t in range(4)] for i in range(3)]


# ------------------------------------------------------------------------------------------- the objective


def test_decoupled_dapo_value_and_gradient():
    """dapo: the token sum over the 9 tokens. Value: sum -w'·A / 9; gradient -w'·A / 9."""
    loss, grad, stats = decoupled("dapo")
    expected = sum(-KEPT[i][t] * ADV[i] for i in range(3) for t in range(4)) / 9
    # written out: -(1.5 (e^0.1 + e^-0.5) - 0.7 (e^-0.2 + e^0.3 + e^-1) + 0.4 (e^0.5 + e^-0.3)) / 9
    assert math.isclose(
        expected,
        -(
            1.5 * (math.exp(0.1) + math.exp(-0.5))
            - 0.7 * (math.exp(-0.2) + math.exp(0.3) + math.exp(-1.0))
            + 0.4 * (math.exp(0.5) + math.exp(-0.3))
        )
        / 9,
        abs_tol=1e-15,
    )
    assert abs(loss - expected) < TOL
    assert_close(grad, per_token(lambda i, t: -KEPT[i][t] * ADV[i] / 9))
    objective = stats.as_dict()
    assert abs(objective["off_policy/behaviour_weight_mean"] - RAW_MEAN) < TOL
    assert abs(objective["off_policy/masked_fraction"] - 2 / 9) < TOL
    assert objective["clip_ratio/region_mean"] == 0.0  # the clip acts around π_prox: r = 1, nothing is clipped
    assert stats.ratio_mean.item() == 1.0


def test_decoupled_grpo_value_and_gradient():
    """grpo: the mean over sequences of each sequence's token mean: weight 1 / (3 · length) per token."""
    loss, grad, _ = decoupled("grpo")
    expected = sum(sum(-KEPT[i][t] * ADV[i] for t in range(4)) / LENGTHS[i] for i in range(3)) / 3
    assert abs(loss - expected) < TOL
    assert_close(grad, per_token(lambda i, t: -KEPT[i][t] * ADV[i] / (3 * LENGTHS[i])))


def test_decoupled_sapo_value_and_gradient():
    """sapo around π_prox: f_τ(1) = σ(0)·4/τ = 2/τ in value (τ = 1 for A > 0, 1.05 for A < 0) and f_τ'(1) = 1, so the
    gradient is the clipped family's; aggregated as grpo."""
    loss, grad, stats = decoupled("sapo")
    tau = [1.0, 1.05, 1.0]
    expected = sum(sum(-KEPT[i][t] * ADV[i] * 2 / tau[i] for t in range(4)) / LENGTHS[i] for i in range(3)) / 3
    assert abs(loss - expected) < TOL
    assert_close(grad, per_token(lambda i, t: -KEPT[i][t] * ADV[i] / (3 * LENGTHS[i])))
    assert abs(stats.as_dict()["off_policy/masked_fraction"] - 2 / 9) < TOL


def test_decoupled_cispo_value_and_gradient():
    """cispo (epsilon_high 5, ScaleRL's): -sg(min(r, 5))·A·logp·w' = -A·logp·w' in value; gradient -A·w' / 9."""
    loss, grad, _ = decoupled("cispo", epsilon_high=5.0)
    expected = sum(-KEPT[i][t] * ADV[i] * LOGPROBS[i][t] for i in range(3) for t in range(4)) / 9
    assert abs(loss - expected) < TOL
    assert_close(grad, per_token(lambda i, t: -KEPT[i][t] * ADV[i] / 9))


def test_decoupled_at_sequence_level_weighs_each_sequence_by_its_mean_log_weight():
    """GSPO (grpo, importance_sampling_level 'sequence'): one weight per sequence, exp of the mean log-weight over its
    tokens: e^0.2 = 1.221, e^0 = 1, e^0.1 = 1.105; with cap 1.15 sequence 0 is dropped (its 3 tokens: 3/9). Each
    sequence's loss -w·A·r, r = exp(mean (logp - sg(logp))): gradient -w·A / (3 · length) on each of its tokens."""
    logprobs, behaviour, advantages, mask = inputs()
    loss, stats = policy_loss(
        logprobs,
        behaviour,
        None,
        advantages,
        mask,
        loss_type="grpo",
        importance_sampling_level="sequence",
        off_policy_correction="decoupled",
        off_policy_correction_cap=1.15,
    )
    loss.backward()
    weights = [0.0, 1.0, math.exp(0.1)]
    expected = sum(-weights[i] * ADV[i] for i in range(3)) / 3
    assert abs(loss.item() - expected) < TOL
    assert_close(logprobs.grad, per_token(lambda i, t: -weights[i] * ADV[i] / (3 * LENGTHS[i])))
    objective = stats.as_dict()
    assert abs(objective["off_policy/behaviour_weight_mean"] - (3 * math.exp(0.2) + 4 + 2 * math.exp(0.1)) / 9) < TOL
    assert abs(objective["off_policy/masked_fraction"] - 3 / 9) < TOL


def test_decoupled_kl_term_is_not_weighted_and_its_ratio_is_to_the_proximal_policy():
    """dapo with beta 0.1 and the bias-corrected KL: + beta·r·k3 per token, r = π_θ/π_prox = 1 in value, not weighted
    by w (as in AReaL); its gradient beta·(k3 + 1 - e^d), d = ref - logp."""
    logprobs, behaviour, advantages, mask = inputs()
    d = [[0.2, -0.1, 0.3, 5.0], [0.0, 0.4, -0.2, 0.1], [-0.3, 0.25, 5.0, 5.0]]
    reference = logprobs.detach() + torch.tensor(d, dtype=F64)
    loss, stats = policy_loss(
        logprobs,
        behaviour,
        reference,
        advantages,
        mask,
        loss_type="dapo",
        beta=0.1,
        use_bias_correction_kl=True,
        off_policy_correction="decoupled",
        off_policy_correction_cap=CAP,
    )
    loss.backward()
    k3 = [[math.exp(x) - x - 1 for x in row] for row in d]
    expected = sum((-KEPT[i][t] * ADV[i] + 0.1 * k3[i][t]) * MASK[i][t] for i in range(3) for t in range(4)) / 9
    assert abs(loss.item() - expected) < TOL
    assert_close(
        logprobs.grad, per_token(lambda i, t: (-KEPT[i][t] * ADV[i] + 0.1 * (k3[i][t] + 1 - math.exp(d[i][t]))) / 9)
    )
    assert abs(stats.kl.item() - sum(k3[i][t] * MASK[i][t] for i in range(3) for t in range(4)) / 9) < TOL


def test_decoupled_composes_with_the_sampling_correction_as_a_product():
    """With the vLLM correction s = π_behav/π_sampler (a token mode), each token's weight is s·w' = π_prox/π_sampler,
    each factor cut by its own rule."""
    logprobs, behaviour, advantages, mask = inputs()
    s = [[0.5, 3.0, 1.2, 7.0], [1.0, 0.8, 2.0, 1.5], [0.9, 1.1, 7.0, 7.0]]
    loss, _ = policy_loss(
        logprobs,
        behaviour,
        None,
        advantages,
        mask,
        loss_type="dapo",
        sampling_ratio=torch.tensor(s, dtype=F64),
        off_policy_correction="decoupled",
        off_policy_correction_cap=CAP,
    )
    loss.backward()
    expected = sum(-s[i][t] * KEPT[i][t] * ADV[i] for i in range(3) for t in range(4)) / 9
    assert abs(loss.item() - expected) < TOL
    assert_close(logprobs.grad, per_token(lambda i, t: -s[i][t] * KEPT[i][t] * ADV[i] / 9))


def test_behaviour_weight_without_a_cap_keeps_every_token():
    _, behaviour, _, mask = inputs()
    weight, stats = behaviour_weight(torch.tensor(LOGPROBS, dtype=F64), behaviour, mask, cap=None)
    assert_close(weight * mask, per_token(lambda i, t: math.exp(LOG_WEIGHTS[i][t])))
    assert stats["off_policy/masked_fraction"].item() == 0.0


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_behaviour_is_the_loss_as_it_was_and_decoupled_on_policy_is_the_same_loss(loss_type):
    """The default is "behaviour": naming it changes no bit of the loss, its gradient or its statistics. On-policy
    (no old_logprobs) every "decoupled" weight is exp(0) = 1 exactly: the same loss, bitwise, plus the two metrics."""
    generator = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(3, 4, generator=generator, dtype=F64) * 2
    old = logprobs + torch.randn(3, 4, generator=generator, dtype=F64) * 0.3
    advantages, mask = torch.tensor(ADV, dtype=F64), torch.tensor(MASK, dtype=F64)

    def run(old_logprobs, **kwargs):
        leaf = logprobs.clone().requires_grad_(True)
        loss, stats = policy_loss(leaf, old_logprobs, None, advantages, mask, loss_type=loss_type, **kwargs)
        loss.backward()
        return loss, leaf.grad, stats.as_dict()

    default, named = run(old), run(old, off_policy_correction="behaviour")
    assert torch.equal(default[0], named[0]) and torch.equal(default[1], named[1]) and default[2] == named[2]
    assert not any(key.startswith("off_policy/") for key in named[2])
    if not LOSS_TYPES[loss_type].decoupled_correction:
        return
    on_policy, decoupled_on_policy = run(None), run(None, off_policy_correction="decoupled")
    assert torch.equal(on_policy[0], decoupled_on_policy[0]) and torch.equal(on_policy[1], decoupled_on_policy[1])
    assert decoupled_on_policy[2] == {
        **on_policy[2],
        "off_policy/behaviour_weight_mean": 1.0,
        "off_policy/masked_fraction": 0.0,
    }


def test_policy_loss_refuses_what_is_not_defined():
    logprobs, behaviour, advantages, mask = inputs()
    with pytest.raises(ValueError, match="Unknown off_policy_correction 'proximal'; choose one of"):
        policy_loss(logprobs, behaviour, None, advantages, mask, off_policy_correction="proximal")
    with pytest.raises(ValueError, match="not defined for loss_type='vespo'"):
        policy_loss(logprobs, behaviour, None, advantages, mask, loss_type="vespo", off_policy_correction="decoupled")


# ------------------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"off_policy_correction": "proximal"},
            r"off_policy_correction='proximal' is not valid; use one of \['behaviour', 'decoupled'\]",
        ),
        ({"off_policy_correction_cap": 1.0}, r"off_policy_correction_cap=1.0 must be > 1"),
        (
            {"off_policy_correction": "decoupled", "num_iterations": 2},
            r"off_policy_correction='decoupled' needs num_iterations=1 \(got 2\)",
        ),
        (
            {"off_policy_correction": "decoupled", "loss_type": "vespo"},
            r"off_policy_correction='decoupled' is not defined for loss_type='vespo'",
        ),
    ],
)
def test_the_configuration_refuses_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(report_to="none", **overrides)


def test_the_configuration_passes_the_correction_to_the_loss():
    args = GRPOConfig(
        report_to="none",
        off_policy_correction="decoupled",
        off_policy_correction_cap=None,
        max_staleness=2,
        loss_type="grpo",
        importance_sampling_level="sequence",
    )
    options = args.objective_options()
    assert options["off_policy_correction"] == "decoupled" and options["off_policy_correction_cap"] is None
    assert GRPOConfig(report_to="none").objective_options()["off_policy_correction"] == "behaviour"


# ------------------------------------------------------------------------------------------- end to end


def letter_run(tmp_path, **overrides):
    model, tokenizer = tiny_letter_model()
    values = {"per_device_train_batch_size": 16, "num_generations": 4, "max_steps": 6, "report_to": "none"}
    args = letter_config(tmp_path, **{**values, **overrides})
    trainer = GRPOTrainer(
        model=model, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset(), processing_class=tokenizer
    )
    trainer.train()
    return trainer, [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]


def test_at_staleness_zero_the_weight_is_exactly_one_and_the_run_is_the_behaviour_run(tmp_path):
    """max_staleness=0 trains each batch at the weights that sampled it: w = 1 exactly, nothing is dropped, and the
    run is the "behaviour" run bitwise. Each step logs its clip ratio under its batch's staleness, 0."""
    behaviour_trainer, _ = letter_run(tmp_path / "behaviour", max_staleness=0, max_steps=3)
    trainer, records = letter_run(
        tmp_path / "decoupled", max_staleness=0, max_steps=3, off_policy_correction="decoupled"
    )
    assert len(records) == 3
    for record in records:
        assert record["off_policy/behaviour_weight_mean"] == 1.0 and record["off_policy/masked_fraction"] == 0.0
        assert record["clip_ratio/region_mean_staleness_0"] == record["clip_ratio/region_mean"] == 0.0
    for name, value in behaviour_trainer.unwrapped_model.state_dict().items():
        assert torch.equal(value, trainer.unwrapped_model.state_dict()[name]), name


def test_at_staleness_one_decoupled_trains_and_logs_what_it_does(tmp_path):
    """max_staleness=1: batches one step stale are weighted (not all by 1), the clip never acts (r = 1 around π_prox),
    each step's clip ratio is logged under its batch's staleness, and the reward rises from chance (1/8)."""
    _, records = letter_run(
        tmp_path,
        max_staleness=1,
        max_steps=24,
        off_policy_correction="decoupled",
        per_device_train_batch_size=64,
        num_generations=8,
    )
    assert len(records) == 24
    for record in records:
        staleness = int(record["sample/staleness_max"])
        assert record[f"clip_ratio/region_mean_staleness_{staleness}"] == record["clip_ratio/region_mean"] == 0.0
        assert 0.0 <= record["off_policy/masked_fraction"] <= 1.0 and record["off_policy/behaviour_weight_mean"] > 0
    stale = [r for r in records if r["sample/staleness_max"] == 1]
    assert stale and any(r["off_policy/behaviour_weight_mean"] != 1.0 for r in stale)
    rewards = [r["reward"] for r in records]
    assert sum(rewards[:6]) / 6 < 0.2 and sum(rewards[-6:]) / 6 > sum(rewards[:6]) / 6 + 0.15, rewards


def test_without_a_cap_decoupled_is_the_behaviour_run_without_its_clip_bitwise(tmp_path):
    """With one optimizer step per batch π_prox is π_θ in value, so each token's "decoupled" gradient -w·A·∇logp,
    w = π_θ/π_behav, is the unclipped "behaviour" gradient -r·A·∇logp, r = π_θ/π_behav: with no cap the run is the
    "behaviour" run with its clip out of reach (epsilon 1e9), bitwise. This pins that the weight takes the behaviour
    policy's log-probs of each batch; with the clip in place the "behaviour" run differs (it clips at staleness 2)."""
    common = {"max_staleness": 2, "max_steps": 6, "async_schedule": "exact"}
    decoupled_run, records = letter_run(
        tmp_path / "decoupled", off_policy_correction="decoupled", off_policy_correction_cap=None, **common
    )
    unclipped_run, unclipped = letter_run(tmp_path / "unclipped", epsilon=1e9, **common)
    clipped_run, _ = letter_run(tmp_path / "clipped", **common)
    assert [r["sample/staleness_max"] for r in records] == [0, 1, 2, 2, 2, 2]
    assert any(r["off_policy/behaviour_weight_mean"] != 1.0 for r in records)
    assert [r["loss"] for r in records] == [r["loss"] for r in unclipped]
    weights = [run.unwrapped_model.state_dict() for run in (decoupled_run, unclipped_run, clipped_run)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert not all(torch.equal(weights[0][name], weights[2][name]) for name in weights[0])
