#!/usr/bin/env python
"""Truncated sampling on the letter task (tests/letters.py): top_p=1.0 against top_p=0.9 with the keep sampling mask
(grpokit's default) and without it (TRL 1.16's full-vocabulary log-probs), same seeds, same tiny Qwen2, μ = 2 so
that the importance ratio against π_old takes part in the loss. Per setting and seed: the reward averaged over 8
generation batches at the start and at the end, the first optimizer step at which that average reaches 0.6, and the
mean ratio of the first optimizer step's π_θ to the sampling log-probs (1 for an unchanged policy when the log-probs
agree).

    python benchmarks/truncated_sampling.py --steps 100 --seeds 0 1 2 --out benchmarks/results/truncated_sampling.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

SETTINGS = {
    "top_p=1.0": {"top_p": 1.0},
    "top_p=0.9, keep_sampling_mask (default)": {"top_p": 0.9},
    "top_p=0.9, keep_sampling_mask=False (TRL 1.16)": {"top_p": 0.9, "keep_sampling_mask": False},
}


def first_ratio(trainer) -> float:
    """exp(log π_θ − sampling log-prob) averaged over the loss tokens of one generation batch of the trained
    policy, before any step on it (the first pass of μ = 2: π_θ is the weights that sampled)."""
    import torch

    from grpokit.logprobs import token_logprobs

    batch = trainer.generate_batch()
    with torch.no_grad():
        logprobs, _ = token_logprobs(
            trainer.unwrapped_model,
            batch.input_ids,
            batch.input_mask,
            batch.completion_ids.shape[1],
            trainer.args.temperature,
            sampling_mask=batch.sampling_mask,
        )
    mask = batch.loss_mask.bool()
    return torch.exp(logprobs - batch.sampling_logprobs)[mask].mean().item()


WINDOW = 8  # generation batches (with μ = 2 one is trained on for two optimizer steps)


def moving_average(rewards: list[float]) -> list[float]:
    """The reward averaged over each WINDOW consecutive generation batches."""
    return [sum(rewards[i - WINDOW : i]) / WINDOW for i in range(WINDOW, len(rewards) + 1)]


def reaches(steps: list[int], curve: list[float], level: float) -> int | None:
    """The optimizer step at whose batch the moving average first reaches level (None: never)."""
    return next((steps[i + WINDOW - 1] for i, r in enumerate(curve) if r >= level), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root / "src"), str(root / "tests")]  # this tree's grpokit, and the letter task
    warnings.filterwarnings("ignore")
    from letters import letter_config, letter_dataset, repeat_letter, tiny_letter_model

    from grpokit import GRPOTrainer

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in SETTINGS.items():
            for seed in args.seeds:
                model, tokenizer = tiny_letter_model(seed=seed)
                config = letter_config(
                    Path(tmp) / f"{len(results)}",
                    num_iterations=2,
                    max_steps=args.steps,
                    seed=seed,
                    **options,
                )
                started = time.perf_counter()
                trainer = GRPOTrainer(
                    model=model,
                    reward_funcs=repeat_letter,
                    args=config,
                    train_dataset=letter_dataset(),
                    processing_class=tokenizer,
                )
                ratio = first_ratio(trainer)
                trainer.train()
                logged = [(r["step"], r["reward"]) for r in trainer.state.log_history if "reward" in r]
                steps, rewards = [step for step, _ in logged], [reward for _, reward in logged]
                curve = moving_average(rewards)
                seconds = round(time.perf_counter() - started, 1)
                results[f"{name}, seed {seed}"] = {
                    "options": options,
                    "seed": seed,
                    "first_ratio": round(ratio, 5),
                    "start": round(curve[0], 3),
                    "end": round(curve[-1], 3),
                    "reaches_0.6_at": reaches(steps, curve, 0.6),
                    "rewards": [round(r, 3) for r in rewards],
                    "seconds": seconds,
                }
                row = results[f"{name}, seed {seed}"]
                print(
                    f"{name}, seed {seed}: ratio {ratio:.5f}, reward {row['start']} -> {row['end']}, "
                    f"0.6 at step {row['reaches_0.6_at']} ({seconds} s)",
                    flush=True,
                )
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
