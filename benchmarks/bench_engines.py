#!/usr/bin/env python
"""Rollout engines: vLLM (`use_vllm=True`, colocated) vs grpokit's in-process engine (vs TRL + vLLM on GPU), same
model, same workload, one run each.

    # in the vLLM environment (docs/guides/vllm.md):
    python benchmarks/bench_engines.py --config small --out benchmarks/results/engines_small.json
    python benchmarks/bench_engines.py --config 50m
    python benchmarks/bench_engines.py --config qwen0.5b
    python benchmarks/bench_engines.py --config gpu-0.5b --engines hf vllm trl-vllm   # CUDA, trl installed
    python benchmarks/bench_engines.py --config gpu-1.5b --engines hf vllm trl-vllm
    python benchmarks/bench_engines.py --config small --engines hf hf-static hf-static-compile   # static decoding
    python benchmarks/bench_engines.py --config gpu-0.5b --engines hf hf-static trl trl-static   # CUDA graphs

Each engine runs in a fresh subprocess (vLLM changes the process it runs in). The model is random-weight with a
real architecture's shape (grpokit.testing, via bench_vs_trl.build_model_dir); its EOS is a token it cannot emit, so
every completion runs to max_completion_length and both engines produce exactly the same number of tokens.

- rollout tokens/s: completion tokens of one generation batch (the config's prompts x num_generations) over the
  wall-clock time of `engine.generate` (after one warm-up generation; the mean of --rollouts generations);
- full-step tokens/s: prompt + completion tokens per second over the training steps after the first (weight push,
  generation, rewards, π_old and the policy forward/backward, optimizer step: everything `trainer.train` does),
  timed by a step-end callback.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # this tree's grpokit, not an installed one
from bench_vs_trl import build_model_dir, common_args, make_dataset, reward_len

QWEN05 = dict(
    vocab_size=151_936,
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    max_position_embeddings=32_768,
    rope_theta=1_000_000.0,
)
QWEN15 = dict(
    vocab_size=151_936,
    hidden_size=1536,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    intermediate_size=8960,
    max_position_embeddings=32_768,
    rope_theta=1_000_000.0,
)

CONFIGS = {
    # ~3M parameters, character vocabulary; 4 prompts x 8 completions x 64 tokens per step.
    "small": dict(
        vocab_size=None,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=1024,
        max_position_embeddings=512,
        batch=32,
        num_generations=8,
        grad_accum=1,
        max_completion_length=64,
        bf16=True,
        cuda=False,
        steps=4,
    ),
    # ~47M parameters (32k vocabulary, tied): 4 prompts x 8 x 64 tokens.
    "50m": dict(
        vocab_size=32_000,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=2048,
        max_position_embeddings=512,
        batch=32,
        num_generations=8,
        grad_accum=1,
        max_completion_length=64,
        bf16=True,
        cuda=False,
        steps=3,
    ),
    # Qwen2.5-0.5B's shape (494M parameters) on CPU: 1 prompt x 8 x 32 tokens, bf16 autocast.
    "qwen0.5b": dict(
        **QWEN05, batch=8, num_generations=8, grad_accum=1, max_completion_length=32, bf16=True, cuda=False, steps=2
    ),
    # GPU (H100 / H200): 32 prompts x 8 completions x 512 tokens per step (8 micro-batches of 32).
    "gpu-0.5b": dict(
        **QWEN05, batch=32, num_generations=8, grad_accum=8, max_completion_length=512, bf16=True, cuda=True, steps=5
    ),
    "gpu-1.5b": dict(
        **QWEN15, batch=32, num_generations=8, grad_accum=8, max_completion_length=512, bf16=True, cuda=True, steps=5
    ),
}
# hf: grpokit's in-process engine; hf-static: with cache_implementation="static" (fixed shapes; its decode step
# compiled with CUDA graphs on a GPU, eager elsewhere); hf-static-compile: the same, compiled on any device (on a
# CPU: inductor, no graphs); vllm: grpokit with use_vllm (colocated); trl, trl-static: TRL's generate() (TRL compiles
# its forward on CUDA with a static cache); trl-vllm: TRL with vLLM (colocated).
ENGINES = ("hf", "hf-static", "hf-static-compile", "vllm", "trl", "trl-static", "trl-vllm")


# ---------------------------------------------------------------------------------------------------- child


def run_child(spec: dict) -> dict:
    config, engine, model_dir = spec["config"], spec["engine"], spec["model_dir"]
    steps = spec["steps"]
    args = common_args(config, spec["output_dir"], steps + 1, 1e-6, 0.0, seed=0)
    generation_batch = config["batch"] * config["grad_accum"]
    dataset = make_dataset(max(64, 4 * generation_batch // config["num_generations"]), seed=0)
    stamps: list[tuple[float, int]] = []
    static = {"cache_implementation": "static"} if "static" in engine else {}
    if engine.startswith("trl"):
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        vllm = {"use_vllm": True, "vllm_mode": "colocate"} if engine == "trl-vllm" else {}
        trainer = GRPOTrainer(
            model=model_dir, reward_funcs=reward_len, train_dataset=dataset, args=GRPOConfig(**args, **vllm, **static)
        )
    else:
        from transformers import TrainerCallback

        from grpokit import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(
            model=model_dir,
            reward_funcs=reward_len,
            train_dataset=dataset,
            args=GRPOConfig(**args, use_vllm=engine == "vllm", **static),
        )
        if engine == "hf-static-compile":
            trainer.engine.static.compile = True

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(
                (time.perf_counter(), state.num_input_tokens_seen if engine.startswith("trl") else state.num_tokens)
            )

    result = {"engine": engine}
    if not engine.startswith("trl"):  # the rollout alone, through the engine seam
        from grpokit.rollout import group_counts

        rows = [dataset[i] for i in range(generation_batch // config["num_generations"])]
        rows = [r for r in rows for _ in range(config["num_generations"])]
        counts = group_counts(len(rows), config["num_generations"], 0)
        prompts = trainer.codec.encode([rows[sum(counts[:i])] for i in range(len(counts))], counts)
        params = trainer.codec.sampling_params(config["max_completion_length"], temperature=1.0)
        trainer.engine.sync_weights(trainer.unwrapped_model)
        trainer.engine.generate(prompts, params, 0)  # warm-up
        times, tokens = [], 0
        for seed in range(1, spec["rollouts"] + 1):
            started = time.perf_counter()
            rollout = trainer.engine.generate(prompts, params, seed)
            times.append(time.perf_counter() - started)
            tokens = int(rollout.attention_mask.sum())
        assert tokens == len(rows) * config["max_completion_length"], tokens
        result.update(
            rollout_tokens=tokens,
            rollout_seconds=sum(times) / len(times),
            rollout_tokens_per_s=tokens / (sum(times) / len(times)),
        )
    trainer.add_callback(Stamp())
    trainer.train()
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]  # the first step (start-up, warm-up) is left out
    result.update(
        step_tokens=(n1 - n0) / (len(stamps) - 1),
        step_seconds=(t1 - t0) / (len(stamps) - 1),
        step_tokens_per_s=(n1 - n0) / (t1 - t0),
        measured_steps=len(stamps) - 1,
    )
    return result


# ---------------------------------------------------------------------------------------------------- parent


def machine() -> dict:
    import os

    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_average": os.getloadavg(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        pass
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=["hf", "vllm"])
    parser.add_argument("--steps", type=int, default=None, help="measured training steps (default: the config's)")
    parser.add_argument("--rollouts", type=int, default=2, help="measured rollouts per engine")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        spec = json.loads(Path(options.child).read_text())
        Path(spec["result"]).write_text(json.dumps(run_child(spec)))
        return 0
    config = CONFIGS[options.config]
    workdir = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    model_info = build_model_dir(config, workdir / "model")
    results = []
    for engine in options.engines:
        spec = {
            "config": config,
            "engine": engine,
            "model_dir": str(workdir / "model"),
            "output_dir": str(workdir / f"out-{engine}"),
            "steps": options.steps or config["steps"],
            "rollouts": options.rollouts,
            "result": str(workdir / f"{engine}.json"),
        }
        (workdir / f"{engine}.spec.json").write_text(json.dumps(spec))
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(workdir / f"{engine}.spec.json")],
            timeout=options.timeout,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            results.append({"engine": engine, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        result = json.loads(Path(spec["result"]).read_text())
        result["wall_seconds"] = time.perf_counter() - started
        results.append(result)
        print(json.dumps(result), flush=True)
    report = {"config": options.config, "shape": config, "model": model_info, "machine": machine(), "results": results}
    print("\n| engine | rollout tokens/s | full-step tokens/s | step s | wall s (incl. start-up) |")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['engine']} | error: {r['error']} | | | |")
            continue
        rollout = f"{r['rollout_tokens_per_s']:.0f}" if "rollout_tokens_per_s" in r else "-"
        print(
            f"| {r['engine']} | {rollout} | {r['step_tokens_per_s']:.0f} | {r['step_seconds']:.2f} | "
            f"{r['wall_seconds']:.0f} |"
        )
    if options.out:
        Path(options.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
