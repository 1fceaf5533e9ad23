#!/usr/bin/env python
"""Learning under asynchronous generation with each off-policy correction, on the built-in demo's task (grpokit.demo:
name the last of four letters; held-out accuracy under greedy decoding after the same supervised warm-up): the
synchronous loop, then max_staleness 1, 2 and 4 with off_policy_correction "behaviour" and "decoupled", same seed,
same steps, the demo's other settings. Prints a markdown table: held-out accuracy after training, the mean reward over
the last 20 steps, the mean clip ratio, the share of tokens the decoupled weight's cap dropped, and the time the GRPO
training took (train_runtime).

    python benchmarks/async_learning.py --steps 300

Under async_schedule "exact" (the default for whole batches) generation batch n is sampled by the weights of version
max(0, n - max_staleness) whatever the timing, so every row but the times is reproducible.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # this tree's grpokit, not an installed one


def settings(stalenesses: list[int]):
    """(max_staleness, off_policy_correction) of each run: the synchronous loop, then each staleness with each."""
    yield None, "behaviour"
    for staleness in stalenesses:
        for correction in ("behaviour", "decoupled"):
            yield staleness, correction


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def train(staleness: int | None, correction: str, steps: int, seed: int) -> dict:
    """One demo run (its printout swallowed); what the table shows of it."""
    from grpokit.demo import run_demo

    with tempfile.TemporaryDirectory() as output_dir, contextlib.redirect_stdout(io.StringIO()):
        result = run_demo(
            output_dir=output_dir,
            max_steps=steps,
            seed=seed,
            disable_tqdm=True,
            save_strategy="no",
            logging_steps=10,
            max_staleness=staleness,
            off_policy_correction=correction,
        )
    history = result["log_history"]
    records = [r for r in history if "reward" in r and "train_runtime" not in r]  # each the mean of 10 steps
    return {
        "accuracy": result["accuracy_after"],
        "before": result["accuracy_before"],
        "reward": mean([r["reward"] for r in records[-2:]]),
        "clip": mean([r["clip_ratio/region_mean"] for r in records]),
        "masked": mean([r["off_policy/masked_fraction"] for r in records if "off_policy/masked_fraction" in r]),
        "seconds": history[-1]["train_runtime"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="GRPO steps of each run (the demo's)")
    parser.add_argument("--stalenesses", default="1,2,4", help="the max_staleness values, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    rows = []
    for staleness, correction in settings([int(k) for k in options.stalenesses.split(",")]):
        found = train(staleness, correction, options.steps, options.seed)
        print(f"max_staleness={staleness} {correction}: {found}", file=sys.stderr, flush=True)
        rows.append((staleness, correction, found))
    before = rows[0][2]["before"]
    print(
        f"Held-out accuracy before GRPO (after the warm-up): {before:.1%}; {options.steps} GRPO steps, seed "
        f"{options.seed}.\n"
    )
    columns = (
        "max_staleness",
        "off_policy_correction",
        "held-out accuracy",
        "reward, last 20 steps",
        "clip_ratio/region_mean",
        "off_policy/masked_fraction",
        "training time",
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for staleness, correction, found in rows:
        cells = (
            "None (synchronous)" if staleness is None else str(staleness),
            correction,
            f"{found['accuracy']:.1%}",
            f"{found['reward']:.3f}",
            f"{found['clip']:.4f}",
            "" if math.isnan(found["masked"]) else f"{found['masked']:.4f}",  # not logged with "behaviour"
            f"{found['seconds']:.0f} s",
        )
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":  # an engine process may be spawned: it imports this file
    main()
