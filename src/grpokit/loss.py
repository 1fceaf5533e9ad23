"""The GRPO objective as pure functions of tensors, with its variants as a table.

Shapes: N completions in the (micro-)batch, T completion tokens (padded), V vocabulary entries, E experts.

Per token t of completion i (DeepSeekMath §4.1, with TRL 1.16's extensions):

    log_ratio    = logprobs - old_logprobs                       (token level), or its masked mean over the
                                                                 sequence, broadcast to every token (GSPO,
                                                                 `importance_sampling_level="sequence"`), or its
                                                                 masked sum (TRL's RLOOTrainer, "sequence_sum")
    ratio        = exp(log_ratio)
    policy_term  = the loss type's per-token loss of (ratio, A, logprobs), e.g. for `grpo`/`dapo`/...:
                   -min(ratio · A, clamp(ratio, 1 - epsilon, 1 + epsilon_high) · A)  (ratio capped at `delta` first)
    loss_token   = policy_term · off_policy_mask · loss_weights + beta · KL
    KL           = KL_k3 = exp(ref - logp) - (ref - logp) - 1    (Schulman's k3, unbiased and >= 0), times the
                   ratio when `use_bias_correction_kl` (DeepSeek-V3.2)

and the tokens are aggregated by the loss type's aggregation. A loss type is one entry of `LOSS_TYPES`: a per-token
objective, an aggregation and the statistics it reports, looked up once; `policy_loss` runs the same two steps for
all (`token_loss`, the objective; `aggregate_token_loss`, the aggregation), with the hyper-parameters in one
`PolicyLossSettings`.

    loss_type  per-token loss                              aggregation                        source
    grpo       clipped surrogate (above)                   mean of per-sequence token means   DeepSeekMath
    bnpo       clipped surrogate                           micro-batch token mean / micro-bs  TRL
    dr_grpo    clipped surrogate                           token sum / (N · max length)       Dr. GRPO
    dapo       clipped surrogate                           token sum / tokens of the batch    DAPO
    cispo      -sg(min(ratio, eps_high)) · A · logp        token sum / tokens of the batch    MiniMax-M1, ScaleRL
    sapo       -σ(τ (ratio - 1)) · 4/τ · A  (soft gate)    mean of per-sequence token means   SAPO
    luspo      clipped surrogate (sequence ratio)          token sum / sequences              LUSPO
    vespo      -sg(φ(w_seq)) · A · logp  (Gamma weight)    token sum / tokens of the batch    VESPO
    rloo       clipped surrogate (sequence ratio, a SUM)   mean over sequences                TRL RLOOTrainer

With one update per generation the ratio is exp(logp - logp.detach()) = 1 in value, so the loss value of the
clipped family is the aggregate of -A + beta·KL — which is just beta·KL when the advantages cancel (zero mean per
group under `grpo`) — while its gradient is the policy gradient (TRL PR #2565's derivation).

Asynchronous generation trains on samples of an older policy π_behav. `off_policy_correction` says what π_old is:
"behaviour" (TRL's asynchronous GRPO): π_old = π_behav, the clip acts around the sampling policy; "decoupled"
(AReaL's decoupled PPO, Fu et al. 2025, arXiv 2505.24298 eq. 5): π_old = π_prox, the policy at the optimizer step
(with one step per batch, the training forward's own log-probs, detached), and each token's policy term is weighted
by w = π_prox / π_behav, dropped where w exceeds a cap (`behaviour_weight`).

An entropy bonus is either, as TRL 1.16 does, the mean per-token entropy of the micro-batch whatever the loss type
(`entropy_normalization="token_mean"`), or part of the per-token loss and aggregated with it (`"loss_type"`: the
bonus then weighs each token as the policy term does). The MoE router load-balancing loss and the adaptive entropy
coefficient (Skywork-OR1) are here too.

Nothing in this module knows about models, configs or accelerators; the trainer calls these functions and users
may call them from their own loops.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# ---------------------------------------------------------------------------------------------- KL


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π_θ ‖ π_ref) from samples of π_θ: exp(r - l) - (r - l) - 1."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def bias_corrected_kl(per_token_kl: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """The k3 KL weighted by the importance ratio π_θ/π_old (DeepSeek-V3.2, arXiv 2512.02556, its unbiased KL
    estimate; TRL 1.16 `use_bias_correction_kl`):

        KL_i,t = ratio_i,t · (exp(ref - logp) - (ref - logp) - 1)

    The tokens were sampled from π_old, so the plain k3 is an estimate of KL under the wrong distribution once
    π_θ moves away from π_old; the ratio (with its gradient: it is not detached) makes the gradient the unbiased
    gradient of the reverse KL(π_θ ‖ π_ref): d/dlogp = ratio · (k3 + 1 - exp(ref - logp)). It changes the gradient
    even on-policy, where the ratio is 1 in value. At sequence level the sequence ratio [N, 1] is broadcast.
    """
    return per_token_kl * ratio


# ---------------------------------------------------------------------------------------------- aggregations

# An aggregation turns a per-token loss [N, T] (or [N, 1], broadcast over the mask) into a scalar. Each receives
# the batch-wide counts so that a micro-batch's loss is its share of the accumulated batch's loss: summing the
# micro-batch losses of one optimizer step then equals the loss of the whole batch in one piece (for every
# aggregation but `token_mean_local`, which only takes the number of micro-batches, as TRL's `bnpo` does).
Aggregation = Callable[..., torch.Tensor]


def aggregate_sequence_mean(loss, mask, *, num_sequences, num_tokens, max_completion_length, num_micro_batches=1):
    """Mean over sequences of each sequence's token mean (DeepSeekMath eq. 3): sum_i (sum_t l·m / sum_t m) / N."""
    per_sequence = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.sum() / num_sequences


def aggregate_token_mean_local(loss, mask, *, num_sequences, num_tokens, max_completion_length, num_micro_batches=1):
    """Token mean over this micro-batch only, divided by the micro-batches of the optimizer step as TRL's `bnpo`
    divides it by `current_gradient_accumulation_steps`: by definition it depends on how the batch is split."""
    return (loss * mask).sum() / mask.sum().clamp(min=1.0) / num_micro_batches


def aggregate_constant(loss, mask, *, num_sequences, num_tokens, max_completion_length, num_micro_batches=1):
    """Token sum over (N · max_completion_length), a constant (Dr. GRPO, Liu et al. 2025): no length bias."""
    return (loss * mask).sum() / (num_sequences * max_completion_length)


def aggregate_token_mean(loss, mask, *, num_sequences, num_tokens, max_completion_length, num_micro_batches=1):
    """Token sum over the token count of the whole accumulated batch (DAPO, Yu et al. 2025)."""
    return (loss * mask).sum() / max(float(num_tokens), 1.0)


def aggregate_sequence_sum(loss, mask, *, num_sequences, num_tokens, max_completion_length, num_micro_batches=1):
    """Mean over sequences of each sequence's token SUM (LUSPO, arXiv 2602.05261): sum_i sum_t l·m / N. With one
    ratio per sequence this scales each sequence's loss by its length, undoing GSPO's length normalisation."""
    return (loss * mask).sum() / num_sequences


