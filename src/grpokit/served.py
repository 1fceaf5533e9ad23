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
  soon as the batch is made (`check_processes`), before any training on it;
- otherwise every micro-batch is trained before the policy moves, so the training forward's log-probs are π_old:
  the batch's rows are marked (`TrainBatch.served_rows`), the micro-batch loss measures the gap on that forward, and
  the trainer checks the optimizer step's mean (`check_step`).
With several training processes each has an engine of its own, and each checks its own gap, the verdict taken over
all of them (`check_processes`, a gather): a push lost on one process stops every process together, at the same
point, where the logged gap (the mean over processes) would read as 1/N of it and a verdict of one process alone
would leave the others waiting in the next collective. In the same way, an engine that spreads a batch over
samplers holding weights of their own (several inference servers, `VLLMServers`; the engines of a data-parallel
server, which says which engine sampled each row) names them (`RolloutEngine`: `samplers`, `Rollout.sampler`), and
each sampler's gap over the rows it drew is checked (`gap_totals`): a push lost by one server of N, or by one engine
of a data-parallel server, would read as about 1/N of its gap in the batch's mean. The error names the sampler.

Truncated sampling (top_k, top_p < 1, min_p; also a repetition penalty and suppressed tokens) is checked where the
engine's log-probs and π_old are of one distribution, the one the token was drawn from: with keep_sampling_mask (the
default) the engine reports the log-prob of the processed distribution, and π_old is renormalised over the kept set
of that token with the penalty replayed (`grpokit.sampling_mask`). The kept sets are the engine's own where it
reports them (the in-process sampler, vLLM's sampling mask on GPU) and replayed on the trainer's logits of the
pushed weights otherwise (vLLM on CPU and in server mode: `truncation_replay`, whose cut-offs may differ from vLLM's
by float rounding: noise, far below the tolerance). sampling_mask_max_tokens is an implicit top-k the engine samples
with, so a recorded kept set is never cut short. Where the engine sampled from other weights, its kept sets and
log-probs are theirs and π_old's are not: the gap shows it. A position whose kept set holds only the sampled token
(top_k=1, a small top_p on a peaked distribution) has log-prob 0 on both sides and says nothing; it still counts in
the mean, as in TRL's metric, so a run that truncates hard dilutes the gap.

Not checked, by design (`skip_reason`): a user's rollout_func (its log-probs are whatever it reports); groups streamed
one by one (their π_old is the sampler's own log-prob); processed sampling with keep_sampling_mask=False (π_old is
the full vocabulary's, while vLLM reports the processed distribution's log-probs, as a user's engine may: TRL 1.16's
numbers) or whose kept sets came from no engine and no replay (a rollout_engine of your own that returns no
`Rollout.sampling_mask`, without use_vllm); vLLM's structured outputs (the regex's mask is not replayed); an engine
that reports no log-probs. Where an engine's log-probs serve as π_old (`logprobs_match_training`) and the batch is
trained after the policy moved, there is nothing to compare them with, and those batches are not checked.
"""

from __future__ import annotations

import math

import torch

from .config import GRPOConfig
from .rollout.engine import SamplingParams
from .rollout.sampling import processes

# TRL 1.16's name for the quantity (its vLLM importance-sampling correction logs it): the gap the check reads.
SERVED_GAP = "sampling/sampling_logp_difference/mean"
# A micro-batch's served-gap totals by sampler (`gap_totals`), for `check_step`: kept apart from the logged metrics.
SERVED_TOTALS = "served/gap_totals"

PROCESSED = "truncated or penalised sampling (top_k, top_p, min_p, repetition_penalty, suppress_tokens)"


class ServedPolicyMismatch(RuntimeError):
    """The engine's sampled-token log-probs are not those of the weights it was sent."""


