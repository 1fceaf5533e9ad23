"""The vLLM sampling correction (`grpokit.loss.sampling_correction`, TRL 1.16's `vllm_importance_sampling_*`):
its four modes against hand-computed tensors, its place in the loss, and the trainer using it with an engine whose
log-probs differ from the training forward's. No vLLM needed: the engine here is the in-process one with its
reported log-probs shifted by a known amount."""

from __future__ import annotations

import math

import pytest
import torch
from letters import letter_config, letter_dataset, repeat_letter, tiny_letter_model

from grpokit import GRPOTrainer, policy_loss
from grpokit.loss import sampling_correction, vespo_weights
from grpokit.rollout import HFEngine

F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


def close(actual, expected, atol=1e-9):
    actual, expected = torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), f"\nactual   {actual}\nexpected {expected}"


# N = 2, T = 3; row 0 has 2 real tokens. d = old - sampling per token: row 0 [0.5, -1.5, (padding 7.0: a leak of
# the padding would change every result)], row 1 [0.2, 1.0, -0.3].
MASK = [[1, 1, 0], [1, 1, 1]]
OLD = [[-1.0, -2.0, -5.0], [-0.5, -1.0, -1.5]]
DIFF = [[0.5, -1.5, 7.0], [0.2, 1.0, -0.3]]
SAMPLING = [[o - d for o, d in zip(orow, drow)] for orow, drow in zip(OLD, DIFF)]
e = math.exp


def correct(mode, **bounds):
    return sampling_correction(t(OLD), t(SAMPLING), t(MASK), mode=mode, **bounds)


def test_token_truncate():
    ratio, _ = correct("token_truncate", clip_min=0.5, clip_max=2.0)
    # e^0.5 = 1.6487 stays; e^-1.5 = 0.2231 -> 0.5; padding: d = 0 -> 1; e^1 = 2.718 -> 2
    close(ratio, [[e(0.5), 0.5, 1.0], [e(0.2), 2.0, e(-0.3)]])
    ratio, _ = correct("token_truncate")  # TRL's defaults: no lower bound, upper 3
    close(ratio, [[e(0.5), e(-1.5), 1.0], [e(0.2), e(1.0), e(-0.3)]])


def test_token_mask():
    ratio, stats = correct("token_mask", clip_min=0.5, clip_max=2.0)
    close(ratio, [[e(0.5), 0.0, 1.0], [e(0.2), 0.0, e(-0.3)]])
    # Metrics over the 5 real tokens: |d| = 0.5 1.5 0.2 1.0 0.3
    close(stats["sampling/sampling_logp_difference/mean"], 3.5 / 5)
    close(stats["sampling/sampling_logp_difference/max"], 1.5)
    close(stats["sampling/importance_sampling_ratio/min"], 0.0)
    close(stats["sampling/importance_sampling_ratio/mean"], (e(0.5) + e(0.2) + e(-0.3)) / 5)
    close(stats["sampling/importance_sampling_ratio/max"], e(0.5))


def test_sequence_truncate_sums_the_differences():
    # row sums: 0.5 - 1.5 = -1.0 ; 0.2 + 1.0 - 0.3 = 0.9  (a sum, not a mean)
    ratio, stats = correct("sequence_truncate")
    close(ratio, [[e(-1.0)], [e(0.9)]])
    ratio, stats = correct("sequence_truncate", clip_min=0.5, clip_max=2.0)
    close(ratio, [[0.5], [2.0]])
    close(stats["sampling/importance_sampling_ratio/min"], 0.5)
    close(stats["sampling/importance_sampling_ratio/mean"], 1.25)
    close(stats["sampling/importance_sampling_ratio/max"], 2.0)


