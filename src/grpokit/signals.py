"""Reward-hacking signals, as pure functions: duplicated completions and a reward that rises while a guard falls;
and `SignalWarnings`, which says them (and the signs that a run cannot learn) once each during training.

A policy that finds a loophole in its reward usually shows it before the reward does: its G samples of a prompt
collapse onto the same string (`completions/duplicate_ratio`), completions run into max_completion_length
(`completions/clipped_ratio`), or a metric that should move with the reward moves against it (the format reward,
the completion length, an eval score). `guard_alerts` finds the last kind in the logged series.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Hashable, Sequence


def duplicate_ratio(completions: Sequence[Hashable], num_generations: int) -> float:
    """Share of completions that are identical to at least one *other* completion of their group, averaged over
    groups (G = num_generations consecutive completions per group).

    A completion counts once however many twins it has, and both (all) members of a set of identical completions
    count: 0 when a group's G completions are all different, 1 when each has a twin (e.g. all the same).

    Worked example (G = 4): ["ab", "ab", "c", "d"] -> 2/4 = 0.5; ["x", "x", "x", "x"] -> 1.0; two groups
    ["a", "b", "c", "d"] and ["a", "a", "a", "b"] -> mean(0, 3/4) = 0.375.

    Completions must be hashable: the trainer compares token-id tuples, so "identical" means the same tokens up
    to and including EOS.
    """
    if num_generations < 1 or len(completions) % num_generations:
        raise ValueError(f"{len(completions)} completions do not split into groups of {num_generations}.")
    shares = []
    for start in range(0, len(completions), num_generations):
        counts = Counter(completions[start : start + num_generations])
        shares.append(sum(count for count in counts.values() if count > 1) / num_generations)
    return sum(shares) / len(shares) if shares else 0.0


def sequence_keys(completion_ids, completion_mask) -> list[int]:
    """One integer per completion that is equal for equal token sequences: the hash of its masked token ids
    ([N, T] tensors). Hashes of tuples of ints do not depend on PYTHONHASHSEED, so processes agree on them."""
    completion_ids, completion_mask = completion_ids.cpu(), completion_mask.cpu().bool()  # one copy, not N
    return [hash(tuple(ids[mask].tolist())) for ids, mask in zip(completion_ids, completion_mask)]


def kendall_tau(values: Sequence[float]) -> float:
    """Kendall's tau-a of values against their order: (rising pairs - falling pairs) / all pairs, in [-1, 1].

    1 for a strictly increasing series, -1 for a strictly decreasing one, 0 for a flat one. Only the order of the
    values matters, so metrics on any scale (a reward in [0, 1], a length in tokens) compare alike.

    Worked example: [1, 3, 2, 4] has pairs (1,3)+ (1,2)+ (1,4)+ (3,2)- (3,4)+ (2,4)+ -> (5 - 1) / 6 = 0.667.
    """
    n = len(values)
    if n < 2:
        return 0.0
    signs = [(values[j] > values[i]) - (values[j] < values[i]) for i in range(n) for j in range(i + 1, n)]
    return sum(signs) / len(signs)


def guard_alerts(reward: Sequence[float], guard: Sequence[float], window: int = 5, min_tau: float = 0.6) -> list[int]:
    """Positions i of the series at which "the reward rises while the guard falls" is signalled.

    reward and guard are aligned series (one value per logging step). At position i the last `window` values
    (i - window + 1 .. i) are tested: the reward's Kendall tau must be >= min_tau and the guard's <= -min_tau
    (with window 5 and min_tau 0.6: at least 8 of the 10 pairs of steps agree with the trend). After an alert the
    next window - 1 positions are quiet, so a long stretch of hacking signals once per window, not at every step.
    A window holding NaN is not tested.

    Worked example (window 3): reward [1, 2, 3, 4, 5, 6] with guard [6, 5, 4, 3, 2, 1] -> [2, 5] (positions 3
    and 4 are quiet after the alert at 2); the same reward with a flat guard [6, 6, 6, 6, 6, 6] -> [].
    """
    if len(reward) != len(guard):
        raise ValueError(f"reward and guard series differ in length ({len(reward)} vs {len(guard)}).")
    if window < 2:
        raise ValueError(f"window={window}: a trend needs at least 2 values.")
    alerts: list[int] = []
    for end in range(window, len(reward) + 1):
        if alerts and end - 1 - alerts[-1] < window:
            continue
        rewards, guards = reward[end - window : end], guard[end - window : end]
        if any(math.isnan(x) for x in (*rewards, *guards)):
            continue
        if kendall_tau(rewards) >= min_tau and kendall_tau(guards) <= -min_tau:
            alerts.append(end - 1)
    return alerts


def guard_series(log_history: Sequence[dict], guard_metric: str) -> tuple[list[float], list[float], list[int]]:
    """(reward, guard, step) series from logged records that hold both the reward and the guard metric.

    A guard among the eval metrics (`eval/...`) pairs with `eval/reward`, any other with the training `reward`.
    Raises ValueError naming the logged metrics when records with a reward exist but none has the guard metric
    (a misspelt guard_metric would otherwise never fire).
    """
    reward_key = "eval/reward" if guard_metric.startswith("eval/") else "reward"
    with_reward = [record for record in log_history if reward_key in record]
    records = [record for record in with_reward if guard_metric in record]
    if with_reward and not records:
        available = sorted({key for record in with_reward for key in record} - {"step", "epoch"})
        raise ValueError(f"guard_metric={guard_metric!r} is not a logged metric; choose one of {available}.")
    return (
        [float(r[reward_key]) for r in records],
        [float(r[guard_metric]) for r in records],
        [int(r.get("step", i)) for i, r in enumerate(records)],
    )


def guard_message(log_history: Sequence[dict], guard_metric: str, window: int) -> tuple[int | None, str | None]:
    """(the latest logged step, a warning) when, over the last `window` logged values up to that step, the reward
    rose while `guard_metric` fell; (step, None) otherwise."""
    rewards, guards, steps = guard_series(log_history, guard_metric)
    alerts = guard_alerts(rewards, guards, window)
    if not steps or not alerts or alerts[-1] != len(steps) - 1:
        return (steps[-1] if steps else None), None
    first = len(steps) - window
    reward_key = "eval/reward" if guard_metric.startswith("eval/") else "reward"
    return steps[-1], (
        f"Possible reward hacking: from step {steps[first]} to {steps[-1]} {reward_key!r} rose "
        f"({rewards[first]:.4g} -> {rewards[-1]:.4g}) while {guard_metric!r} fell ({guards[first]:.4g} -> "
        f"{guards[-1]:.4g}). Look at the completions (log_completions=True) before trusting the reward."
    )


# Signs that a run cannot learn, read from TRL's metric names: (metric, threshold, what it means, what usually fixes
# it). Each is tested from the run's start: a run whose groups reach the same reward only after it has learned (the
# demo, near the end) is not stalled.
STALL_SIGNS = (
    (
        "frac_reward_zero_std",
        0.9,
        "of the groups gave every completion the same reward (frac_reward_zero_std): their advantages are 0, so "
        "the loss is 0 and nothing is learned from them (all wrong: the task is out of the model's reach; all "
        "right: it is too easy)",
        "larger groups (num_generations), a higher temperature, an easier curriculum (prompts the model sometimes "
        "solves first), a reward that gives partial credit, or a supervised warm-up before GRPO, as the built-in "
        "demo does",
    ),
    (
        "completions/clipped_ratio",
        0.9,
        "of the completions were cut at max_completion_length (completions/clipped_ratio): their rewards judge "
        "unfinished text",
        "a larger max_completion_length, a prompt or reward that asks for shorter answers, checking that the model "
        "ends its answers with the tokenizer's EOS token, or mask_truncated_completions=True",
    ),
)
STALL_STEPS = 20  # optimizer steps a sign must last, from the start, before it is said


def stalled_since_start(
    log_history: Sequence[dict], metric: str, threshold: float, min_steps: int = STALL_STEPS
) -> tuple[int, float] | None:
    """(last step, mean value) when every training record logged so far has `metric` >= `threshold` and they reach
    optimizer step `min_steps` or later; None otherwise (eval records, `eval/...`, are not read).

    Worked example (threshold 0.9, min_steps 20): records at steps 10, 20 with frac_reward_zero_std 1.0, 0.96 ->
    (20, 0.98); the same at steps 5, 10 -> None (too few steps yet); 0.5 at step 10 then 1.0 at 20, 30 -> None.
    """
    values = [(int(r.get("step", 0)), float(r[metric])) for r in log_history if metric in r]
    if not values or values[-1][0] < min_steps or any(math.isnan(v) or v < threshold for _, v in values):
        return None
    return values[-1][0], sum(v for _, v in values) / len(values)


def stall_messages(log_history: Sequence[dict], min_steps: int = STALL_STEPS) -> dict[str, str]:
    """metric -> a warning, for each of STALL_SIGNS that holds since the run's start (see stalled_since_start)."""
    messages = {}
    for metric, threshold, meaning, fixes in STALL_SIGNS:
        found = stalled_since_start(log_history, metric, threshold, min_steps)
        if found is not None:
            step, mean = found
            messages[metric] = (
                f"This run may not be learning: in every logged step up to step {step}, {mean:.0%} {meaning}. "
                f"What usually helps: {fixes}."
            )
    return messages


class SignalWarnings:
    """The run's warnings read from its logged metrics (`GRPOTrainer.check_guard`, `check_learning_signals`), each
    said once: a guard alert once per logged step it fires at, each of STALL_SIGNS once per run."""

    def __init__(self):
        self.guard_step: int | None = None  # the logged step of the last guard alert said
        self.stalls: set[str] = set()  # the STALL_SIGNS metrics said

    def check_guard(self, log_history: Sequence[dict], guard_metric: str | None, window: int) -> None:
        """Warn when the reward rises while guard_metric falls (`guard_message`); None: no guard."""
        if guard_metric is None:
            return
        step, message = guard_message(log_history, guard_metric, window)
        if message and self.guard_step != step:
            self.guard_step = step
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def check_stalls(self, log_history: Sequence[dict]) -> None:
        """Warn for each sign of STALL_SIGNS that holds since the run's start (`stall_messages`)."""
        for metric, message in stall_messages(log_history).items():
            if metric not in self.stalls:
                self.stalls.add(metric)
                warnings.warn(message, RuntimeWarning, stacklevel=3)
