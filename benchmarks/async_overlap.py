"""Asynchronous generation against the synchronous loop: tokens per second on the same model, data and config, in one
run of this script.

    python benchmarks/async_overlap.py                 # the in-process engine (sampling with the policy's copy)
    python benchmarks/async_overlap.py --tool-delay 0.3  # an agent whose every tool call takes 0.3 s

Settings compared (each a fresh model with the same seed):
- sync, 2 threads: the synchronous loop with both cores for every op (torch.set_num_threads(2));
- sync, 1 thread: the same on one core, which is also what the synchronous loop gets from an engine on one core and
  training on the other: they take turns;
- async, 1 + 1 threads: max_staleness=1, training on one thread and sampling on the other (on the CPU the in-process
  engine runs in a process of its own, on one thread), under the exact schedule (the default for whole batches);
- async, async_schedule='latest': the same, each batch sampled by the newest weights when it starts (not with
  --tool-delay: streamed groups always take the latest weights).

tokens/s is grpokit's num_tokens (prompt + completion tokens of every trained batch) over train()'s runtime, after a
warm-up run that is not counted; each setting runs --repeats times, interleaved, and the median is shown. "steady" is
the same from the end of the first optimizer step to the end of the last: what a long run gets, without the fixed
costs of a run's start (the first batch, which is never overlapped, and, asynchronously on the CPU, starting the
engine's process: forked in milliseconds from a server that imports torch and transformers once per Python process,
seconds, which the warm-up run starts). Each asynchronous setting's share of the
perfect overlap (below) is shown for both. The
synchronous runs also time their generation (generate_batch) and the rest, from which the script estimates what a
perfect overlap of those two phases would give against the two-thread loop (`overlap_estimate`). Results go to
benchmarks/results/async_overlap_<name>.json. The default shape (hidden 256, 96-token completions, 48 steps) spends
about as long sampling as training, as GRPO runs tend to; --hidden 512 --completion 48 is training-heavy. The first
batch is never overlapped (the trainer waits for it): 48 steps keep that to a few percent, as in a long run.
Completions end at EOS, so their lengths follow what each run's policy learns; --fixed-length makes every completion
--completion tokens long (EOS never sampled, as vLLM's throughput benchmark's ignore_eos), the same work per batch in
every setting.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.state import TrainerCallback
from grpokit.testing import build_char_tokenizer, build_tiny_model

LETTERS = "abcdefghijklmnop"


def first_letter(completions, letter, **kwargs):
    return [float(c[:1] == t) for c, t in zip(completions, letter)]


def slow_lookup(key: str) -> str:
    """Look up a key.

    Args:
        key: the key
    """
    time.sleep(DELAY)
    return key[::-1]


DELAY = 0.0


def trainer_for(directory: Path, options: argparse.Namespace, **overrides) -> GRPOTrainer:
    common = dict(
        output_dir=str(directory),
        per_device_train_batch_size=options.batch,
        num_generations=4,
        max_completion_length=options.completion,
        max_steps=options.steps,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=0,
        beta=options.beta,
        learning_rate=1e-4,
    )
    if options.tool_delay:
        from grpokit.rollout import ScriptedEngine
        from grpokit.testing import build_qwen_chat_tokenizer

        tokenizer = build_qwen_chat_tokenizer(("slow_lookup", "key", "answer"))
        model = build_tiny_model(
            len(tokenizer),
            hidden_size=options.hidden,
            num_layers=options.layers,
            seed=0,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
        )
        turns = [
            "<tool_call>\n"
            + json.dumps({"name": "slow_lookup", "arguments": {"key": "k1"}})
            + "\n</tool_call><|im_end|>",
            "answer<|im_end|>",
        ]

        def script(prompt_ids, index):  # first a tool call, then an answer
            text = tokenizer.decode(prompt_ids)
            return tokenizer(turns["<tool_response>" in text], add_special_tokens=False)["input_ids"]

        data = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": f"key k{i}"}], "letter": "a"} for i in range(64)]
        )
        return GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [float(len(str(c)) % 3) for c in completions],
            args=GRPOConfig(**{**common, **overrides}),
            train_dataset=data,
            processing_class=tokenizer,
            tools=[slow_lookup],
            rollout_engine=ScriptedEngine(script),
        )
    tokenizer = build_char_tokenizer(LETTERS + ":")
    if options.fixed_length:  # EOS never sampled: every completion is max_completion_length tokens
        common["generation_kwargs"] = {"suppress_tokens": [tokenizer.eos_token_id]}
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=options.hidden,
        num_layers=options.layers,
        seed=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    data = Dataset.from_list([{"prompt": f"{c}:", "letter": c} for c in LETTERS] * 8)
    return GRPOTrainer(
        model=model,
        reward_funcs=first_letter,
        args=GRPOConfig(**{**common, **overrides}),
        train_dataset=data,
        processing_class=tokenizer,
    )


class StepEnds(TrainerCallback):
    """When training began and each optimizer step ended (time.perf_counter()), with the tokens trained by then."""

    def __init__(self):
        self.began, self.ends = 0.0, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append((time.perf_counter(), state.num_tokens))


def measure(options, threads: int, **overrides) -> dict:
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as directory:
        trainer_for(Path(directory) / "warm", options, **{**overrides, "max_steps": 1}).train()
        trainer = trainer_for(Path(directory) / "run", options, **overrides)
        generating = []  # seconds in generate_batch (sampling, scoring, advantages), per batch
        generate_batch = trainer.generate_batch

        def timed_generate_batch():
            started = time.perf_counter()
            batch = generate_batch()
            generating.append(time.perf_counter() - started)
            return batch

        trainer.generate_batch = timed_generate_batch
        step_ends = StepEnds()
        trainer.add_callback(step_ends)
        summary = trainer.train().metrics
        tokens = trainer.state.num_tokens
        steps = [r for r in trainer.state.log_history if "loss" in r]
        waits = [r.get("perf/rollout_wait_fraction") for r in steps if "perf/rollout_wait_fraction" in r]
    runtime = summary["train_runtime"]
    (first_end, first_tokens), (last_end, last_tokens) = step_ends.ends[0], step_ends.ends[-1]
    return {
        "threads": threads,
        **overrides,
        "tokens": tokens,
        "runtime_s": runtime,
        "tokens_per_s": tokens / runtime,
        "steady_tokens_per_s": (last_tokens - first_tokens) / (last_end - first_end),
        "first_step_s": first_end - step_ends.began,  # starting (the engine's process too) and the first step
        # In a synchronous run, the time per batch spent generating and the rest (training, logging).
        "generate_s_per_batch": sum(generating) / len(generating),
        "train_s_per_batch": (runtime - sum(generating)) / len(generating),
        "trainer_wait_fraction": sum(waits) / len(waits) if waits else None,
    }


def overlap_estimate(two_threads: dict, one_thread: dict) -> float:
    """What a perfect overlap would give against the two-thread synchronous loop, estimated from the synchronous
    runs' own timings: one batch there takes generate + the rest on two threads; overlapped, with each half on one
    thread, a batch would take the slower half's one-thread time. (An estimate, not a bound: a process that only
    trains, or only samples, may run its half faster than the loop that alternates them.)"""
    sync = two_threads["generate_s_per_batch"] + two_threads["train_s_per_batch"]
    return sync / max(one_thread["generate_s_per_batch"], one_thread["train_s_per_batch"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (TRL default 0: no reference)")
    parser.add_argument("--tool-delay", type=float, default=0.0, help="seconds every tool call sleeps (an agent)")
    parser.add_argument(
        "--fixed-length",
        action="store_true",
        help="completions of exactly --completion tokens (EOS never sampled), so that every setting "
        "does the same work per batch whatever its policy learned",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three settings; the median is shown")
    parser.add_argument("--name", default=None)
    options = parser.parse_args()
    global DELAY
    DELAY = options.tool_delay
    settings = {
        "sync, 2 threads": (2, {}),
        "sync, 1 thread": (1, {}),
        "async (max_staleness=1), 1 + 1 threads": (1, {"max_staleness": 1}),
    }
    if not options.tool_delay:  # whole batches: the exact schedule (the default) against the latest weights
        settings["async, async_schedule='latest', 1 + 1 threads"] = (
            1,
            {"max_staleness": 1, "async_schedule": "latest"},
        )
    runs = {name: [] for name in settings}
    for _ in range(options.repeats):  # interleaved, so that a slow spell of the machine hits every setting alike
        for name, (threads, overrides) in settings.items():
            runs[name].append(measure(options, threads, **overrides))
    rows = {}
    for name, measured in runs.items():
        median = sorted(measured, key=lambda r: r["tokens_per_s"])[len(measured) // 2]
        steady = sorted(r["steady_tokens_per_s"] for r in measured)[len(measured) // 2]
        rows[name] = {
            **median,
            "steady_tokens_per_s": steady,
            "tokens_per_s_runs": [r["tokens_per_s"] for r in measured],
            "steady_tokens_per_s_runs": [r["steady_tokens_per_s"] for r in measured],
        }
    two, one = rows["sync, 2 threads"], rows["sync, 1 thread"]
    estimate = overlap_estimate(two, one)
    for row in rows.values():  # each setting against the two-thread loop, and that against the perfect overlap
        row["vs_2_threads"] = row["tokens_per_s"] / two["tokens_per_s"]
        row["steady_vs_2_threads"] = row["steady_tokens_per_s"] / two["steady_tokens_per_s"]
        row["of_perfect_overlap"] = row["vs_2_threads"] / estimate
        row["steady_of_perfect_overlap"] = row["steady_vs_2_threads"] / estimate
    print(
        f"{'setting':42s} {'tokens/s':>9s} {'vs sync 2':>9s} {'of perfect':>10s} {'steady':>9s} {'vs sync 2':>9s} "
        f"{'of perfect':>10s} {'trainer waited':>15s}"
    )
    for name, row in rows.items():
        wait = "" if row["trainer_wait_fraction"] is None else f"{row['trainer_wait_fraction']:.0%}"
        print(
            f"{name:42s} {row['tokens_per_s']:9.1f} {row['vs_2_threads']:8.2f}x {row['of_perfect_overlap']:10.0%} "
            f"{row['steady_tokens_per_s']:9.1f} {row['steady_vs_2_threads']:8.2f}x "
            f"{row['steady_of_perfect_overlap']:10.0%} {wait:>15s}"
        )
    print(
        f"synchronous seconds per batch, generating + the rest: 2 threads {two['generate_s_per_batch']:.3f} + "
        f"{two['train_s_per_batch']:.3f}, 1 thread {one['generate_s_per_batch']:.3f} + "
        f"{one['train_s_per_batch']:.3f}; a perfect overlap of these would give {estimate:.2f}x the 2 threads"
    )
    print("seconds to the end of the first step: " + ", ".join(f"{n} {r['first_step_s']:.1f}" for n, r in rows.items()))
    name = options.name or ("tool" if options.tool_delay else "engine")
    out = Path(__file__).parent / "results" / f"async_overlap_{name}.json"
    out.write_text(
        json.dumps(
            {
                "options": vars(options),
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "overlap_estimate_vs_2_threads": estimate,
                "results": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