# ---------------------------------------------------------------------------------------------- objectives


@dataclass(frozen=True)
class PolicyTerms:
    """What every per-token objective sees (all on the same device and dtype)."""

    logprobs: torch.Tensor  # [N, T] log π_θ of the chosen tokens (with grad)
    log_ratio: torch.Tensor  # [N, T] logprobs - old_logprobs, token level (with grad)
    ratio: torch.Tensor  # [N, T] token level, [N, 1] sequence level: exp of the importance-sampling log-ratio
    advantages: torch.Tensor  # [N, 1] per completion or [N, T] per token
    mask: torch.Tensor  # [N, T] 1 for the tokens that count, in the dtype of logprobs
    # [N, T] or [N, 1] the sampler-mismatch correction π_old / π_sampler (`sampling_correction`), or None
    sampling_ratio: torch.Tensor | None = None


@dataclass(frozen=True)
class ObjectiveParams:
    """The hyper-parameters of the objectives, under TRL 1.16's names and with its defaults."""

    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon (TRL's epsilon_low)
    epsilon_high: float = 0.2  # upper clip 1 + epsilon_high; CISPO's absolute cap on the ratio
    delta: float | None = None  # INTELLECT-2 two-sided clipping of the unclipped ratio
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


Objective = Callable[[PolicyTerms, ObjectiveParams], torch.Tensor]


def clipped_surrogate(terms: PolicyTerms, params: ObjectiveParams) -> torch.Tensor:
    """PPO's clipped surrogate as GRPO uses it (DeepSeekMath eq. 3; Schulman et al. 2017), per token:

        loss = -min(r̃ · A, clamp(r, 1 - epsilon, 1 + epsilon_high) · A),   r̃ = min(r, delta) if delta else r

    with DAPO's decoupled clip-higher (epsilon_high) and INTELLECT-2's two-sided cap `delta` (arXiv 2505.07291).
    Shape [N, T], or [N, 1] at sequence level (GSPO).
    """
    ratio, advantages = terms.ratio, terms.advantages
    clipped_ratio = torch.clamp(ratio, 1 - params.epsilon, 1 + params.epsilon_high)
    unclipped_ratio = ratio if params.delta is None else torch.clamp(ratio, max=params.delta)
    return -torch.min(unclipped_ratio * advantages, clipped_ratio * advantages)


def cispo_objective(terms: PolicyTerms, params: ObjectiveParams) -> torch.Tensor:
    """CISPO, clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585), in the form
    of ScaleRL (arXiv 2510.13786) that TRL 1.16 implements, per token:

        loss = -sg(min(r, epsilon_high)) · A · logp

    The ratio is clipped, not the objective, and detached (sg = stop-gradient): every token keeps a gradient
    -sg(min(r, ε_high)) · A · ∇logp, none is dropped as in the clipped surrogate. There is no lower bound, and the
    upper bound is `epsilon_high` ITSELF (ScaleRL's ε_max, recommended 5.0), not 1 + epsilon_high — with TRL's
    default epsilon_high = epsilon = 0.2 every token's weight is at most 0.2. (MiniMax-M1 writes the clip as
    clip(r, 1 - ε_low, 1 + ε_high) with no effective lower bound; ScaleRL's min(r, ε_max) is its upper half.)
    """
    weight = torch.clamp(terms.ratio, max=params.epsilon_high).detach()
    return -weight * terms.advantages * terms.logprobs


def sapo_objective(terms: PolicyTerms, params: ObjectiveParams) -> torch.Tensor:
    """SAPO, soft adaptive policy optimisation (arXiv 2511.20347), per token:

        loss = -f_τ(r) · A,   f_τ(r) = σ(τ (r - 1)) · 4 / τ,   τ = sapo_temperature_pos if A > 0 else _neg

    A smooth gate instead of the hard clip: f_τ(1) = 2/τ and f_τ'(1) = 1, so near on-policy the gradient is the
    policy gradient, and it decays smoothly (rate τ) as the ratio leaves 1. A larger τ for negative advantages
    (default 1.05 vs 1.0) damps those updates sooner.
    """
    advantages = terms.advantages
    temperatures = torch.where(
        advantages > 0,
        torch.tensor(params.sapo_temperature_pos, dtype=advantages.dtype, device=advantages.device),
        torch.tensor(params.sapo_temperature_neg, dtype=advantages.dtype, device=advantages.device),
    )
    soft_ratio = torch.sigmoid(temperatures * (terms.ratio - 1)) * 4 / temperatures
    return -soft_ratio * advantages


VESPO_LOG_MIN = math.log(1e-8)  # TRL clamps the sequence log-weight to [log 1e-8, 20]


@torch.no_grad()
def vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    sampling_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO's Gamma weight of each sequence (arXiv 2602.10693; TRL 1.16 `get_gamma_weights`), detached:

        log w = clamp(sum_t clamp(log_ratio_t, -20, 20) · m_t, log 1e-8, 20)     (the sequence ratio, a SUM)
        φ(w)  = exp(λ + k · log w - λ · w) = e^λ · w^k · e^(-λ w)                 (φ(1) = 1)

    with (k, λ) = (k_pos, λ_pos) where A >= 0 and (k_neg, λ_neg) where A < 0, λ clamped to >= 1e-4, and a
    non-finite φ set to 0. φ rises as w^k below w = k/λ and decays as e^(-λ w) above. Returns [N, 1] for [N, 1]
    advantages ([N, T] for per-token advantages).

    sampling_ratio: the vLLM correction π_old / π_sampler ([N, T], a token mode of `sampling_correction`), or
    None. As in TRL it joins the sequence ratio in log space, each token's log clamped to [log 1e-8, 20]:
    log w += sum_t clamp(log sampling_ratio_t, log 1e-8, 20)  (a token a mask mode dropped, ratio 0: log 1e-8).
    """
    log_ratio_clamped = torch.clamp(log_ratio, -20.0, 20.0)
    sequence_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    if sampling_ratio is not None:
        log_sampling_ratio = torch.clamp(torch.log(sampling_ratio), VESPO_LOG_MIN, 20.0)
        sequence_log_ratio = sequence_log_ratio + torch.sum(log_sampling_ratio, dim=-1, keepdim=True)
    log_w = torch.clamp(sequence_log_ratio, VESPO_LOG_MIN, 20.0)
    w = torch.exp(log_w)
    nonnegative = advantages >= 0
    like = {"dtype": log_w.dtype, "device": log_w.device}
    k = torch.where(nonnegative, torch.tensor(k_pos, **like), torch.tensor(k_neg, **like))
    lam = torch.where(nonnegative, torch.tensor(lambda_pos, **like), torch.tensor(lambda_neg, **like)).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * w
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_objective(terms: PolicyTerms, params: ObjectiveParams) -> torch.Tensor:
    """VESPO, variational sequence-level soft policy optimisation (arXiv 2602.10693), per token:

        loss = -sg(φ(w_seq)) · A · logp,   φ from `vespo_weights`

    so the gradient is φ(w) · A · ∇logp: a REINFORCE gradient with a smooth, asymmetric weight of the sequence's
    importance ratio instead of hard clipping. The ratio is always the token-level log-ratio summed over the
    sequence, whatever `importance_sampling_level` says (TRL recommends "token").
    """
    phi = vespo_weights(
        terms.advantages,
        terms.log_ratio.detach(),
        terms.mask,
        k_pos=params.vespo_k_pos,
        lambda_pos=params.vespo_lambda_pos,
        k_neg=params.vespo_k_neg,
        lambda_neg=params.vespo_lambda_neg,
        sampling_ratio=terms.sampling_ratio,
    )
    return -phi * terms.advantages * terms.logprobs


# ---------------------------------------------------------------------------------------------- statistics

Statistics = Callable[[PolicyTerms, ObjectiveParams], "dict[str, torch.Tensor]"]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def clip_statistics(terms: PolicyTerms, params: ObjectiveParams) -> dict[str, torch.Tensor]:
    """Share of tokens whose ratio is clipped where it matters (TRL's `clip_ratio/*`): below 1 - epsilon with
    A < 0 (low), above 1 + epsilon_high with A > 0 (high), either (region). Token means over the mask."""
    mask = terms.mask
    ratio_tokens = terms.ratio.expand_as(mask)
    advantages = terms.advantages.expand_as(mask)
    is_low = (ratio_tokens < 1 - params.epsilon) & (advantages < 0)
    is_high = (ratio_tokens > 1 + params.epsilon_high) & (advantages > 0)
    return {
        "clip_ratio/low_mean": masked_mean(is_low.to(mask.dtype), mask),
        "clip_ratio/high_mean": masked_mean(is_high.to(mask.dtype), mask),
        "clip_ratio/region_mean": masked_mean((is_low | is_high).to(mask.dtype), mask),
    }


def cispo_statistics(terms: PolicyTerms, params: ObjectiveParams) -> dict[str, torch.Tensor]:
    """TRL's `cispo_clip_ratio`: share of tokens with ratio > epsilon_high and A > 0 (token mean over the mask)."""
    mask = terms.mask
    clipped = (terms.ratio.expand_as(mask) > params.epsilon_high) & (terms.advantages.expand_as(mask) > 0)
    return {"cispo_clip_ratio": masked_mean(clipped.to(mask.dtype), mask)}


def vespo_statistics(terms: PolicyTerms, params: ObjectiveParams) -> dict[str, torch.Tensor]:
    """TRL's `vespo/phi_seq_mean`: the mean Gamma weight, over sequences ([N, 1]) or over masked tokens."""
    phi = vespo_weights(
        terms.advantages,
        terms.log_ratio.detach(),
        terms.mask,
        k_pos=params.vespo_k_pos,
        lambda_pos=params.vespo_lambda_pos,
        k_neg=params.vespo_k_neg,
        lambda_neg=params.vespo_lambda_neg,
        sampling_ratio=terms.sampling_ratio,
    )
    return {"vespo/phi_seq_mean": phi.mean() if phi.shape[-1] == 1 else masked_mean(phi, terms.mask)}


def sequence_clip_statistics(terms: PolicyTerms, params: ObjectiveParams) -> dict[str, torch.Tensor]:
    """TRL RLOOTrainer's `clip_ratio/*`: the share of SEQUENCES (one ratio each) clipped where it matters, below
    1 - epsilon with A < 0 (low), above 1 + epsilon_high with A > 0 (high), either (region); a mean over
    sequences, not tokens."""
    ratio, advantages = terms.ratio[:, :1], terms.advantages[:, :1]
    is_low = ((ratio < 1 - params.epsilon) & (advantages < 0)).to(ratio.dtype)
    is_high = ((ratio > 1 + params.epsilon_high) & (advantages > 0)).to(ratio.dtype)
    return {
        "clip_ratio/low_mean": is_low.mean(),
        "clip_ratio/high_mean": is_high.mean(),
        "clip_ratio/region_mean": torch.maximum(is_low, is_high).mean(),
    }


def no_statistics(terms: PolicyTerms, params: ObjectiveParams) -> dict[str, torch.Tensor]:
    """SAPO has no clipping to count (TRL logs none for it)."""
    return {}


# ---------------------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class LossType:
    """One loss type: what each token contributes, how tokens become a scalar, and what is reported."""

    objective: Objective
    aggregation: Aggregation
    statistics: Statistics
    # The importance-sampling level the method is defined with (None: either); another one is allowed, with a
    # warning from `loss_type_warnings`, as TRL does.
    importance_sampling_level: str | None = None
    # Whether summing micro-batch losses computed with whole-batch counts equals the whole batch's loss.
    accumulation_invariant: bool = True
    # Whether the objective takes the sampler-mismatch correction itself (VESPO: inside its sequence weight)
    # instead of having its per-token loss multiplied by it (every other type, as in TRL).
    corrects_sampling_itself: bool = False
    # Whether off_policy_correction="decoupled" is defined for it: not for VESPO, whose Gamma weight of the sequence
    # ratio to π_old is its own off-policy correction (around π_prox the ratio is 1 and its weight φ(1) = 1).
    decoupled_correction: bool = True


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(clipped_surrogate, aggregate_sequence_mean, clip_statistics),
    "bnpo": LossType(clipped_surrogate, aggregate_token_mean_local, clip_statistics, accumulation_invariant=False),
    "dr_grpo": LossType(clipped_surrogate, aggregate_constant, clip_statistics),
    "dapo": LossType(clipped_surrogate, aggregate_token_mean, clip_statistics),
    "cispo": LossType(cispo_objective, aggregate_token_mean, cispo_statistics),
    "sapo": LossType(sapo_objective, aggregate_sequence_mean, no_statistics),
    "luspo": LossType(clipped_surrogate, aggregate_sequence_sum, clip_statistics, importance_sampling_level="sequence"),
    "vespo": LossType(
        vespo_objective,
        aggregate_token_mean,
        vespo_statistics,
        importance_sampling_level="token",
        corrects_sampling_itself=True,
        decoupled_correction=False,
    ),
    # TRL 1.16's RLOOTrainer: one ratio per sequence, exp(sum_t logp - sum_t old_logp) (not length-normalised as
    # GSPO's), the clipped surrogate of it, and the mean over sequences (`grpokit.rloo`).
    "rloo": LossType(
        clipped_surrogate, aggregate_sequence_mean, sequence_clip_statistics, importance_sampling_level="sequence_sum"
    ),
}
# The name config validation imports: a key of this table is a valid `loss_type`.
AGGREGATIONS = LOSS_TYPES
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_sum")
OFF_POLICY_CORRECTIONS = ("behaviour", "decoupled")
ENTROPY_NORMALIZATIONS = ("loss_type", "token_mean")


def loss_type_spec(loss_type: str) -> LossType:
    """The table entry of `loss_type`, or a ValueError that lists the valid names."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; choose one of {sorted(LOSS_TYPES)}.")
    return LOSS_TYPES[loss_type]


def loss_type_warnings(loss_type: str, importance_sampling_level: str, epsilon_high: float | None = None) -> list[str]:
    """Combinations TRL 1.16 allows but warns about (for config validation to log), plus CISPO's absolute cap."""
    spec, warnings = loss_type_spec(loss_type), []
    if spec.importance_sampling_level not in (None, importance_sampling_level):
        warnings.append(
            f"loss_type={loss_type!r} is defined with importance_sampling_level={spec.importance_sampling_level!r}, "
            f"got {importance_sampling_level!r}."
        )
    if importance_sampling_level in ("sequence", "sequence_sum") and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warnings.append(
            f"importance_sampling_level={importance_sampling_level!r} with loss_type={loss_type!r} sums per-token "
            "terms, weighting each sequence by its length; GSPO's setup is loss_type='grpo' (RLOO's: 'rloo')."
        )
    if loss_type == "cispo" and epsilon_high is not None and epsilon_high < 1:
        warnings.append(
            f"loss_type='cispo' caps the ratio at epsilon_high itself ({epsilon_high}), not at 1 + epsilon_high: every "
            "token's weight is at most that. ScaleRL recommends epsilon_high=5.0."
        )
    return warnings


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    max_completion_length: int | None = None,
    num_micro_batches: int = 1,
) -> torch.Tensor:
    """Aggregate a per-token quantity [N, T] as `loss_type` does (counts default to this batch's own)."""
    return _aggregate(
        loss_type_spec(loss_type).aggregation,
        per_token,
        mask,
        num_sequences,
        num_tokens,
        max_completion_length,
        num_micro_batches,
    )


