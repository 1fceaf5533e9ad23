#!/usr/bin/env python
"""Truncated sampling on the letter task (tests/letters.py): top_p=1.0 against top_p=0.9 with the keep sampling mask
(grpokit's default) and without it (TRL 1.16's full-vocabulary log-probs), same seeds, same tiny Qwen2, μ = 2 so
that the importance ratio against π_old takes part in the loss.

Two tasks. The letter task itself: a random model over 16 tokens, nearly uniform at the start, so that top_p=0.9
drops one or two real tokens. `--tail N`: the same prompts, reward and model with N junk tokens appended to the
vocabulary that hold `--tail-mass` of the first completion token's initial probability together
(`letters.long_tail_letter_model`: an LM-head bias −b on the junk tokens, b solved for the mass), so that top_p=0.9
drops a tail of junk, as on a trained language model.

Protocol (fixed before any long-tail result was seen): 100 optimizer steps, the settings above, the same seeds
0-29 for every setting on both tasks, run seed by seed (every setting of a seed before the next seed); for the long
tail N = 500 and a mass of 0.12 (so top_p=0.9 keeps every real token and some of the junk at the start). Seeds
30-99 were added on both tasks after the results of seeds 0-29 (no difference resolved on either task), to narrow
the standard errors; docs/benchmarks.md gives both. Then a confirmatory run on the letter task, declared before any
of its results were read: fresh seeds 100-399, the primary comparison top_p=0.9 with the mask minus top_p=1.0 in
`end` over those seeds alone, "learns at least as well" shown when its mean minus 2 standard errors is above -0.03
(a non-inferiority margin of 0.03 in end reward), "learns less well" when its mean plus 2 standard errors is below
0. Per run:

- `start`, `end`: the training reward (the run's own sampling: what a user deploying that top_p gets) averaged
  over the first and the last 8 generation batches; `reaches_0.6_at`: the optimizer step at whose batch that
  average first reaches 0.6;
- after training, at the first completion position of the 8 prompts (the token the reward reads), averaged over
  them: `p_right`, the policy's full-vocabulary probability of the right letter at temperature 1 (independent of
  sampling); `p_right_sampled`, its probability under the run's own sampling distribution (top_p applied);
  `greedy`, the share of prompts whose most likely token is the right letter; `junk_mass`, the junk tokens' share;
- `first_ratio`: the mean ratio of the first optimizer step's π_θ to the sampling log-probs (1 when they agree).

The comparison: per seed, the difference of each top_p=0.9 setting minus top_p=1.0 in `end` and in `p_right`; the
summary gives the means, the mean difference ± its standard error (sd / √n), and how many seeds are above, below and
equal. A difference is called resolved when its mean is more than 2 standard errors from 0, otherwise the claim is
neither shown nor refuted at that number of seeds.

    python benchmarks/truncated_sampling.py --steps 100 --seeds $(seq 0 99) \
        --out benchmarks/results/truncated_sampling.json
    python benchmarks/truncated_sampling.py --steps 100 --tail 500 --seeds $(seq 0 99) \
        --out benchmarks/results/truncated_sampling_tail.json
    python benchmarks/truncated_sampling.py --steps 100 --seeds $(seq 100 399) \
        --out benchmarks/results/truncated_sampling_confirm.json

An existing `--out` file of the same task is resumed: the runs it holds are kept, the others added.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

BASELINE = "top_p=1.0"
SETTINGS = {
    BASELINE: {"top_p": 1.0},
    "top_p=0.9, keep_sampling_mask (default)": {"top_p": 0.9},
    "top_p=0.9, keep_sampling_mask=False (TRL 1.16)": {"top_p": 0.9, "keep_sampling_mask": False},
}
REAL_TOKENS = 16  # the letter task's vocabulary; junk ids follow


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


def first_token_quality(model, tokenizer, args) -> dict[str, float]:
    """At the first completion position of the 8 letter prompts, averaged over them: the right letter's probability
    under the full-vocabulary policy and under the run's sampling distribution, the share of prompts it is the most
    likely token of, and the junk tokens' probability."""
    import torch
    from letters import LETTERS

    from grpokit.rollout.engine import SamplingParams
    from grpokit.rollout.sampling import filter_logits

    params = SamplingParams(
        max_new_tokens=1,
        temperature=args.temperature,
        top_p=args.top_p,
        keep_sampling_mask=args.keep_sampling_mask,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
    )
    prompts = torch.tensor([tokenizer(f"{c}:")["input_ids"] for c in LETTERS])
    right = torch.tensor(tokenizer.convert_tokens_to_ids(list(LETTERS)))
    rows = torch.arange(len(LETTERS))
    with torch.no_grad():
        logits = model(prompts).logits[:, -1].float()  # [8, V]
    policy = (logits / args.temperature).softmax(-1)
    sampled = filter_logits(logits, params).softmax(-1)
    return {
        "p_right": round(policy[rows, right].mean().item(), 4),
        "p_right_sampled": round(sampled[rows, right].mean().item(), 4),
        "greedy": round((policy.argmax(-1) == right).float().mean().item(), 4),
        "junk_mass": round(policy[:, REAL_TOKENS:].sum(-1).mean().item(), 4),
    }


