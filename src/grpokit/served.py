"""The served policy, checked: after each weight push, the engine samples with the weights it was sent.

An engine other than the in-process one holds weights of its own (vLLM colocated or behind a server, the engine
process, yours), and the trainer pushes new ones before each generation. A push can fail silently: a LoRA adapter
that never reaches vLLM (verl #7495: months spent on what looked like staleness), weights lost when vLLM's sleep mode
wakes up (TRL #5312). The run then trains on the samples of another policy, and every metric looks plausible.

The check is end to end and costs no forward. On a generation batch sampled with the weights just pushed (staleness
0), the engine's log-prob of each token it sampled (`Rollout.sampling_logprobs`) must equal the trainer's π_old of
that token within the engine's own noise. The statistic is TRL's `sampling/sampling_logp_difference/mean`
(`loss.logprob_gap`): the mean of |π_old - π_sampler| over the tokens the policy sampled (loss mask 1; a tool's
output inserted into a multi-turn transcript is not counted). Healthy engines sit near 1e-2 (bf16 kernels; float32:
~1e-6); weights that did not arrive give the distance between two policies. The run stops at the first batch whose
gap is above `GRPOConfig.served_logprob_tolerance` (None: measured and logged, never raised). The in-process engine
samples with the trained module itself, so nothing is pushed to it: its gap is logged, never raised.

Where it is measured, so that no forward is added:
- π_old comes from a forward of the pushed weights (vLLM's importance-sampling correction, μ > 1, a generation batch
  over several optimizer steps, a producer running ahead, the KL in the reward): the experience maker compares as
  soon as the batch is made (`check_gap`), before any training on it;
- otherwise every micro-batch is trained before the policy moves, so the training forward's log-probs are π_old:
  the batch's rows are marked (`TrainBatch.served_rows`), the micro-batch loss measures the gap on that forward, and
  the trainer checks the optimizer step's mean (`check_step`).

Not checked, by design (`skip_reason`): a user's rollout_func (its log-probs are whatever it reports); groups streamed
one by one (their π_old is the sampler's own log-prob); truncated sampling (top_k, top_p, min_p, a repetition
penalty: vLLM reports the log-prob of the truncated, renormalised distribution, not the policy's); vLLM's structured
outputs (the same, for the regex's mask); an engine that reports no log-probs. Where an engine's log-probs serve as
π_old (`logprobs_match_training`) and the batch is trained after the policy moved, there is nothing to compare them
with, and those batches are not checked.
"""

from __future__ import annotations

from .config import GRPOConfig

# TRL 1.16's name for the quantity (its vLLM importance-sampling correction logs it): the gap the check reads.
SERVED_GAP = "sampling/sampling_logp_difference/mean"


class ServedPolicyMismatch(RuntimeError):
    """The engine's sampled-token log-probs are not those of the weights it was sent."""


def skip_reason(args: GRPOConfig, logprobs_are_engines: bool, streamed: bool) -> str | None:
    """Why a generation batch's sampling log-probs cannot be compared with π_old (None: they can).
    logprobs_are_engines: the rollout's log-probs are the engine's (False under a user's rollout_func)."""
    if streamed:
        return "groups streamed one by one: π_old is the sampler's own log-prob"
    if not logprobs_are_engines:
        return "a rollout_func reports the log-probs"
    truncated = (args.top_k or 0) > 0 or args.top_p < 1.0 or (args.min_p or 0.0) > 0.0 or args.repetition_penalty != 1.0
    if truncated:
        return "truncated sampling (top_k, top_p, min_p, repetition_penalty)"
    if args.use_vllm and args.vllm_structured_outputs_regex is not None:
        return "structured outputs: vLLM reports the log-probs of the regex-masked distribution"
    return None


def samples_with_policy(engine, policy) -> bool:
    """Whether `engine` samples with the policy's module itself (the in-process `HFEngine`: its `sync_weights` keeps
    the module it is given), so that no push can fail: its gap to π_old is its own rounding, a bf16 model's cached
    one-token steps against the training forward, which a policy trained into peaked distributions raises past any
    fixed tolerance (TRL's Nemotron-H test at learning rate 0.1: 0.19 nats after 24 steps)."""
    return getattr(engine, "model", None) is policy


def check_gap(gap: float, tolerance: float | None, engine, version: int | None, where: str, policy) -> None:
    """Raise `ServedPolicyMismatch` when `gap` (`SERVED_GAP`, reduced over processes) is above `tolerance` (None: no
    check), unless the engine samples with `policy` itself (`samples_with_policy`: the gap is logged, never
    raised). engine: the engine that sampled; version: the weights' version (optimizer steps) it was sent; where:
    what π_old was (for the message); policy: the module the trainer pushes."""
    if tolerance is None or not gap > tolerance:  # a NaN gap (no token measured) is not a mismatch
        return
    if samples_with_policy(engine, policy):
        return
    name = type(engine).__name__
    pushed = "the weights" if version is None else f"the weights of version {version} (after {version} optimizer steps)"
    raise ServedPolicyMismatch(
        f"{name} does not sample with the weights it was sent: after the push of {pushed}, its log-probs of the "
        f"tokens it sampled differ from the trainer's π_old ({where}) by {gap:.4g} nats on average "
        f"({SERVED_GAP}), above served_logprob_tolerance={tolerance} (a healthy bf16 engine: ~0.01). The push did "
        f"not reach the engine (a LoRA adapter not merged into it, weights not reloaded after sleep mode, a "
        f"sync_weights that does nothing), or it samples from another model. If its log-probs differ from the "
        f"policy's by design, raise served_logprob_tolerance, or set it to None to only log the gap."
    )


def check_step(args: GRPOConfig, metrics: dict[str, float], engine, version: int, policy) -> None:
    """The training-forward measure (`TrainBatch.served_rows`): the optimizer step's gap, averaged over its
    micro-batches and processes (`metrics`, the step's), checked; nothing when the step measured none."""
    if SERVED_GAP in metrics:
        tolerance = args.served_logprob_tolerance
        check_gap(metrics[SERVED_GAP], tolerance, engine, version, "the training forward's", policy)