def _aggregate(aggregation, per_token, mask, num_sequences, num_tokens, max_completion_length, num_micro_batches=1):
    mask = mask.to(per_token.dtype)
    return aggregation(
        per_token,
        mask,
        num_sequences=mask.shape[0] if num_sequences is None else num_sequences,
        num_tokens=mask.sum().item() if num_tokens is None else num_tokens,
        # The mask, not the loss, has the token width: a sequence-level loss is [N, 1] until broadcast.
        max_completion_length=mask.shape[1] if max_completion_length is None else max_completion_length,
        num_micro_batches=num_micro_batches,
    )


# ---------------------------------------------------------------------------------------------- masks, entropy


def off_policy_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, eq. 9; TRL 1.16 `get_off_policy_mask`):

        KL_i = sum_t m_t · (sampling_logp - sg(logp)) / max(sum_t m_t, 1)      (NaN log-prob differences -> 0)
        keep_i = A_i >= 0  or  KL_i <= threshold

    A sequence is dropped (0) only when it is both bad (negative advantage: the update pushes its tokens down)
    and far from the policy that sampled it, where such pushes are the least reliable. Returns [N, 1] for [N, 1]
    advantages, [N, T] for per-token advantages, in the dtype of the mask; no gradient.
    """
    mask = mask.to(logprobs.dtype)
    kl = torch.nan_to_num(sampling_logprobs - logprobs.detach(), nan=0.0)
    sequence_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (sequence_kl <= threshold)).to(mask.dtype)


SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def logprob_gap(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far an engine's sampled-token log-probs are from the trained model's on the same tokens, TRL 1.16's
    `sampling/sampling_logp_difference/mean|max`:

        gap_t = |logprobs_t - sampling_logprobs_t|   over the tokens with m_t = 1 (a NaN gap left out)
        mean  = sum_t gap_t / count,   max = max_t gap_t                        (0 and 0 without a token)

    logprobs, sampling_logprobs, mask: [N, T]. Returns scalar tensors (float32, or float64 when given), unreduced
    over processes. With the weights the engine was sent, the mean is the engine's own noise (bf16 kernels:
    ~1e-2); a push that did not reach it shows as the distance between the two policies (grpokit.served)."""
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    gap = (logprobs.to(dtype) - sampling_logprobs.to(dtype)).abs()
    gap = gap[mask.bool() & ~torch.isnan(gap)]
    zero = gap.new_zeros(())
    return {
        "sampling/sampling_logp_difference/mean": gap.mean() if gap.numel() else zero,
        "sampling/sampling_logp_difference/max": gap.max() if gap.numel() else zero,
    }