WINDOW = 8  # generation batches (with μ = 2 one is trained on for two optimizer steps)


def moving_average(rewards: list[float]) -> list[float]:
    """The reward averaged over each WINDOW consecutive generation batches."""
    return [sum(rewards[i - WINDOW : i]) / WINDOW for i in range(WINDOW, len(rewards) + 1)]


def reaches(steps: list[int], curve: list[float], level: float) -> int | None:
    """The optimizer step at whose batch the moving average first reaches level (None: never)."""
    return next((steps[i + WINDOW - 1] for i, r in enumerate(curve) if r >= level), None)


def paired(differences: list[float]) -> dict:
    """Mean, standard error (sd / √n) and signs of per-seed paired differences."""
    n = len(differences)
    mean = statistics.fmean(differences)
    se = statistics.stdev(differences) / math.sqrt(n) if n > 1 else math.nan
    return {
        "n": n,
        "mean": round(mean, 4),
        "se": round(se, 4),
        "above": sum(d > 0 for d in differences),
        "below": sum(d < 0 for d in differences),
        "equal": sum(d == 0 for d in differences),
        "resolved": bool(n > 1 and abs(mean) > 2 * se),
        "per_seed": [round(d, 4) for d in differences],
    }


MASK, NO_MASK = list(SETTINGS)[1:]
# The paired comparisons: each top_p=0.9 setting against top_p=1.0, and the mask against TRL's update.
COMPARISONS = [(MASK, BASELINE), (NO_MASK, BASELINE), (MASK, NO_MASK)]
PAIRED_METRICS = ("end", "p_right", "p_right_sampled")


def summarize(results: dict) -> dict:
    """Per setting the means over its seeds, and its paired differences (`COMPARISONS`) in the final training
    reward and the right letter's probabilities (over the seeds that have both; a metric only where recorded)."""
    runs = {name: {r["seed"]: r for key, r in results.items() if key.startswith(f"{name}, seed ")} for name in SETTINGS}
    summary = {}
    for name, own in runs.items():
        if not own:
            continue
        row = {"seeds": sorted(own)}
        for metric in ("start", "end", "p_right", "p_right_sampled", "greedy", "junk_mass"):
            values = [r[metric] for r in own.values() if metric in r]
            if values:
                row[metric] = {"n": len(values), "mean": round(statistics.fmean(values), 4)}
        for other in (b for a, b in COMPARISONS if a == name):
            for metric in PAIRED_METRICS:
                seeds = [s for s in sorted(own) if s in runs[other] and metric in own[s] and metric in runs[other][s]]
                if seeds:
                    row[f"{metric} minus {other}"] = paired([own[s][metric] - runs[other][s][metric] for s in seeds])
        summary[name] = row
    return summary