def skip_reason(
    args: GRPOConfig, params: SamplingParams, logprobs_are_engines: bool, streamed: bool, kept_sets: bool
) -> str | None:
    """Why a generation batch's sampling log-probs cannot be compared with π_old (None: they can).
    params: what the engine sampled with; logprobs_are_engines: the rollout's log-probs are the engine's (False under
    a user's rollout_func); kept_sets: the batch has the kept sets of its tokens (`TrainBatch.sampling_mask`, the
    engine's or replayed), over which π_old is renormalised."""
    if streamed:
        return "groups streamed one by one: π_old is the sampler's own log-prob"
    if not logprobs_are_engines:
        return "a rollout_func reports the log-probs"
    if args.use_vllm and args.vllm_structured_outputs_regex is not None:
        return "structured outputs: vLLM reports the log-probs of the regex-masked distribution"
    if processes(params) and not params.keep_sampling_mask:
        return (
            f"{PROCESSED} with keep_sampling_mask=False: π_old is the full vocabulary's, while an engine may report "
            f"the log-probs of the distribution it drew from (vLLM does); keep_sampling_mask=True checks them"
        )
    if processes(params) and not kept_sets:
        return (
            f"{PROCESSED} whose kept sets the engine did not return (Rollout.sampling_mask): π_old is the full "
            f"vocabulary's"
        )
    return None


def samples_with_policy(engine, policy) -> bool:
    """Whether `engine` samples with the policy's module itself (the in-process `HFEngine`: its `sync_weights` keeps
    the module it is given), so that no push can fail: its gap to π_old is its own rounding, a bf16 model's cached
    one-token steps against the training forward, which a policy trained into peaked distributions raises past any
    fixed tolerance (TRL's Nemotron-H test at learning rate 0.1: 0.19 nats after 24 steps)."""
    return getattr(engine, "model", None) is policy


def sampler_names(engine) -> list[str]:
    """The names of the samplers `engine` spreads its batches over (`Rollout.sampler` indexes them), the same on every
    process; [] for an engine that samples as one."""
    return list(getattr(engine, "samplers", None) or [])


def gap_totals(
    logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    sampler: torch.Tensor | None,
    count: int | None = None,
) -> torch.Tensor:
    """[count, 2] float64: for each sampler s, (sum_t |logprobs_t - sampling_logprobs_t|, tokens) over the tokens with
    mask 1 of the rows it drew (sampler [N], each row's index in range(count); None: every row sampler 0), a NaN gap
    left out as in `loss.logprob_gap`. count None: up to the largest index. A sampler's gap is its sum over its
    tokens (`mean_gaps`)."""
    gap = (logprobs.double() - sampling_logprobs.double()).abs()
    kept = mask.bool() & ~torch.isnan(gap)
    rows = torch.zeros(len(gap), dtype=torch.long, device=gap.device) if sampler is None else sampler.to(gap.device)
    largest = int(rows.max()) if len(rows) else 0
    count = largest + 1 if count is None else count
    if len(rows) and (int(rows.min()) < 0 or largest >= count):
        raise unnamed_samplers(sorted(set(rows.tolist())), count)
    totals = torch.zeros(count, 2, dtype=torch.float64, device=gap.device)
    totals[:, 0].index_add_(0, rows, torch.where(kept, gap, 0.0).sum(1))
    totals[:, 1].index_add_(0, rows, kept.sum(1).double())
    return totals


def unnamed_samplers(labels: list[int], count: int) -> ValueError:
    return ValueError(
        f"Rollout.sampler holds the sampler indices {labels}, and the engine names {count} sampler(s) (its "
        f"`samplers`): an engine that labels its rows must name every sampler it labels them with."
    )


def mean_gaps(totals: torch.Tensor) -> torch.Tensor:
    """Each sampler's gap from `gap_totals` ([count, 2]): its mean over its tokens; NaN for a sampler with none."""
    return totals[:, 0] / totals[:, 1].where(totals[:, 1] > 0, math.nan)