def sampling_correction(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The correction for sampling with an engine whose probabilities differ from the trained model's (vLLM's
    kernels, precision, a weight push in flight): truncated or masked importance sampling (TIS / MIS, Yao et al.
    2025, "Your efficient RL framework secretly brings you off-policy RL training"; TRL 1.16
    `vllm_importance_sampling_*`). The tokens were drawn from π_sampler while the objective assumes π_old, so each
    token's loss is weighted by

        d_t   = nan_to_num((old_logprobs_t - sampling_logprobs_t) · m_t)          (a NaN sampling log-prob: 0)
        token_*:    r_t = exp(d_t)                                                 [N, T]
        sequence_*: r   = exp(sum_t d_t)                                           [N, 1]  (a sum, not a mean)
        *_truncate: r <- clamp(r, clip_min, clip_max)       (a None bound is no bound)
        *_mask:     r <- 0 where r < clip_min or r > clip_max

    old_logprobs, sampling_logprobs, mask: [N, T]. Returns (ratio, stats): the ratio, detached, [N, T] or [N, 1],
    and TRL's metrics of it, unreduced over processes:
        sampling/sampling_logp_difference/mean|max   |old - sampling| over the masked tokens (NaNs left out)
        sampling/importance_sampling_ratio/min|mean|max   over the masked tokens (token modes) or the sequences
    (0 where there is nothing to measure, as in TRL).
    """
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(
            f"Unknown vllm_importance_sampling_mode {mode!r}; choose one of {list(SAMPLING_CORRECTION_MODES)}."
        )
    with torch.no_grad():
        dtype = torch.promote_types(old_logprobs.dtype, torch.float32)  # float32, or float64 when given
        old_logprobs, sampling_logprobs = old_logprobs.to(dtype), sampling_logprobs.to(dtype)
        mask = mask.to(dtype)
        difference = torch.nan_to_num((old_logprobs - sampling_logprobs) * mask, nan=0.0)
        sequence_level = mode.startswith("sequence")
        ratio = torch.exp(difference.sum(-1, keepdim=True) if sequence_level else difference)
        if mode.endswith("truncate"):
            if clip_min is not None or clip_max is not None:
                ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
        else:
            low = -math.inf if clip_min is None else clip_min
            high = math.inf if clip_max is None else clip_max
            ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

        measured = ratio.flatten() if sequence_level else ratio[mask.bool()]
        zero = ratio.new_zeros(())
        stats = {
            **logprob_gap(old_logprobs, sampling_logprobs, mask),
            "sampling/importance_sampling_ratio/min": measured.min() if measured.numel() else zero,
            "sampling/importance_sampling_ratio/mean": measured.mean() if measured.numel() else zero,
            "sampling/importance_sampling_ratio/max": measured.max() if measured.numel() else zero,
        }
    return ratio, stats


@torch.no_grad()
def behaviour_weight(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float | None = 5.0,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The behaviour importance weight of decoupled PPO (AReaL, Fu et al. 2025, arXiv 2505.24298 eq. 5; AReaL's
    `behav_imp_weight_cap`), detached:

        log w_t = log π_prox_t - log π_behav_t  (0 where m_t = 0)                         token level        [N, T]
        sequence level: log w = sum_t log w_t / max(sum_t m_t, 1)  (GSPO's mean)  or  sum_t log w_t
                        ("sequence_sum", RLOO's), one weight per sequence                                 [N, 1]
        w <- 0 where w > cap   (None: no cap)

    The weight moves the policy term from the behaviour policy that sampled the tokens to the proximal policy the
    clip acts around. As in AReaL, a token (a sequence, at sequence level) whose weight exceeds the cap is dropped,
    not truncated, and the loss's counts keep it (its share of the loss is 0). `level` is the importance-sampling
    level of the loss's ratio, so that the weight and the ratio are of the same kind.

    proximal_logprobs, behaviour_logprobs, mask: [N, T]. Returns (weight, stats), stats token means over the mask:
        off_policy/behaviour_weight_mean   the mean weight before the cap
        off_policy/masked_fraction         the share of tokens dropped by the cap
    """
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"Unknown importance_sampling_level {level!r}; choose one of {list(IMPORTANCE_SAMPLING_LEVELS)}."
        )
    mask = mask.to(proximal_logprobs.dtype)
    # Padding's log-probs may be anything: zeroed before the exp, so that no inf or NaN reaches the loss.
    log_weight = torch.where(mask != 0, proximal_logprobs - behaviour_logprobs, 0.0)
    if level == "sequence":
        log_weight = log_weight.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    elif level == "sequence_sum":
        log_weight = log_weight.sum(-1, keepdim=True)
    weight = torch.exp(log_weight)
    dropped = torch.zeros_like(weight, dtype=torch.bool) if cap is None else weight > cap
    stats = {
        "off_policy/behaviour_weight_mean": masked_mean(weight.expand_as(mask), mask),
        "off_policy/masked_fraction": masked_mean(dropped.expand_as(mask).to(mask.dtype), mask),
    }
    return weight.masked_fill(dropped, 0.0), stats


