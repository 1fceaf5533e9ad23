"""Evaluation metrics as pure functions: pass@k (Chen et al. 2021) and the per-prompt aggregation.

An evaluation samples n = `num_generations_eval` completions for every prompt of the eval set and scores them
with the run's reward functions. A completion *passes* a reward function when its reward is >= `pass_threshold`.
For each function, with c of a prompt's n completions passing:

    pass@k  = 1 - C(n - c, k) / C(n, k)     the unbiased estimate of "at least one of k samples passes"
    mean@n  = the mean reward of the n samples (the raw reward, not thresholded)

each averaged over prompts; `rewards/<name>/mean` is the mean over all completions. A reward of None ("does not
apply") takes the completion out of that function's statistics: a prompt is then counted with the completions
that were scored, and left out of pass@k when fewer than k of them were.

Nothing here samples or loads anything: the trainer (`GRPOTrainer.evaluate`) produces one record per prompt,
these functions turn the records into the `eval/...` metrics, and `grpokit eval` prints and saves them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them correct) is correct.

    The unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", §2.1):
    1 - C(n - c, k) / C(n, k). Exact integer binomials, so large n do not overflow.

    Worked examples:
        pass_at_k(4, 1, 2) = 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5
        pass_at_k(4, 1, 1) = 1 - C(3, 1) / C(4, 1) = 1/4  (pass@1 is the share of correct samples, c / n)
        pass_at_k(5, 0, 3) = 0.0;  pass_at_k(5, 5, 3) = 1.0;  pass_at_k(5, 3, 3) = 1.0 (only 2 wrong: any 3 hit)
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n; got n={n}, k={k}.")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n; got n={n}, c={c}.")
    if n - c < k:  # every draw of k samples contains a correct one
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def eval_ks(num_generations: int) -> list[int]:
    """The k of pass@k that an evaluation with n samples per prompt reports: 1 and n."""
    return sorted({1, num_generations})


def evaluation_metrics(
    records: list[dict[str, Any]], reward_names: Sequence[str], threshold: float = 1.0, prefix: str = "eval/"
) -> dict[str, float]:
    """The `eval/...` metrics of per-prompt records.

    Each record holds one prompt's n completions: `rewards` {function name: [n floats or None]}, `reward` (the
    weighted sum: [n floats or None]), `lengths` ([n] completion lengths in tokens) and `truncated` ([n] bools:
    hit max_completion_length). Every record has the same n.

    Returns `eval/reward` (mean weighted reward over all completions), `eval/completions/mean_length`,
    `eval/completions/clipped_ratio`, and per function `eval/rewards/<name>/mean` (over completions),
    `eval/rewards/<name>/mean@<n>` (per-prompt mean, averaged over prompts) and `eval/rewards/<name>/pass@<k>` for
    k in 1 and n. A metric with nothing to average (every reward None) is left out.

    Worked example: n = 4, threshold 1.0, one function "acc"; prompt A scores [1, 0, 0, 0], prompt B [1, 1, 0, 1]:
        pass@1 = mean(1/4, 3/4) = 0.5
        pass@4 = mean(1 - C(3,4)/C(4,4), 1) = mean(1, 1) = 1.0
        mean@4 = mean(0.25, 0.75) = 0.5 = rewards/acc/mean (no None, so the two weightings agree)
    """
    if not records:
        return {}
    n = len(records[0]["reward"])
    if any(len(r["reward"]) != n for r in records):
        raise ValueError("Every evaluation record must hold the same number of completions.")
    metrics: dict[str, float | None] = {
        "reward": _mean([x for r in records for x in r["reward"] if x is not None]),
        "completions/mean_length": _mean([float(x) for r in records for x in r["lengths"]]),
        "completions/clipped_ratio": _mean([float(bool(x)) for r in records for x in r["truncated"]]),
    }
    for name in reward_names:
        per_prompt = [[x for x in r["rewards"][name] if x is not None] for r in records]
        metrics[f"rewards/{name}/mean"] = _mean([x for scored in per_prompt for x in scored])
        metrics[f"rewards/{name}/mean@{n}"] = _mean([_mean(scored) for scored in per_prompt if scored])
        for k in eval_ks(n):
            metrics[f"rewards/{name}/pass@{k}"] = _mean(
                [
                    pass_at_k(len(scored), sum(x >= threshold for x in scored), k)
                    for scored in per_prompt
                    if len(scored) >= k
                ]
            )
    return {prefix + key: value for key, value in metrics.items() if value is not None}


def group_records(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    scores,
    rewards,
    lengths,
    truncated,
    reward_names: Sequence[str],
    num_generations: int,
) -> list[dict[str, Any]]:
    """One record per prompt from a batch of N = B·G consecutive completions (G = num_generations per prompt).

    scores: [N, F] (NaN = None), rewards: [N], lengths: [N], truncated: [N] — tensors or nested lists. The records
    are JSON-ready (None for NaN) and are what `evaluation_metrics` aggregates.
    """

    def listed(values) -> list:
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        return [None if isinstance(v, float) and math.isnan(v) else v for v in values]

    scores = [listed(row) for row in (scores.tolist() if hasattr(scores, "tolist") else scores)]
    rewards, lengths, truncated = listed(rewards), listed(lengths), listed(truncated)
    records = []
    for start in range(0, len(completions), num_generations):
        group = range(start, start + num_generations)
        records.append(
            {
                "prompt": prompts[start],
                "completions": [completions[i] for i in group],
                "rewards": {name: [scores[i][j] for i in group] for j, name in enumerate(reward_names)},
                "reward": [rewards[i] for i in group],
                "lengths": [int(lengths[i]) for i in group],
                "truncated": [bool(truncated[i]) for i in group],
            }
        )
    return records


def format_table(
    metrics: dict[str, float], reward_names: Sequence[str], num_generations: int, prefix: str = "eval/"
) -> str:
    """A plain-text table: one row per reward function (mean, mean@n, pass@k), then the overall figures."""
    columns = ["mean", f"mean@{num_generations}", *(f"pass@{k}" for k in eval_ks(num_generations))]
    width = max([len("reward function"), *(len(name) for name in reward_names)])
    lines = [f"{'reward function':<{width}}  " + "  ".join(f"{c:>9}" for c in columns)]
    for name in reward_names:
        cells = [metrics.get(f"{prefix}rewards/{name}/{c}") for c in columns]
        lines.append(f"{name:<{width}}  " + "  ".join(f"{'-' if v is None else f'{v:.4f}':>9}" for v in cells))
    for key in ("reward", "completions/mean_length", "completions/clipped_ratio"):
        if prefix + key in metrics:
            lines.append(f"{key}: {metrics[prefix + key]:.4f}")
    return "\n".join(lines)