def check_gap(
    gap: float,
    tolerance: float | None,
    engine,
    version: int | None,
    where: str,
    policy,
    process: tuple[int, int] | None = None,
    sampler: str | None = None,
) -> None:
    """Raise `ServedPolicyMismatch` when `gap` (`SERVED_GAP`) is above `tolerance` (None: no check), unless the
    engine samples with `policy` itself (`samples_with_policy`: the gap is logged, never raised). engine: the engine
    that sampled; version: the weights' version (optimizer steps) it was sent; where: what π_old was (for the
    message); policy: the module the trainer pushes; process: (index, count) of the process whose own gap this is,
    when there are several (`check_processes`); sampler: the name of the sampler whose own gap this is, when the
    engine names its samplers (`sampler_names`)."""
    if tolerance is None or not gap > tolerance:  # a NaN gap (no token measured) is not a mismatch
        return
    if samples_with_policy(engine, policy):
        return
    name = type(engine).__name__
    pushed = "the weights" if version is None else f"the weights of version {version} (after {version} optimizer steps)"
    on = "" if process is None else f" on process {process[0]} of {process[1]}"
    if sampler is not None:
        on = f" on {sampler}" + ("" if process is None else f" (the rows of process {process[0]} of {process[1]})")
    raise ServedPolicyMismatch(
        f"{name} does not sample with the weights it was sent{on}: after the push of {pushed}, its log-probs of the "
        f"tokens it sampled differ from the trainer's π_old ({where}) by {gap:.4g} nats on average "
        f"({SERVED_GAP}), above served_logprob_tolerance={tolerance} (a healthy bf16 engine: ~0.01). The push did "
        f"not reach the engine (a LoRA adapter not merged into it, weights not reloaded after sleep mode, a "
        f"sync_weights that does nothing), or it samples from another model. If its log-probs differ from the "
        f"policy's by design, raise served_logprob_tolerance, or set it to None to only log the gap."
    )


def check_processes(
    accelerator,
    gap: float | torch.Tensor,
    tolerance: float | None,
    engine,
    version: int | None,
    where: str,
    policy,
) -> None:
    """`check_gap` of the largest of the processes' own gaps (`gap`: this process's; a tensor [S]: each of the
    engine's S samplers' own, `mean_gaps`, NaN where one drew no measured token): a collective every process calls, so
    that all of them raise together, with the same error, or none does. Each process has an engine of its own (vLLM
    colocated: one per process), and a push lost on one process only (or by one sampler) must stop the run: the
    logged gap, the mean over processes (and samplers), would read as 1/N of it. Nothing to gather where the check is
    off or the engine samples with the policy itself (the in-process engine: every process alike)."""
    if tolerance is None or samples_with_policy(engine, policy):
        return
    count, names = accelerator.num_processes, sampler_names(engine)
    local = torch.as_tensor(gap, dtype=torch.float64).reshape(-1).to(accelerator.device)
    gaps = accelerator.gather(local).cpu().reshape(-1, len(local))  # [processes, samplers]
    worst = int(gaps.nan_to_num(nan=-math.inf).argmax())  # all NaN (no token measured anywhere): NaN, no mismatch
    process, sampler = divmod(worst, gaps.shape[1])
    check_gap(
        gaps.reshape(-1)[worst].item(),
        tolerance,
        engine,
        version,
        where,
        policy,
        (process, count) if count > 1 else None,
        names[sampler] if len(local) == len(names) else None,  # a gap per named sampler
    )


def take_step_totals(step_stats: list[dict]) -> list[torch.Tensor]:
    """The micro-batches' served-gap totals by sampler (`SERVED_TOTALS`: `gap_totals` of the rows marked
    `TrainBatch.served_rows`, where the engine said which sampler drew each), taken out of their stats: they are
    for `check_step`, not metrics to average and log."""
    return [stats.pop(SERVED_TOTALS) for stats in step_stats if SERVED_TOTALS in stats]


def check_step(
    accelerator, args: GRPOConfig, step_stats: list[dict], totals: list[torch.Tensor], engine, version: int, policy
) -> None:
    """The training-forward measure (`TrainBatch.served_rows`), checked over processes (`check_processes`): each
    sampler's gap over the optimizer step's tokens on this process (`totals`, `take_step_totals` of its micro-batches,
    summed) where the rows say which sampler drew them, else the step's gap on this process (the mean over its
    micro-batches' `step_stats`); nothing when the step measured none (on every process alike: the batches of a
    step are marked and labelled, or not, on all of them)."""
    tolerance, where = args.served_logprob_tolerance, "the training forward's"
    if totals:
        count = max(1, len(sampler_names(engine)))  # the same on every process
        summed = torch.zeros(count, 2, dtype=torch.float64)
        for t in totals:
            if len(t) > count:
                raise unnamed_samplers(list(range(len(t))), count)
            summed[: len(t)] += t.cpu()
        check_processes(accelerator, mean_gaps(summed), tolerance, engine, version, where, policy)
        return
    gaps = [stats[SERVED_GAP] for stats in step_stats if SERVED_GAP in stats]
    if gaps:
        check_processes(accelerator, sum(gaps) / len(gaps), tolerance, engine, version, where, policy)