def entropy_token_mean(entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean per-token entropy H = sum(H·m) / max(sum(m), 1) of one micro-batch, with grad: TRL 1.16's entropy
    bonus, the same whatever the loss type (it is not rescaled by the loss type's normalisation)."""
    return (entropies * mask).sum() / mask.sum().clamp(min=1.0)


def update_entropy_coef(
    coef: float, entropy: float, *, target: float, delta: float, coef_min: float, coef_max: float
) -> float:
    """Skywork-OR1's adaptive entropy control (arXiv 2505.22312; TRL 1.16 `use_adaptive_entropy`), one
    optimizer step:

        coef' = min(coef + delta, coef_max)   if entropy <= target
        coef' = max(coef - delta, coef_min)   otherwise
    """
    return min(coef + delta, coef_max) if entropy <= target else max(coef - delta, coef_min)


@dataclass
class AdaptiveEntropyController:
    """The entropy coefficient of TRL 1.16's `use_adaptive_entropy`, as a small state machine.

    Per micro-batch: `coef_to_apply()` is the coefficient for `policy_loss(entropy_coef=...)` — the current one if
    the entropy measured at the last optimizer step was <= target, else 0 (no bonus until it is; the first window
    measures nothing yet, so it applies none) — and `observe(entropies, mask)` adds the micro-batch's entropy sum and
    token count to the window. At each optimizer step: `step(totals)` with the window totals summed over processes
    (`window_totals()` on one process) updates the coefficient with `update_entropy_coef` and empties the window.
    The mask is the one the loss acts on (the loss mask times the top-entropy mask when one is used).
    `state_dict` / `load_state_dict` carry everything, for an exact resume.
    """

    coef: float  # TRL: entropy_coef (the initial value)
    target: float = 0.2  # TRL: entropy_target
    delta: float = 0.005  # TRL: entropy_coef_delta
    coef_min: float = 0.0  # TRL: entropy_coef_min
    coef_max: float = 1.0  # TRL: entropy_coef_max
    last_entropy: float = math.inf  # window-global mean entropy at the last optimizer step
    window_sum: float = 0.0
    window_count: float = 0.0

    def coef_to_apply(self) -> float:
        return self.coef if self.last_entropy <= self.target else 0.0

    def observe(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        mask = mask.to(entropies.dtype)
        self.window_sum += float((entropies.detach() * mask).sum())
        self.window_count += float(mask.sum())

    def window_totals(self) -> torch.Tensor:
        """[entropy sum, token count] of this process's window (float64), to be summed over processes."""
        return torch.tensor([self.window_sum, self.window_count], dtype=torch.float64)

    def step(self, totals: torch.Tensor | Sequence[float] | None = None) -> float:
        """Close the window: update the coefficient from the window-global mean entropy; returns the new one."""
        entropy_sum, count = (self.window_sum, self.window_count) if totals is None else (float(v) for v in totals)
        self.last_entropy = entropy_sum / max(count, 1.0)
        self.coef = update_entropy_coef(
            self.coef,
            self.last_entropy,
            target=self.target,
            delta=self.delta,
            coef_min=self.coef_min,
            coef_max=self.coef_max,
        )
        self.window_sum, self.window_count = 0.0, 0.0
        return self.coef

    def state_dict(self) -> dict[str, float]:
        return {
            "coef": self.coef,
            "last_entropy": self.last_entropy,
            "window_sum": self.window_sum,
            "window_count": self.window_count,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])
        self.last_entropy = float(state["last_entropy"])
        self.window_sum = float(state.get("window_sum", 0.0))
        self.window_count = float(state.get("window_count", 0.0))


# ---------------------------------------------------------------------------------------------- MoE router loss


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor] | torch.Tensor | None,
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, arXiv 2101.03961, eq. 4-6), with top-k
    routing as in Mixtral, computed the way transformers 5.x's `load_balancing_loss_func` does for Qwen3-MoE:

        p_l,t   = softmax(router_logits_l,t)                       [E] per layer l and token t
        f_e     = sum_l sum_t m_t · [e in top_k(p_l,t)] / (L · sum_t m_t)     share of routed slots (sums to k)
        P_e     = sum_l sum_t m_t · p_l,t,e / (L · sum_t m_t)                 mean router probability
        loss    = E · sum_e f_e · P_e

    router_logits: one [B·S, E] tensor per MoE layer (the model's `router_logits` output), or a stacked
                   [L, B·S, E] tensor; None or empty gives 0.
    attention_mask: [B, S] 1 for real tokens (prompt and completion), or None (every row counts).
    The gradient flows through P only (f is a count). Computed in float32, or float64 for float64 logits.
    Its minimum, k, is reached when routing is uniform; TRL adds `router_aux_loss_coef` times it to the loss.
    """
    if router_logits is None or len(router_logits) == 0:
        return torch.tensor(0.0)
    layers = list(router_logits)
    device = layers[0].device
    dtype = torch.float64 if layers[0].dtype == torch.float64 else torch.float32
    rows = layers[0].shape[0]
    weights = (
        torch.ones(rows, dtype=dtype, device=device)
        if attention_mask is None
        else attention_mask.reshape(-1).to(device=device, dtype=dtype)
    )
    routed = torch.zeros(num_experts, dtype=dtype, device=device)
    probability = torch.zeros(num_experts, dtype=dtype, device=device)
    for layer in layers:
        probs = torch.softmax(layer.to(device=device, dtype=dtype), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # [rows, k]
        slots = torch.zeros_like(probs).scatter_add_(1, chosen, torch.ones_like(chosen, dtype=dtype))
        routed = routed + (slots.detach() * weights[:, None]).sum(0)
        probability = probability + (probs * weights[:, None]).sum(0)
    total = weights.sum() * len(layers)
    return num_experts * torch.sum((routed / total) * (probability / total))


# ---------------------------------------------------------------------------------------------- the loss


@dataclass
class LossStats:
    """Detached statistics of one loss evaluation (token means over the completion mask)."""

    kl: torch.Tensor | None  # mean KL (bias-corrected when asked), None without ref_logprobs
    entropy: torch.Tensor | None  # mean entropy, None when no entropies were given
    ratio_mean: torch.Tensor  # mean importance ratio, 1 on-policy
    objective: dict[str, torch.Tensor] = field(default_factory=dict)  # the loss type's own, under TRL's names
    policy_loss: torch.Tensor | None = None  # the loss without the entropy bonus ("token_mean" bonus only)

    def as_dict(self) -> dict[str, float]:
        out = {name: value.item() for name, value in self.objective.items()}
        if self.kl is not None:
            out["kl"] = self.kl.item()
        if self.entropy is not None:
            out["entropy"] = self.entropy.item()
        if self.policy_loss is not None:
            out["policy_loss"] = self.policy_loss.item()
        return out


@dataclass(frozen=True, kw_only=True)
class PolicyLossSettings:
    """The loss's hyper-parameters: what stays fixed over a run (`GRPOConfig.objective_options` gives them from a
    config). Names and defaults are TRL 1.16's GRPOConfig's.

    loss_type:     a key of `LOSS_TYPES`: the per-token objective, the aggregation and the statistics
    beta:          the KL coefficient (> 0 needs ref_logprobs)
    epsilon, epsilon_high: the clip range [1 - epsilon, 1 + epsilon_high] (epsilon_high None: epsilon)
    delta:         two-sided clipping: cap the unclipped ratio at delta (INTELLECT-2), None = off
    importance_sampling_level: "token" (GRPO), "sequence" (GSPO: a length-normalised ratio per sequence) or
                   "sequence_sum" (TRL's RLOOTrainer: the ratio of the whole sequences' probabilities)
    max_completion_length: the constant of `dr_grpo`'s aggregation (None: the mask's width)
    sapo_*, vespo_*: the `sapo` and `vespo` objectives' parameters
    off_policy_mask_threshold: drop negative-advantage sequences whose mean KL(sampler ‖ π_θ) exceeds it
                   (DeepSeek-V3.2; `off_policy_mask`), None = off
    use_bias_correction_kl: weight the k3 KL by the importance ratio (`bias_corrected_kl`)
    entropy_normalization: "token_mean" (TRL 1.16): the loss minus entropy_coef times the micro-batch's mean
                   entropy over mask·loss_weights, divided by `num_micro_batches`, whatever the loss type;
                   "loss_type": the bonus -entropy_coef·H is part of each token's loss and aggregated with it, so
                   that it is weighted as the policy term is (e.g. per-sequence means under `grpo`)
    off_policy_correction: what old_logprobs are to the loss. "behaviour" (TRL's asynchronous GRPO): π_old, the
                   ratio and the clip are around them. "decoupled" (AReaL's decoupled PPO): they are the behaviour
                   policy's, and the ratio and the clip are around the proximal policy π_prox = logprobs.detach(),
                   the weights of this forward — right when each batch is trained in one optimizer step
                   (num_iterations=1: weights change only at the step, after the forwards of all its micro-batches);
                   each token's policy term (after the masks and sampling_ratio, before beta·KL) is weighted by
                   `behaviour_weight` at the importance-sampling level. The KL's ratio (use_bias_correction_kl) is
                   then to π_prox, and neither KL nor entropy is weighted, as in AReaL. Not defined for `vespo`.
    off_policy_correction_cap: the "decoupled" weight's cap (AReaL's behav_imp_weight_cap, > 1): a token whose
                   weight π_prox/π_behav exceeds it is dropped; None: no cap
    """

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    entropy_normalization: str = "token_mean"
    off_policy_correction: str = "behaviour"
    off_policy_correction_cap: float | None = 5.0

    def __post_init__(self):
        spec = loss_type_spec(self.loss_type)
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"Unknown importance_sampling_level {self.importance_sampling_level!r}; "
                f"choose one of {list(IMPORTANCE_SAMPLING_LEVELS)}."
            )
        if self.entropy_normalization not in ENTROPY_NORMALIZATIONS:
            raise ValueError(
                f"Unknown entropy_normalization {self.entropy_normalization!r}; choose one of "
                f"{list(ENTROPY_NORMALIZATIONS)}."
            )
        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(
                f"Unknown off_policy_correction {self.off_policy_correction!r}; choose one of "
                f"{list(OFF_POLICY_CORRECTIONS)}."
            )
        if self.decoupled and not spec.decoupled_correction:
            raise ValueError(
                f"off_policy_correction='decoupled' is not defined for loss_type={self.loss_type!r}: its sequence "
                f"weight is its own off-policy correction. Use off_policy_correction='behaviour'."
            )

    @property
    def spec(self) -> LossType:
        return LOSS_TYPES[self.loss_type]

    @property
    def decoupled(self) -> bool:
        return self.off_policy_correction == "decoupled"

    def objective_params(self) -> ObjectiveParams:
        return ObjectiveParams(
            epsilon=self.epsilon,
            epsilon_high=self.epsilon if self.epsilon_high is None else self.epsilon_high,
            delta=self.delta,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
            vespo_k_pos=self.vespo_k_pos,
            vespo_lambda_pos=self.vespo_lambda_pos,
            vespo_k_neg=self.vespo_k_neg,
            vespo_lambda_neg=self.vespo_lambda_neg,
        )


@dataclass
class TokenLoss:
    """The objective's output, before aggregation."""

    per_token: torch.Tensor  # [N, T], or [N, 1] at sequence level without a KL term: each token's loss
    mask: torch.Tensor  # [N, T] the completion mask in the dtype of logprobs
    terms: PolicyTerms  # what the objective saw (the statistics read it)
    kl: torch.Tensor | None  # the mean KL (bias-corrected when asked), detached; None without ref_logprobs
    correction_stats: dict[str, torch.Tensor]  # the "decoupled" weight's, else empty


def token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: PolicyLossSettings,
    *,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    loss_weights: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    sampling_ratio: torch.Tensor | None = None,
    kl_logprobs: torch.Tensor | None = None,
) -> TokenLoss:
    """The objective, per token: the loss type's policy term, times the off-policy mask, `loss_weights`, the
    sampler-mismatch correction and (decoupled) the behaviour weight, plus beta·KL, minus the entropy bonus when
    it is aggregated with the loss (`entropy_normalization="loss_type"`). Arguments as `policy_loss`'s."""
    if settings.beta > 0 and ref_logprobs is None:
        raise ValueError("policy_loss: beta > 0 needs ref_logprobs (the reference policy's log-probs).")
    spec, params = settings.spec, settings.objective_params()
    mask = mask.to(logprobs.dtype)
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    behaviour_logprobs = old_logprobs
    if settings.decoupled:  # π_prox: the weights of this forward, the policy at the optimizer step
        old_logprobs = logprobs.detach()
    if advantages.dim() == 1:
        advantages = advantages[:, None]

    token_log_ratio = logprobs - old_logprobs
    ratio = torch.exp(importance_log_ratio(token_log_ratio, mask, settings.importance_sampling_level))
    if sampling_ratio is not None:
        sampling_ratio = sampling_ratio.to(device=logprobs.device, dtype=logprobs.dtype)
    terms = PolicyTerms(
        logprobs=logprobs,
        log_ratio=token_log_ratio,
        ratio=ratio,
        advantages=advantages,
        mask=mask,
        sampling_ratio=sampling_ratio,
    )

    per_token = spec.objective(terms, params)
    if settings.off_policy_mask_threshold is not None:
        behaviour = behaviour_logprobs if sampling_logprobs is None else sampling_logprobs
        per_token = per_token * off_policy_mask(
            advantages, logprobs, behaviour, mask, settings.off_policy_mask_threshold
        )
    if loss_weights is not None:
        per_token = per_token * loss_weights
    if sampling_ratio is not None and not spec.corrects_sampling_itself:
        per_token = per_token * sampling_ratio
    correction_stats = {}
    if settings.decoupled:
        # With sampling_ratio = π_behav / π_sampler this makes the token's weight π_prox / π_sampler, each factor
        # truncated or masked by its own rule.
        weight, correction_stats = behaviour_weight(
            old_logprobs,
            behaviour_logprobs,
            mask,
            cap=settings.off_policy_correction_cap,
            level=settings.importance_sampling_level,
        )
        per_token = per_token * weight

    kl = None
    if ref_logprobs is not None:
        per_token_kl = kl_k3(logprobs if kl_logprobs is None else kl_logprobs, ref_logprobs)
        if settings.use_bias_correction_kl:
            per_token_kl = bias_corrected_kl(per_token_kl, ratio)
        kl = masked_mean(per_token_kl.detach().expand_as(mask), mask)
        if settings.beta > 0:
            per_token = per_token + settings.beta * per_token_kl
    if entropies is not None and entropy_coef != 0 and settings.entropy_normalization == "loss_type":
        per_token = per_token - entropy_coef * entropies
    return TokenLoss(per_token=per_token, mask=mask, terms=terms, kl=kl, correction_stats=correction_stats)