def test_sequence_mask():
    close(correct("sequence_mask")[0], [[e(-1.0)], [e(0.9)]])  # defaults: (None, 3) keeps both
    close(correct("sequence_mask", clip_min=0.5, clip_max=2.0)[0], [[0.0], [0.0]])
    close(correct("sequence_mask", clip_min=0.5, clip_max=None)[0], [[0.0], [e(0.9)]])
    close(correct("sequence_mask", clip_min=None, clip_max=2.0)[0], [[e(-1.0)], [0.0]])


def test_nan_sampling_logprobs_count_as_no_difference_and_are_left_out_of_the_metrics():
    sampling = t(SAMPLING)
    sampling[1, 1] = float("nan")
    ratio, stats = sampling_correction(t(OLD), sampling, t(MASK), mode="token_truncate", clip_max=None)
    close(ratio, [[e(0.5), e(-1.5), 1.0], [e(0.2), 1.0, e(-0.3)]])
    close(stats["sampling/sampling_logp_difference/mean"], 2.5 / 4)  # 0.5 1.5 0.2 0.3
    close(stats["sampling/sampling_logp_difference/max"], 1.5)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode.*token_truncate"):
        correct("token_clip")


def test_empty_mask_gives_zero_metrics():
    _, stats = sampling_correction(t(OLD), t(SAMPLING), torch.zeros(2, 3), mode="token_mask")
    assert all(v.item() == 0.0 for v in stats.values())


# ------------------------------------------------------------------------------------------------- in the loss


def test_the_ratio_multiplies_the_policy_term_not_the_kl():
    """On-policy (ratio 1) dapo: per-token loss -A·w + beta·KL, token mean over 5 tokens."""
    logprobs = t(OLD).requires_grad_(True)
    ref = t(OLD) + t([[0.1, -0.2, 0.0], [0.3, 0.0, -0.1]])
    weight = t([[2.0, 0.5, 9.0], [1.0, 0.0, 3.0]])  # 9 on padding: must not leak
    advantages = t([1.0, -2.0])
    loss, _ = policy_loss(
        logprobs,
        None,
        ref,
        advantages,
        t(MASK),
        loss_type="dapo",
        beta=0.1,
        sampling_ratio=weight,
        use_bias_correction_kl=False,
    )
    kl = lambda d: e(d) - d - 1  # noqa: E731  (d = ref - logp)
    policy = -(1.0 * 2.0 + 1.0 * 0.5) - (-2.0) * (1.0 + 0.0 + 3.0)
    kls = kl(0.1) + kl(-0.2) + kl(0.3) + kl(0.0) + kl(-0.1)
    close(loss, (policy + 0.1 * kls) / 5)
    loss.backward()
    # d/dlogp of -A·w·exp(logp - sg(logp)) is -A·w at ratio 1; of k3, 1 - exp(ref - logp)
    expected_grad = [
        [(-2.0 + 0.1 * (1 - e(0.1))) / 5, (-0.5 + 0.1 * (1 - e(-0.2))) / 5, 0.0],
        [(2.0 + 0.1 * (1 - e(0.3))) / 5, (0.0 + 0.1 * (1 - e(0.0))) / 5, (6.0 + 0.1 * (1 - e(-0.1))) / 5],
    ]
    close(logprobs.grad, expected_grad)


def test_a_sequence_ratio_broadcasts_over_the_tokens():
    logprobs = t(OLD)
    advantages = t([1.0, 1.0])
    loss, _ = policy_loss(logprobs, None, None, advantages, t(MASK), loss_type="grpo", sampling_ratio=t([[0.5], [2.0]]))
    close(loss, (-0.5 + -2.0) / 2)  # mean over sequences of the token means of -A·w