def merged_results(paths: list[str]) -> dict:
    """The runs of several `--out` files of one task (the same steps and tail), e.g. seeds run in two batches."""
    documents = [json.loads(Path(path).read_text()) for path in paths]
    tasks = {json.dumps({k: d.get(k) for k in ("steps", "tail", "tail_mass")}) for d in documents}
    if len(tasks) > 1:
        raise SystemExit(f"--summarize: these files hold different tasks ({sorted(tasks)}): give one task's files.")
    return {key: row for d in documents for key, row in d["results"].items()}


def run_one(options: dict, seed: int, args, output_dir: Path) -> dict:
    """One training run of the task at that seed and setting, with the measures above."""
    from letters import letter_config, letter_dataset, long_tail_letter_model, repeat_letter, tiny_letter_model

    from grpokit import GRPOTrainer

    if args.tail:
        model, tokenizer = long_tail_letter_model(args.tail, args.tail_mass, seed=seed)
    else:
        model, tokenizer = tiny_letter_model(seed=seed)
    config = letter_config(output_dir, num_iterations=2, max_steps=args.steps, seed=seed, **options)
    started = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=config,
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
    )
    initial = first_token_quality(trainer.unwrapped_model, tokenizer, config)
    ratio = first_ratio(trainer)
    trainer.train()
    logged = [(r["step"], r["reward"]) for r in trainer.state.log_history if "reward" in r]
    steps, rewards = [step for step, _ in logged], [reward for _, reward in logged]
    curve = moving_average(rewards)
    return {
        "options": options,
        "seed": seed,
        "first_ratio": round(ratio, 5),
        "start": round(curve[0], 3),
        "end": round(curve[-1], 3),
        "reaches_0.6_at": reaches(steps, curve, 0.6),
        **first_token_quality(trainer.unwrapped_model, tokenizer, config),
        "initial": initial,
        "rewards": [round(r, 3) for r in rewards],
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tail", type=int, default=0, help="junk tokens appended to the vocabulary (0: none)")
    parser.add_argument("--tail-mass", type=float, default=0.12, help="their initial probability together")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--summarize", nargs="+", metavar="FILE", help="print the summary of these --out files' runs together, run none"
    )
    args = parser.parse_args(argv)
    if args.summarize:
        summary = summarize(merged_results(args.summarize))
        for row in summary.values():  # the means and differences, without each seed's
            for value in row.values():
                if isinstance(value, dict):
                    value.pop("per_seed", None)
        print(json.dumps(summary, indent=1))
        return 0
    if args.tail and not 0 < args.tail_mass < 1:
        parser.error(f"--tail-mass must be in (0, 1), got {args.tail_mass}: the junk tokens' initial share.")
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root / "src"), str(root / "tests")]  # this tree's grpokit, and the letter task
    warnings.filterwarnings("ignore")
    task = {"steps": args.steps, "tail": args.tail, "tail_mass": args.tail_mass if args.tail else None}
    out = Path(args.out) if args.out else None
    stored = json.loads(out.read_text()) if out is not None and out.exists() else {**task, "results": {}}
    if any(stored.get(key, value) != value for key, value in task.items()):
        parser.error(f"{out} holds another task ({ {k: stored.get(k) for k in task} }): give another --out.")
    results = stored["results"]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name, options in SETTINGS.items():
                key = f"{name}, seed {seed}"
                if key in results:
                    continue
                results[key] = row = run_one(options, seed, args, Path(tmp) / f"{len(results)}")
                print(
                    f"{key}: ratio {row['first_ratio']:.5f}, reward {row['start']} -> {row['end']}, 0.6 at step "
                    f"{row['reaches_0.6_at']}, p_right {row['initial']['p_right']} -> {row['p_right']} "
                    f"({row['seconds']} s)",
                    flush=True,
                )
                if out is not None:
                    seeds = sorted({r["seed"] for r in results.values()})
                    document = {**task, "seeds": seeds, "summary": summarize(results), "results": results}
                    out.write_text(json.dumps(document, indent=1))
    print(json.dumps(summarize(results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