def importance_log_ratio(token_log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log importance ratio at `level`: per token ([N, T], "token"), or one per sequence ([N, 1]): GSPO's
    length-normalised mean ("sequence", Zheng et al. 2025) or the whole sequences' sum ("sequence_sum", TRL's
    RLOOTrainer: the ratio of the sequences' probabilities)."""
    if level == "sequence":
        return ((token_log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    if level == "sequence_sum":
        return (token_log_ratio * mask).sum(-1, keepdim=True)
    return token_log_ratio


def aggregate_token_loss(
    token: TokenLoss,
    settings: PolicyLossSettings,
    *,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    num_micro_batches: int = 1,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    loss_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The aggregation: the loss type's scalar of `token.per_token`, minus the "token_mean" entropy bonus. Returns
    (loss, the loss without that bonus, detached: None unless entropy_normalization="token_mean" with entropies)."""
    mask = token.mask
    loss = _aggregate(
        settings.spec.aggregation,
        token.per_token,
        mask,
        num_sequences,
        num_tokens,
        settings.max_completion_length,
        num_micro_batches,
    )
    policy_part = None
    if entropies is not None and settings.entropy_normalization == "token_mean":
        policy_part = loss.detach()
        if entropy_coef != 0:
            effective_mask = mask if loss_weights is None else mask * loss_weights
            loss = loss - entropy_coef * (entropy_token_mean(entropies, effective_mask) / num_micro_batches)
    return loss, policy_part


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    settings: PolicyLossSettings | None = None,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    num_micro_batches: int = 1,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    loss_weights: torch.Tensor | None = None,
    sampling_logprobs: torch.Tensor | None = None,
    sampling_ratio: torch.Tensor | None = None,
    kl_logprobs: torch.Tensor | None = None,
    **setting_values,
) -> tuple[torch.Tensor, LossStats]:
    """The loss type's objective plus beta·KL, aggregated by the loss type (see `LOSS_TYPES`): `token_loss`, then
    `aggregate_token_loss`.

    logprobs:      [N, T] log π_θ of the chosen tokens (with grad)
    old_logprobs:  [N, T] log π_old (the policy that sampled), or None for on-policy (= logprobs.detach())
    ref_logprobs:  [N, T] log π_ref, or None (required when beta > 0)
    advantages:    [N] per completion, or [N, T] per token (process supervision)
    mask:          [N, T] 1 for completion tokens that count
    settings:      the hyper-parameters (`PolicyLossSettings`), or give them as keywords (`loss_type="grpo",
                   beta=0.04, ...`: PolicyLossSettings' fields), not both
    num_sequences, num_tokens: counts over the whole accumulated batch (default: this batch), so that
                   micro-batch losses add up to the full-batch loss
    num_micro_batches: micro-batches accumulated into this optimizer step (the "token_mean" bonus and `bnpo`,
                   as TRL's current_gradient_accumulation_steps)
    entropies:     [N, T] per-token entropies (with grad) for the entropy bonus `entropy_coef`
    loss_weights:  [N, T] optional 0/1 weights on the policy-gradient term only (e.g. top-entropy tokens)
    sampling_logprobs: [N, T] log-probs of the policy that sampled (the engine's), for the off-policy mask;
                   default old_logprobs
    sampling_ratio: [N, T] or [N, 1] the sampler-mismatch correction (`sampling_correction`), or None: it
                   multiplies each token's policy term (after the masks, before beta·KL), as TRL 1.16 does; VESPO
                   takes it into its sequence weight instead
    kl_logprobs:   [N, T] log π_θ (with grad) for the KL term only, default logprobs: the full-vocabulary log-probs
                   where logprobs are renormalised over the sampler's kept sets (keep_sampling_mask), so that the KL
                   to the reference stays the full vocabulary's

    Returns (loss, stats).
    """
    settings = _settings_given(settings, setting_values)
    token = token_loss(
        logprobs,
        old_logprobs,
        ref_logprobs,
        advantages,
        mask,
        settings,
        entropies=entropies,
        entropy_coef=entropy_coef,
        loss_weights=loss_weights,
        sampling_logprobs=sampling_logprobs,
        sampling_ratio=sampling_ratio,
        kl_logprobs=kl_logprobs,
    )
    loss, policy_part = aggregate_token_loss(
        token,
        settings,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        num_micro_batches=num_micro_batches,
        entropies=entropies,
        entropy_coef=entropy_coef,
        loss_weights=loss_weights,
    )
    return loss, loss_stats(token, settings, entropies, policy_part)


def _settings_given(settings: PolicyLossSettings | None, setting_values: dict) -> PolicyLossSettings:
    """policy_loss's hyper-parameters, given as `settings` or as PolicyLossSettings' fields (keywords), not both."""
    if settings is None:
        unknown = sorted(set(setting_values) - {spec.name for spec in dataclasses.fields(PolicyLossSettings)})
        if unknown:
            raise TypeError(
                f"policy_loss got unknown keyword(s) {unknown}: pass the tensors and counts by their "
                f"names and the hyper-parameters as PolicyLossSettings' fields."
            )
        return PolicyLossSettings(**setting_values)
    if setting_values:
        raise TypeError(
            f"policy_loss got settings= and {sorted(setting_values)}: give the hyper-parameters one way, "
            f"e.g. settings=dataclasses.replace(settings, beta=0.1)."
        )
    return settings


def loss_stats(
    token: TokenLoss, settings: PolicyLossSettings, entropies: torch.Tensor | None, policy_part: torch.Tensor | None
) -> LossStats:
    """What policy_loss reports beside the loss: KL, entropy, mean ratio, the objective's statistics, detached."""
    terms, mask = token.terms, token.mask
    with torch.no_grad():
        return LossStats(
            kl=token.kl,
            entropy=None if entropies is None else masked_mean(entropies.detach(), mask),
            ratio_mean=masked_mean(terms.ratio.expand_as(mask).detach(), mask),
            objective={**settings.spec.statistics(terms, settings.objective_params()), **token.correction_stats},
            policy_loss=policy_part,
        )


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """1 for the tokens whose entropy is in the top `quantile` share of this batch's tokens (Wang et al. 2025,
    "Beyond the 80/20 rule"), else 0: only those take part in the policy-gradient term."""
    values = entropies[mask.bool()].float()
    if values.numel() == 0:
        return torch.zeros_like(entropies)
    threshold = torch.quantile(values, 1 - quantile)
    return ((entropies >= threshold) & mask.bool()).to(entropies.dtype)


# ---------------------------------------------------------------------------------------------- distillation


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token generalized Jensen–Shannon divergence between the student's and the teacher's next-token
    distributions: logits [..., V] -> [...]. Agarwal et al. 2024 ("On-Policy Distillation of Language Models",
    arXiv 2306.13649, Eq. 1), with TRL 1.16's `DistillationTrainer` names for the ends of `beta`:

        p_s = softmax(student_logits / temperature),  p_t = softmax(teacher_logits / temperature)
        beta = 0      KL(p_t ‖ p_s)                                  TRL: "forward KL" (mass-covering)
        beta = 1      KL(p_s ‖ p_t)                                  TRL: "reverse KL" (mode-seeking; TRL's default)
        otherwise     beta · KL(p_t ‖ m) + (1 - beta) · KL(p_s ‖ m),  m = (1 - beta) · p_s + beta · p_t
                      (beta = 0.5: the Jensen–Shannon divergence)

    The ends are defined, not limits of the middle: as beta -> 0 the mixture tends to p_s and the divergence to
    beta · KL(p_t ‖ p_s) -> 0 (likewise (1 - beta) · KL(p_s ‖ p_t) as beta -> 1). As in TRL, the temperature divides
    both models' logits and the result is not rescaled by temperature² (Hinton et al.'s correction).

    Worked example (V = 2, temperature 1): p_s = (1/2, 1/2), p_t = (3/4, 1/4):
        beta = 0:  3/4 · ln(3/2) + 1/4 · ln(1/2)                                  = 0.130812
        beta = 1:  1/2 · ln(2/3) + 1/2 · ln(2)                                    = 0.143841
        beta = 1/2 (m = (5/8, 3/8)):  1/2 · [3/4 ln(6/5) + 1/4 ln(2/3)] + 1/2 · [1/2 ln(4/5) + 1/2 ln(4/3)] = 0.033822

    Gradients flow to whichever of the two logits require them (the trainers detach the teacher's). The chunked
    twin that never holds [N, T, V] logits is `grpokit.distillation.chunked_distillation_loss`.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 0.5 = JSD, 1 = reverse KL), got {beta}.")
    student_logprobs = torch.log_softmax(student_logits / temperature, dim=-1)
    teacher_logprobs = torch.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0.0:
        return (teacher_logprobs.exp() * (teacher_logprobs - student_logprobs)).sum(-1)
    if beta == 1.0:
        return (student_logprobs.exp() * (student_logprobs - teacher_logprobs)).sum(-1)
    mixture_logprobs = torch.logaddexp(student_logprobs + math.log1p(-beta), teacher_logprobs + math.log(beta))
    kl_teacher = (teacher_logprobs.exp() * (teacher_logprobs - mixture_logprobs)).sum(-1)
    kl_student = (student_logprobs.exp() * (student_logprobs - mixture_logprobs)).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


@dataclass
class DistillationStats:
    """Detached sums of one distillation-loss evaluation, over its masked tokens (sums, so that processes and
    micro-batches add up before the one division TRL logs as `entropy`)."""

    entropy_sum: torch.Tensor  # the student's entropy at the loss's temperature, in nats, summed over the tokens
    num_tokens: torch.Tensor  # tokens that took part (mask != 0)

    def as_dict(self) -> dict[str, float]:
        count = self.num_tokens.item()
        return {"entropy": self.entropy_sum.item() / count if count else 0.0}


def distillation_reduction(per_token: torch.Tensor, num_valid: torch.Tensor, num_tokens) -> torch.Tensor:
    """TRL 1.16's reduction of the per-token divergences of the masked tokens: their sum over `num_tokens` (the
    tokens of the whole accumulated batch, so that micro-batch losses add up to the batch's) when given, else
    over this call's own count (at least 1, so that an all-masked micro-batch gives 0, not 0/0)."""
    if num_tokens is None:
        return per_token.sum() / num_valid.clamp(min=1)
    if isinstance(num_tokens, torch.Tensor):
        num_tokens = num_tokens.to(per_token.device)
    return per_token.sum() / num_tokens


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    num_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, DistillationStats]:
    """TRL 1.16's `DistillationTrainer` loss on full logits: the `generalized_jsd` of the tokens where `mask` is
    nonzero, reduced by `distillation_reduction`.

    student_logits, teacher_logits: [N, T, V] (any leading shape), aligned to the completion tokens
    mask: [N, T], the loss mask (TRL: completion_mask · tool_mask — tool output tokens take no part)
    Only the masked-in rows are computed, so padding and tool spans cost nothing and cannot poison the loss.
    """
    valid = mask.reshape(-1) != 0
    vocab_size = student_logits.shape[-1]
    student_rows = student_logits.reshape(-1, vocab_size)[valid]
    teacher_rows = teacher_logits.reshape(-1, teacher_logits.shape[-1])[valid]
    per_token = generalized_jsd(student_rows, teacher_rows, beta=beta, temperature=temperature)
    num_valid = valid.sum()
    with torch.no_grad():
        student_logprobs = torch.log_softmax(student_rows.detach() / temperature, dim=-1)
        entropy_sum = -(student_logprobs.exp() * student_logprobs).sum()
    return distillation_reduction(per_token, num_valid, num_tokens), DistillationStats(entropy_sum, num_valid)