def test_vespo_takes_the_ratio_into_its_sequence_weight():
    # on-policy: log w = sum_t clamp(log r_t, log 1e-8, 20) = 0.3 - 0.1; A >= 0: (k, λ) = (2, 3)
    weights = vespo_weights(t([[1.0]]), t([[0.0, 0.0]]), t([[1.0, 1.0]]), sampling_ratio=t([[e(0.3), e(-0.1)]]))
    close(weights, [[e(3 + 2 * 0.2 - 3 * e(0.2))]])
    # a token that a mask mode dropped (ratio 0) counts log 1e-8
    weights = vespo_weights(t([[1.0]]), t([[0.0, 0.0]]), t([[1.0, 1.0]]), sampling_ratio=t([[0.0, 1.0]]))
    close(weights, [[e(3 + 2 * math.log(1e-8) - 3e-8)]], atol=1e-20)
    # and the loss is not multiplied by it a second time
    logprobs = t([[-1.0, -2.0]]).requires_grad_(True)
    loss, _ = policy_loss(
        logprobs, None, None, t([1.0]), t([[1, 1]]), loss_type="vespo", sampling_ratio=t([[e(0.3), e(-0.1)]])
    )
    close(loss, -e(3 + 0.4 - 3 * e(0.2)) * (-3.0) / 2)


# ------------------------------------------------------------------------------------------------- the trainer


class ShiftedEngine(HFEngine):
    """The in-process sampler reporting each sampled token's log-prob lowered by `shift`: a sampler whose
    probabilities differ from the training forward's by a known amount."""

    def __init__(self, model, shift: float):
        super().__init__(model)
        self.shift = shift

    def generate(self, prompts, params, seed):
        rollout = super().generate(prompts, params, seed)
        rollout.sampling_logprobs = (rollout.sampling_logprobs - self.shift) * rollout.loss_mask
        return rollout


def corrected_run(tmp_path, shift, **overrides):
    model, tokenizer = tiny_letter_model()
    before = [p.detach().clone() for p in model.parameters()]
    # The shifted sampler is off by design: the served-policy check (grpokit.served) would stop the run.
    args = letter_config(tmp_path, max_steps=2, use_vllm=True, served_logprob_tolerance=None, **overrides)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=args,
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
        rollout_engine=ShiftedEngine(model, shift),
    )
    trainer.train()
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(trainer.unwrapped_model.parameters(), before))
    return trainer.state.log_history[0], moved


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_reports_the_correction_and_masks_by_it(tmp_path):
    # token_truncate: every completion token's log-prob gap is the shift (π_old is the training forward's, equal to
    # the sampler's own before the shift to ~1e-6 in float32); the ratio exp(0.25) is under clip_max.
    record, moved = corrected_run(tmp_path / "a", 0.25, vllm_importance_sampling_mode="token_truncate")
    assert record["sampling/sampling_logp_difference/mean"] == pytest.approx(0.25, abs=1e-4)
    assert record["sampling/sampling_logp_difference/max"] == pytest.approx(0.25, abs=1e-4)
    for key in ("min", "mean", "max"):
        assert record[f"sampling/importance_sampling_ratio/{key}"] == pytest.approx(e(0.25), abs=1e-4)
    assert moved > 1e-4
    # sequence_mask: 2 tokens of gap 1.0 per completion give a sequence ratio e^2 > clip_max = 1.5: every
    # completion is masked out, and with beta = 0 nothing moves the weights.
    record, moved = corrected_run(
        tmp_path / "b",
        1.0,
        vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_max=1.5,
        max_completion_length=2,
    )
    assert record["sampling/importance_sampling_ratio/max"] == 0.0
    assert moved == 0.0


# ------------------------------------------------------------------------------------------------- the config


def test_config_checks_the_correction_fields():
    from grpokit import GRPOConfig

    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode='token_clip'.*token_truncate"):
        GRPOConfig(vllm_importance_sampling_mode="token_clip")
    with pytest.raises(ValueError, match=r"clip_min=2.0 is above.*clip_max=1.5"):
        GRPOConfig(vllm_importance_sampling_clip_min=2.0, vllm_importance_sampling_clip_max=1.5)
    with pytest.raises(ValueError, match=r"vespo.*token_truncate"):
        GRPOConfig(loss_type="vespo", use_vllm=True)  # TRL's default mode is sequence_mask
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap.*clip_max"):
        assert GRPOConfig(vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0
