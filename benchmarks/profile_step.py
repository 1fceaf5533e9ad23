#!/usr/bin/env python
"""Where one GRPO step's time goes, for grpokit (and, for comparison, TRL), on a bench_vs_trl configuration.

    python benchmarks/profile_step.py --config vocab32k --impl grpokit --warmup 1 --steps 2
    python benchmarks/profile_step.py --config vocab32k --impl trl --warmup 1 --steps 2
    python benchmarks/profile_step.py --config vocab32k --impl grpokit --cprofile --torch-profiler   # op detail

Builds the same model and uses the same trainer arguments as bench_vs_trl.py. The phases are timed by wrapping,
in this process only (no library file is changed), the functions each trainer calls for them: the rollout
(`generate`), the model forwards inside it, the reference and policy log-prob forwards, the loss, the backward,
gradient clipping, the optimizer step and the rewards. Wrapped calls are timed with perf_counter (after a CUDA
synchronize on GPU); the first `--warmup` steps are run but not counted. "other" is the step's wall time minus the
top-level phases (logging, batching, masks, advantages...).

`--cprofile` prints the top functions (cProfile over the measured steps; it slows Python-heavy parts such as the
decode loop), `--torch-profiler` the top operators by self CPU time (a separate pass over the same steps).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import (
    CONFIGS,
    LORA,
    build_model_dir,
    common_args,
    make_dataset,
    package_root,
    peak_rss_since_reset_mib,
    reset_peak_rss,
    reward_len,
)


class PhaseTimer:
    """Accumulates wall time per phase name while `active`; `context` names the enclosing top-level phase."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.active = False
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.stack: list[str] = []
        self.max_rss: dict[str, float] = defaultdict(float)  # MiB, per innermost phase (`sample_rss`, `exact`)
        self.exact = False  # `track_peak_exactly`

    def track_peak_exactly(self):
        """Read the kernel's resident-set high-water mark at every phase boundary, charge it to the innermost phase
        that just ran (or "outside phases"), and reset it: each phase's exact peak, not a 20 ms sample's."""
        self.exact = True
        reset_peak_rss()

    def _charge_peak(self):
        if self.exact:
            label = self.stack[-1] if self.stack else "outside phases"
            self.max_rss[label] = max(self.max_rss[label], peak_rss_since_reset_mib() or 0.0)
            reset_peak_rss()

    def sample_rss(self, interval: float = 0.02):
        """Start a thread that samples the process's resident memory every `interval` s and keeps the largest value
        seen during each innermost phase ("outside phases" between them): where the step's peak happens."""
        import threading

        import psutil

        process = psutil.Process()

        def run():
            while True:
                label = self.stack[-1] if self.stack else "outside phases"
                rss = process.memory_info().rss / 2**20
                self.max_rss[label] = max(self.max_rss[label], rss)
                time.sleep(interval)

        threading.Thread(target=run, daemon=True).start()

    def _sync(self):
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def wrap(self, fn, name):
        """name: a phase name, or a callable(stack) -> name (to classify a call by the phase it runs inside)."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            label = name(self.stack) if callable(name) else name
            self._sync()
            self._charge_peak()
            self.stack.append(label)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self._charge_peak()
                self.stack.pop()
                if self.active:
                    self.totals[label] += time.perf_counter() - started
                    self.counts[label] += 1

        return timed


def instrument_grpokit(trainer, timer: PhaseTimer):
    import grpokit.experience as experience
    import grpokit.logprobs as glogprobs
    import grpokit.micro_batch as micro_batch
    import grpokit.rollout.hf as hf

    trainer.engine.generate = timer.wrap(trainer.engine.generate, "rollout")
    hf.CachedDecoder.prefill = timer.wrap(hf.CachedDecoder.prefill, "rollout: model forwards")
    hf.CachedDecoder.step = timer.wrap(hf.CachedDecoder.step, "rollout: model forwards")
    hf.CachedDecoder.keep = timer.wrap(hf.CachedDecoder.keep, "rollout: drop finished rows")
    hf.sample_tokens = timer.wrap(hf.sample_tokens, "rollout: sampling arithmetic")
    trainer.codec.decode = timer.wrap(trainer.codec.decode, "decode completions")
    trainer.scorer.score = timer.wrap(trainer.scorer.score, "reward functions")
    # On-policy with beta > 0 the experience maker's no-grad forwards are the reference's (π_old is the sampler's).
    experience.logprobs_in_chunks = timer.wrap(experience.logprobs_in_chunks, "reference log-probs (forward)")
    experience.token_logprobs = timer.wrap(experience.token_logprobs, "ref: token_logprobs")
    micro_batch.token_logprobs = timer.wrap(micro_batch.token_logprobs, "policy forward (log-probs + entropy)")

    def head_label(stack):
        return ("ref" if stack and stack[-1].startswith("ref") else "policy") + ": chunked LM head"

    glogprobs.chunked_token_logprobs = timer.wrap(glogprobs.chunked_token_logprobs, head_label)
    micro_batch.policy_loss = timer.wrap(micro_batch.policy_loss, "loss")
    acc = trainer.accelerator
    acc.backward = timer.wrap(acc.backward, "backward")
    acc.clip_grad_norm_ = timer.wrap(acc.clip_grad_norm_, "grad clip")
    trainer.optimizer.step = timer.wrap(trainer.optimizer.step, "optimizer step")


def instrument_trl(trainer, timer: PhaseTimer):
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model)
    model.generate = timer.wrap(model.generate, "rollout")
    inner_forward = model.forward

    def forward_label(stack):
        return "rollout: model forwards" if "rollout" in stack else "model forward (log-probs)"

    model.forward = timer.wrap(inner_forward, forward_label)
    trainer._calculate_rewards = timer.wrap(trainer._calculate_rewards, "reward functions")
    tokenizer = trainer.processing_class
    tokenizer.batch_decode = timer.wrap(tokenizer.batch_decode, "decode completions")

    def logps_label(stack):
        return "policy forward (log-probs + entropy)" if "loss" in stack else "reference log-probs (forward)"

    trainer._get_per_token_logps_and_entropies = timer.wrap(trainer._get_per_token_logps_and_entropies, logps_label)
    trainer.compute_loss = timer.wrap(trainer.compute_loss, "loss")
    acc = trainer.accelerator
    acc.backward = timer.wrap(acc.backward, "backward")
    acc.clip_grad_norm_ = timer.wrap(acc.clip_grad_norm_, "grad clip")
    # The optimizer is created inside train(): time AdamW.step for this process.
    torch.optim.AdamW.step = timer.wrap(torch.optim.AdamW.step, "optimizer step")


# Top-level phases (their sum plus "other" is the step); the rest are shown indented under their parent.
TOP = [
    "rollout",
    "decode completions",
    "reward functions",
    "reference log-probs (forward)",
    "loss",
    "backward",
    "grad clip",
    "optimizer step",
]
CHILDREN = {
    "rollout": ["rollout: model forwards", "rollout: sampling arithmetic", "rollout: drop finished rows"],
    "loss": ["policy forward (log-probs + entropy)"],
}


def make_trainer(impl, config, model_dir, workdir, steps, hook, extra_args=None, lora=False):
    args_kwargs = common_args(config, str(workdir / f"out_{impl}"), steps, 1e-5, 0.04, 42) | (extra_args or {})
    peft = {}
    if lora:
        from peft import LoraConfig

        peft = {"peft_config": LoraConfig(task_type="CAUSAL_LM", **LORA)}
    dataset = make_dataset(max(64, 8 * steps), 42)
    if impl == "trl":
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        class Hook(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "num_tokens" in logs:
                    hook()

        return GRPOTrainer(
            model=str(model_dir),
            reward_funcs=reward_len,
            args=GRPOConfig(**args_kwargs),
            train_dataset=dataset,
            callbacks=[Hook()],
            **peft,
        )
    from grpokit import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=reward_len, args=GRPOConfig(**args_kwargs), train_dataset=dataset, **peft
    )

    class Hooked(list):
        def append(self, item):
            super().append(item)
            if isinstance(item, dict) and "num_tokens" in item:
                hook()

    trainer.state.log_history = Hooked()
    return trainer


def phase_table(impl, timer: PhaseTimer, wall: float, steps: int) -> str:
    lines = ["| phase | s / step | % of step | calls / step |", "|---|---|---|---|"]
    if impl == "grpokit":
        # grpokit's policy forward runs inside _train_micro_batch, not inside policy_loss: show it top-level.
        top = [*TOP[:4], "policy forward (log-probs + entropy)", *TOP[4:]]
        children = {"rollout": CHILDREN["rollout"]}
    else:
        top, children = TOP, {"loss": CHILDREN["loss"], "rollout": ["rollout: model forwards"]}
    accounted = 0.0
    for phase in top:
        seconds = timer.totals.get(phase, 0.0)
        accounted += seconds
        label = phase if not (impl == "trl" and phase == "loss") else "policy forward + loss (compute_loss)"
        lines.append(
            f"| {label} | {seconds / steps:.3f} | {100 * seconds / wall:.1f} | {timer.counts.get(phase, 0) / steps:g} |"
        )
        kids = children.get(phase, [])
        for child in kids:
            c = timer.totals.get(child, 0.0)
            lines.append(
                f"| &nbsp;&nbsp;{child} | {c / steps:.3f} | {100 * c / wall:.1f} | "
                f"{timer.counts.get(child, 0) / steps:g} |"
            )
        if phase == "rollout" and kids:
            rest = seconds - sum(timer.totals.get(c, 0.0) for c in kids)
            lines.append(
                f"| &nbsp;&nbsp;rollout: rest (outside the model forwards) | {rest / steps:.3f} | "
                f"{100 * rest / wall:.1f} | |"
            )
    other = wall - accounted
    lines.append(f"| other (batching, masks, advantages, logging) | {other / steps:.3f} | {100 * other / wall:.1f} | |")
    lines.append(f"| **step (wall)** | **{wall / steps:.3f}** | 100 | |")
    if timer.max_rss:
        lines += ["", "| innermost phase | largest RSS seen during it (MiB) |", "|---|---|"]
        lines += [f"| {label} | {rss:,.0f} |" for label, rss in sorted(timer.max_rss.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="vocab32k")
    parser.add_argument("--impl", choices=["grpokit", "trl"], default="grpokit")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="override the config's precision")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="override the config's number of decoder layers (a cheaper proxy of the same widths)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cprofile", action="store_true", help="also print cProfile's top functions")
    parser.add_argument("--torch-profiler", action="store_true", help="also print torch.profiler's top operators")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--lora", action="store_true", help="train bench_vs_trl's LoRA adapter")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="sample RSS every 20 ms and report the largest value seen in each phase during train() "
        "(warm-up included), and the RSS when train() starts",
    )
    parser.add_argument(
        "--exact-memory",
        action="store_true",
        help="like --memory, but each phase's exact peak (the kernel's VmHWM, reset at every phase "
        "boundary; Linux) instead of 20 ms samples",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument(
        "--src",
        default=None,
        metavar="DIR",
        help="import grpokit from this source tree instead (e.g. `git archive HEAD grpokit | tar -x "
        "-C DIR`), to profile an earlier version",
    )
    parser.add_argument(
        "--plain-head",
        action="store_true",
        help="grpokit: force the plain logits path (grpokit.logprobs.USE_CHUNKED_HEAD = False)",
    )
    parser.add_argument(
        "--args",
        default="{}",
        metavar="JSON",
        help='extra GRPOConfig arguments, e.g. \'{"model_init_kwargs": {"dtype": "bfloat16"}}\'',
    )
    args = parser.parse_args(argv)
    # Before anything imports grpokit: this source tree (or --src's), not an installed copy.
    sys.path.insert(0, package_root(args.src or Path(__file__).resolve().parent.parent))
    if args.plain_head:
        import grpokit.logprobs

        grpokit.logprobs.USE_CHUNKED_HEAD = False
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    config = dict(CONFIGS[args.config])
    if args.precision is not None:
        config["bf16"] = args.precision == "bf16"
    if args.layers is not None:
        config["num_layers"] = args.layers
    if config["cuda"] and not torch.cuda.is_available():
        print("this configuration needs CUDA")
        return 0
    total_steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="grpokit-prof-") as tmp:
        workdir = Path(tmp)
        info = build_model_dir(config, workdir / "model")
        timer = PhaseTimer(config["cuda"])
        args.memory = args.memory or args.exact_memory
        if args.exact_memory:
            timer.track_peak_exactly()
        elif args.memory:
            timer.sample_rss()
        marks: list[float] = []
        profiler = None
        if args.cprofile:
            import cProfile

            profiler = cProfile.Profile()

        faults: list[int] = []  # the process's minor page faults at each mark (a fresh page's first touch)

        def hook():
            if config["cuda"]:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())  # marks[0] is train()'s start, marks[k] step k's end
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            if len(marks) == args.warmup + 1:
                timer.active = True
                if profiler:
                    profiler.enable()
            if len(marks) == total_steps + 1:
                timer.active = False
                if profiler:
                    profiler.disable()

        trainer = make_trainer(
            args.impl, config, workdir / "model", workdir, total_steps, hook, json.loads(args.args), args.lora
        )
        (instrument_trl if args.impl == "trl" else instrument_grpokit)(trainer, timer)
        load = os.getloadavg()[0]
        if args.memory:  # what the phases add to: weights, imports, the process (model loading's peak left out)
            import psutil

            timer.max_rss.clear()
            reset_peak_rss()
            rss_at_train = psutil.Process().memory_info().rss / 2**20
        hook()
        trainer.train()
        wall = marks[-1] - marks[args.warmup]
        variant = (f" (source {args.src})" if args.src else "") + (" (plain head)" if args.plain_head else "")
        print(
            f"\n## {args.impl}{variant} on `{args.config}` ({info['parameters'] / 1e6:.2f}M parameters, vocab "
            f"{info['model_vocab']}): {args.steps} timed step(s) after {args.warmup} warm-up, "
            f"{torch.get_num_threads()} threads, load average {load:.2f} -> {os.getloadavg()[0]:.2f}\n"
        )
        print(phase_table(args.impl, timer, wall, args.steps))
        print(f"\nMinor page faults per step: {(faults[-1] - faults[args.warmup]) / args.steps:,.0f}")
        if args.memory:
            print(f"\nRSS when train() starts: {rss_at_train:,.0f} MiB (the phases' peaks above are during train())")
        if profiler:
            import pstats

            stats = pstats.Stats(profiler)
            print("\ncProfile, top functions by cumulative time:")
            stats.sort_stats("cumulative").print_stats(args.top)
            print("cProfile, top functions by own time:")
            stats.sort_stats("tottime").print_stats(args.top)

        if args.torch_profiler:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if config["cuda"] else [])
            tp = profile(activities=activities)
            marks.clear()

            def hook2():
                marks.append(time.perf_counter())
                if len(marks) == args.warmup + 1:
                    tp.start()
                if len(marks) == total_steps + 1:
                    tp.stop()

            timer.active = False
            trainer = make_trainer(
                args.impl, config, workdir / "model", workdir, total_steps, hook2, json.loads(args.args), args.lora
            )
            with contextlib.redirect_stdout(sys.stderr):
                hook2()
                trainer.train()
            sort = "self_cuda_time_total" if config["cuda"] else "self_cpu_time_total"
            print(f"\ntorch.profiler, top operators by {sort}:")
            print(tp.key_averages().table(sort_by=sort, row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
