#!/usr/bin/env python
"""grpokit vs TRL: throughput, step time and peak memory of GRPO training on the same model and configuration.

    pip install -e '.[bench]'            # TRL (+ psutil)
    python benchmarks/bench_vs_trl.py --config small    --steps 5 --repeats 2 --out results_small.json
    python benchmarks/bench_vs_trl.py --config vocab32k --steps 5 --repeats 2 --out results_32k.json
    python benchmarks/bench_vs_trl.py --config gpu      --steps 5 --repeats 2 --out results_gpu.json   # CUDA only

The parent process builds a random-weight Qwen2 model and a character-level tokenizer offline (grpokit.testing),
saves them to a temporary directory, and then runs TRL and grpokit alternately (trl, grpokit, trl, grpokit, ...),
each run in a fresh subprocess (`--child`), so that every run has its own peak RSS / CUDA peak and neither library
warms caches for the other. Both trainers receive the *same* TRL-style keyword arguments (see `common_args`);
only flags whose TRL default differs from what a fair comparison needs are set explicitly (bf16, gradient
checkpointing, optimizer, dropout), and they are set identically for both.

Completions always run to max_completion_length: the tokenizer's EOS is a token id the model cannot produce (the
model's vocabulary is one token smaller than the tokenizer's and EOS is that last token), so both trainers generate
exactly the same number of tokens per step; each child checks this from its logged completion lengths.

Timing: each child records a timestamp whenever the trainer appends a step's record to `state.log_history`
(logging_steps=1; a TrainerCallback.on_log for TRL, a list wrapper for grpokit). After `--warmup` steps, the
measured window is the next `--steps` steps: tokens/s = (num_tokens[end] - num_tokens[warmup]) / (t[end] -
t[warmup]), where num_tokens is the trainer's own cumulative count of prompt + completion tokens; the step time is
the median of the per-step wall-clock intervals in the window (generation, reference and policy forwards,
backward, optimizer step, logging all included). Peak memory: the child's ru_maxrss (CPU) or
torch.cuda.max_memory_allocated (GPU). The table shows the median over repeats and the ratio grpokit/TRL of the
medians (tokens/s > 1 and step time / memory < 1 favour grpokit).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# ----------------------------------------------------------------------------------------------- configurations

CONFIGS = {
    # ~4M parameters: 4 layers, hidden 256, SwiGLU 1024, 4 heads (head_dim 64), 2 KV heads, ~50-token vocabulary.
    "small": dict(
        vocab_size=None,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=1024,
        max_position_embeddings=512,
        batch=64,
        num_generations=8,
        grad_accum=1,
        max_completion_length=64,
        bf16=False,
        cuda=False,
    ),
    # Same shape with a 32k vocabulary (tied embeddings: ~12M parameters, the LM head dominates).
    "vocab32k": dict(
        vocab_size=32_000,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=1024,
        max_position_embeddings=512,
        batch=64,
        num_generations=8,
        grad_accum=1,
        max_completion_length=64,
        bf16=False,
        cuda=False,
    ),
    # Qwen2.5-0.5B shape (random weights), bf16 autocast, 256 completions (32 prompts x 8) x 512 tokens per step:
    # 8 micro-batches of 32 accumulated into one optimizer step (one generation of 256 per step).
    "gpu": dict(
        vocab_size=151_936,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        batch=32,
        num_generations=8,
        grad_accum=8,
        max_completion_length=512,
        bf16=True,
        cuda=True,
    ),
    # The same Qwen2.5-0.5B shape on the CPU, small enough per step to run there (issue 16): 16 completions (2 prompts
    # x 8) x 32 tokens, bf16 autocast. A step takes minutes on a few cores: use --warmup 1 --steps 1 --repeats 1.
    "qwen05": dict(
        vocab_size=151_936,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        batch=16,
        num_generations=8,
        grad_accum=1,
        max_completion_length=32,
        bf16=True,
        cuda=False,
    ),
}

# LoRA variant (--lora): the same adapter for both trainers; with LoRA neither loads a reference copy.
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")

IMPLS = ("trl", "grpokit", "grpokit-baseline", "unsloth")
BASELINE = "grpokit-baseline"  # grpokit from another source tree (--baseline), e.g. before a change
# Unsloth (`--impls unsloth,grpokit --unsloth-python VENV/bin/python`): its FastLanguageModel loads the model and adds
# the adapter (or unfreezes everything: full_finetuning), then TRL's GRPOTrainer trains it, as in Unsloth's GRPO
# notebooks. It pins its own TRL and transformers, so it runs from its own environment (benchmarks/README.md).
TRL_LIKE = ("trl", "unsloth")  # the runs that train with trl.GRPOTrainer

PROMPT_TEMPLATE = "q{index:04d}: what is {a:02d}+{b:02d}? answer:"  # every prompt has the same token length


def package_root(tree) -> str:
    """The folder to put on sys.path for a source tree's grpokit: its src/ (the layout since 0.1), or the tree
    itself for an earlier checkout that kept the package at its top."""
    tree = Path(tree).resolve()
    return str(tree / "src" if (tree / "src" / "grpokit").is_dir() else tree)


def common_args(config: dict, output_dir: str, max_steps: int, learning_rate: float, beta: float, seed: int) -> dict:
    """The GRPOConfig keyword arguments, identical for trl.GRPOConfig and grpokit.GRPOConfig."""
    return dict(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=config["batch"],
        gradient_accumulation_steps=config["grad_accum"],
        num_generations=config["num_generations"],
        max_completion_length=config["max_completion_length"],
        learning_rate=learning_rate,
        beta=beta,
        temperature=1.0,
        loss_type="dapo",
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        # TRL's defaults differ here (bf16=True, gradient_checkpointing=True, fused AdamW, dropout kept); fix them
        # for both so that the two runs do the same work.
        bf16=config["bf16"],
        gradient_checkpointing=False,
        optim="adamw_torch",
        disable_dropout=True,
        use_cpu=not config["cuda"],
    )


def reward_len(completions, **kwargs):
    """Trivial reward, identical for both trainers: the completion's length in characters."""
    return [float(len(c if isinstance(c, str) else str(c))) for c in completions]


# ----------------------------------------------------------------------------------------------- building


def build_model_dir(config: dict, path: Path) -> dict:
    """Save a random-weight Qwen2 model and its char tokenizer; EOS is a token id the model cannot emit."""
    import torch

    from grpokit.testing import DEFAULT_CHARS, build_char_tokenizer, build_tiny_model

    base = len(build_char_tokenizer(DEFAULT_CHARS))
    model_vocab = config["vocab_size"] or base
    tokenizer = build_char_tokenizer(DEFAULT_CHARS, extra_words=max(0, model_vocab - base))
    assert len(tokenizer) == model_vocab, (len(tokenizer), model_vocab)
    # A new special token with id == model_vocab: outside the LM head, so no completion ever ends early.
    tokenizer.add_special_tokens({"eos_token": "<never_eos>"})
    eos = tokenizer.eos_token_id
    assert eos == model_vocab, (eos, model_vocab)
    model = build_tiny_model(
        model_vocab,
        hidden_size=config["hidden_size"],
        num_layers=config["num_layers"],
        num_heads=config["num_heads"],
        num_kv_heads=config["num_kv_heads"],
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=config["max_position_embeddings"],
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    if "rope_theta" in config:  # transformers 5 keeps it in rope_parameters, 4 in rope_theta
        if isinstance(getattr(model.config, "rope_parameters", None), dict):
            model.config.rope_parameters["rope_theta"] = config["rope_theta"]
        else:
            model.config.rope_theta = config["rope_theta"]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"parameters": n_params, "model_vocab": model_vocab, "tokenizer_len": len(tokenizer), "eos_id": eos}


def make_dataset(n: int, seed: int):
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [PROMPT_TEMPLATE.format(index=i, a=rng.randrange(100), b=rng.randrange(100)) for i in range(n)]
    return Dataset.from_dict({"prompt": prompts})


# ----------------------------------------------------------------------------------------------- child


LOADING_PEAK_MIB = 0.0  # the process's peak before `reset_peak_rss` (which also resets what getrusage reports)


def peak_rss_mib() -> float:
    """The process's peak RSS over its whole life (loading included)."""
    import resource

    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, LOADING_PEAK_MIB)  # KiB on Linux


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (VmHWM) of this process (Linux 4.0+: clear_refs 5); the
    peak so far is kept for `peak_rss_mib`."""
    global LOADING_PEAK_MIB
    LOADING_PEAK_MIB = peak_rss_mib()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset_mib() -> float | None:
    """VmHWM, the largest resident set since the process started or since `reset_peak_rss`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def current_rss_mib() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        return float("nan")


def tensor_mib(tensors) -> float:
    """MiB held by tensors, each storage counted once (tied weights; tensor subclasses by their inner tensors)."""
    import torch

    seen, total = set(), 0
    stack = [t for t in tensors if isinstance(t, torch.Tensor)]
    while stack:
        tensor = stack.pop()
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is not None and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            stack += [getattr(tensor, name) for name in flatten()[0]]
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total / 2**20


def memory_breakdown(trainer, impl: str) -> dict:
    """What lives across steps, measured from the tensors themselves after training: policy weights, their
    gradients, optimizer states, the reference copy. What is left of the peak (activations, logits, the rollout's
    KV cache, autocast's bf16 weight copies, allocator slack, the Python process itself) is the peak minus these:
    torch.cuda.max_memory_allocated on a GPU (where the tensors live), the peak RSS on a CPU."""
    import torch

    policy = trainer.accelerator.unwrap_model(trainer.model)
    reference = trainer.ref_model if impl in TRL_LIKE else trainer.reference
    params = list(policy.parameters())
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    states = [v for state in optimizer.state.values() for v in state.values()]
    # Gradients are freed by zero_grad(set_to_none) after each step: count one per trainable parameter (their size).
    trainable = [p for p in params if p.requires_grad]
    grads_mib = sum(p.numel() * p.element_size() for p in trainable) / 2**20
    by_dtype = {}
    for p in params:
        by_dtype[str(p.dtype)] = by_dtype.get(str(p.dtype), 0) + p.numel()
    out = {
        "weights": tensor_mib(params),
        "gradients (trainable, peak)": grads_mib,
        "optimizer_states": tensor_mib(states),
        # parameters and buffers: an int8 reference (ref_model_dtype="int8") keeps its linear weights in buffers
        "reference": tensor_mib([*reference.parameters(), *reference.buffers()]) if reference is not None else 0.0,
        "trainable_parameters": sum(p.numel() for p in trainable),
        "parameters_by_dtype": by_dtype,
        "reference_dtype": str(next(reference.parameters()).dtype) if reference is not None else None,
    }
    persistent = out["weights"] + grads_mib + out["optimizer_states"] + out["reference"]
    on_gpu = next(trainer.model.parameters()).device.type == "cuda"
    peak = torch.cuda.max_memory_allocated() / 2**20 if on_gpu else peak_rss_mib()
    out["rest_of_peak (activations, logits, KV cache, autocast copies" + ("" if on_gpu else ", process") + ")"] = (
        peak - persistent
    )
    return out


def extra_args_key(impl: str) -> str:
    """Which --*-args a run takes: TRL's, Unsloth's, or grpokit's (also for --baseline)."""
    return impl if impl in TRL_LIKE else "grpokit"


def unsloth_model(model_dir: str, config: dict, lora: bool):
    """The model as an Unsloth user builds it: FastLanguageModel.from_pretrained with Unsloth's defaults (a 4-bit
    base for LoRA; on a CPU it also picks the dtype), then get_peft_model with the same adapter as the others
    (Unsloth's gradient checkpointing); without LoRA, Unsloth's full fine-tuning."""
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=model_dir,
        max_seq_length=config["max_completion_length"] + 64,
        load_in_4bit=lora,
        full_finetuning=not lora,
    )  # fmt: skip  (offline: the parent sets HF_HUB_OFFLINE for every run)
    if lora:
        model = FastLanguageModel.get_peft_model(model, use_gradient_checkpointing="unsloth", **LORA)
    return model, tokenizer


def run_child(spec: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    impl, config = spec["impl"], spec["config"]
    cuda = config["cuda"]
    if cuda and not torch.cuda.is_available():
        raise SystemExit("this configuration needs CUDA")
    if impl == "unsloth":
        import unsloth  # before transformers and TRL, which it patches on import

    import transformers

    if impl in TRL_LIKE:
        import trl
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        version = trl.__version__ if impl == "trl" else f"unsloth {unsloth.__version__}, trl {trl.__version__}"
    else:
        # The source tree this script belongs to (the one machine_info describes), or an earlier one (--baseline),
        # shadows any installed grpokit.
        sys.path.insert(0, spec.get("src") or package_root(Path(__file__).resolve().parent.parent))
        import grpokit
        from grpokit import GRPOConfig, GRPOTrainer

        version = grpokit.__version__
        assert not spec.get("src") or Path(grpokit.__file__).resolve().is_relative_to(Path(spec["src"]).resolve())

    stamps: list[float] = []
    dataset = make_dataset(spec["num_prompts"], spec["seed"])
    kwargs = common_args(
        config, spec["output_dir"], spec["warmup"] + spec["steps"], spec["learning_rate"], spec["beta"], spec["seed"]
    )
    kwargs.update(spec.get("extra_args", {}).get(extra_args_key(impl), {}))
    args = GRPOConfig(**kwargs)
    peft_config = None
    if spec.get("lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="CAUSAL_LM", **LORA)
    rss_before_trainer = current_rss_mib()
    if impl in TRL_LIKE:

        class Stamp(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "num_tokens" in logs:
                    stamps.append(time.perf_counter())

        if impl == "trl":
            trainer = GRPOTrainer(
                model=spec["model_dir"],
                reward_funcs=reward_len,
                args=args,
                train_dataset=dataset,
                callbacks=[Stamp()],
                peft_config=peft_config,
            )
        else:
            model, tokenizer = unsloth_model(spec["model_dir"], config, lora=bool(spec.get("lora")))
            trainer = GRPOTrainer(
                model=model,
                processing_class=tokenizer,
                reward_funcs=reward_len,
                args=args,
                train_dataset=dataset,
                callbacks=[Stamp()],
            )
    else:
        trainer = GRPOTrainer(
            model=spec["model_dir"], reward_funcs=reward_len, args=args, train_dataset=dataset, peft_config=peft_config
        )

        class StampedList(list):
            def append(self, item):
                if isinstance(item, dict) and "num_tokens" in item:
                    stamps.append(time.perf_counter())
                super().append(item)

        trainer.state.log_history = StampedList(trainer.state.log_history)
    policy = trainer.model
    grad_ckpt = bool(getattr(policy, "is_gradient_checkpointing", False))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_before_train = current_rss_mib()
    train_peak_measured = reset_peak_rss()
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    if cuda:
        torch.cuda.synchronize()

    breakdown = memory_breakdown(trainer, impl)
    records = [r for r in trainer.state.log_history if "num_tokens" in r]
    assert len(records) == len(stamps) == spec["warmup"] + spec["steps"], (len(records), len(stamps))
    w = spec["warmup"]
    tokens = [float(r["num_tokens"]) for r in records]
    intervals = [b - a for a, b in zip(stamps[w - 1 :], stamps[w:])] if w > 0 else None
    if w == 0:  # no warm-up: the first interval starts at train()
        intervals = [stamps[0] - started] + [b - a for a, b in itertools.pairwise(stamps)]
    window_time = stamps[-1] - (stamps[w - 1] if w > 0 else started)
    window_tokens = tokens[-1] - (tokens[w - 1] if w > 0 else 0.0)
    lengths = [r.get("completions/mean_length") for r in records]
    min_lengths = [r.get("completions/min_length") for r in records]
    return {
        "impl": impl,
        "version": version,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.executable,
        "threads": torch.get_num_threads(),
        "tokens_per_s": window_tokens / window_time,
        "step_time_median_s": statistics.median(intervals),
        "step_time_mean_s": statistics.fmean(intervals),
        "step_times_s": intervals,
        "warmup_time_s": stamps[w - 1] - started if w > 0 else 0.0,
        "train_total_s": total,
        "tokens_per_step": window_tokens / spec["steps"],
        "num_tokens": tokens,
        "completion_mean_length": lengths,
        "completion_min_length": min_lengths,
        "trainer_step_time_s": [r.get("step_time") for r in records],  # each library's own metric (not comparable)
        "loss": [r.get("loss") for r in records],
        "reward": [r.get("reward") for r in records],
        "gradient_checkpointing": grad_ckpt,
        "peak_rss_mib": peak_rss_mib(),
        # Loading excluded (a checkpoint's pages touched while loading count in RSS): the high-water mark since
        # train() began.
        "train_peak_rss_mib": peak_rss_since_reset_mib() if train_peak_measured else None,
        "memory_breakdown_mib": breakdown,
        "extra_args": spec.get("extra_args", {}).get(extra_args_key(impl), {}),
        # What the trainer ran with after its own adjustments (Unsloth's CPU backend turns bf16 off where the CPU
        # has no bf16 instructions and picks its optimizer).
        "effective_args": {
            key: str(getattr(trainer.args, key, None)) for key in ("bf16", "optim", "gradient_checkpointing")
        },
        "policy_dtype": str(getattr(trainer.accelerator.unwrap_model(trainer.model), "dtype", None)),
        "lora": bool(spec.get("lora")),
        "rss_before_trainer_mib": rss_before_trainer,
        "rss_before_train_mib": rss_before_train,
        "cuda_max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "cuda_device": torch.cuda.get_device_name() if cuda else None,
    }


# ----------------------------------------------------------------------------------------------- parent


def machine_info() -> dict:
    import torch
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "loadavg_start": os.getloadavg(),
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:  # grpokit's source state: the benchmark is often run on a working tree
        repo = Path(__file__).resolve().parent.parent
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "grpokit"], cwd=repo, capture_output=True, text=True)
        if head.returncode == 0:
            info["grpokit_git"] = head.stdout.strip() + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        pass
    for name in ("accelerate", "datasets", "trl", "grpokit"):
        try:
            from importlib.metadata import version

            info[name] = version(name)
        except Exception:
            info[name] = None
    return info


def start(spec: dict, python: str, workdir: Path, index: int, cpu: int | None = None):
    """Start one child run (pinned to `cpu` when given); `finish` waits for it."""
    spec_path = workdir / f"spec_{index}_{spec['impl']}.json"
    out_path = workdir / f"result_{index}_{spec['impl']}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_DISABLED="true",
        TRL_EXPERIMENTAL_SILENCE="1",
    )
    env.setdefault("PYTHONWARNINGS", "ignore")
    command = [python, os.path.abspath(__file__), "--child", str(spec_path), "--child-out", str(out_path)]
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    logs = [open(workdir / f"{stream}_{index}_{spec['impl']}.txt", "w+") for stream in ("stdout", "stderr")]  # noqa: SIM115 (the caller reads and closes them once the run ends)
    proc = subprocess.Popen(command, env=env, stdout=logs[0], stderr=logs[1], text=True, preexec_fn=pin)
    return spec, proc, out_path, logs, time.perf_counter()


def finish(run, timeout: float) -> dict:
    spec, proc, out_path, logs, started = run
    try:
        proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - started)))
        error = None if proc.returncode == 0 and out_path.exists() else f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        error = f"timed out after {timeout:.0f} s"
    stdout, stderr = [log.seek(0) or log.read() for log in logs]
    for log in logs:
        log.close()
    if error:
        return {"impl": spec["impl"], "error": error, "stderr_tail": stderr[-6000:], "stdout_tail": stdout[-2000:]}
    result = json.loads(out_path.read_text())
    result["process_wall_s"] = time.perf_counter() - started
    result["cpu_affinity"] = spec.get("cpu")
    return result


def fmt(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def summarise(results: list[dict]) -> dict:
    out = {}
    keys = (
        "tokens_per_s",
        "step_time_median_s",
        "peak_rss_mib",
        "train_peak_rss_mib",
        "rss_before_train_mib",
        "cuda_max_allocated_mib",
    )
    for impl in IMPLS:
        runs = [r for r in results if r["impl"] == impl and "error" not in r]
        out[impl] = {"runs": len(runs)}
        for key in keys:
            values = [r[key] for r in runs if r.get(key) is not None]
            out[impl][key] = statistics.median(values) if values else None
            out[impl][key + "_min"] = min(values) if values else None
            out[impl][key + "_max"] = max(values) if values else None
    for name, (a, b) in RATIOS.items():
        if out[a]["runs"] and out[b]["runs"]:
            out[name] = {
                key: out[a][key] / out[b][key] if out[a][key] is not None and out[b][key] else None for key in keys
            }
    return out


# The ratios the summary and the table give, where both sides ran: name -> (numerator, denominator).
RATIOS = {
    "ratio_grpokit_over_trl": ("grpokit", "trl"),
    "ratio_grpokit_over_unsloth": ("grpokit", "unsloth"),
    "ratio_baseline_over_trl": (BASELINE, "trl"),
}
LABELS = {"trl": "TRL", "unsloth": "Unsloth", BASELINE: "grpokit before (--baseline)", "grpokit": "grpokit"}


def markdown(name: str, config: dict, model_info: dict, summary: dict, info: dict, args) -> str:
    cuda = config["cuda"]
    lines = [
        f"### `{name}`: {model_info['parameters'] / 1e6:.2f}M parameters, {config['num_layers']} layers, "
        f"vocab {model_info['model_vocab']}, {config['batch'] * config['grad_accum']} completions/step "
        f"({config['batch'] * config['grad_accum'] // config['num_generations']} prompts x "
        f"{config['num_generations']}) x {config['max_completion_length']} tokens, beta={args.beta}, "
        f"{'bf16' if config['bf16'] else 'fp32'}, {args.warmup} warm-up + {args.steps} measured steps, "
        f"{args.repeats} repeat(s) each (median [min-max])",
        "",
    ]
    impls = [impl for impl in ("trl", "unsloth", BASELINE, "grpokit") if summary[impl]["runs"]]
    ratios = [name for name in RATIOS if name in summary]
    headers = [LABELS[impl] for impl in impls] + [
        f"{LABELS[RATIOS[n][0]].split(' (')[0]} / {LABELS[RATIOS[n][1]]}" for n in ratios
    ]
    lines += ["| metric | " + " | ".join(headers) + " |", "|---" * (len(headers) + 1) + "|"]
    rows = [("tokens/s", "tokens_per_s", 4), ("step time (s, median)", "step_time_median_s", 3)]
    rows.append(
        ("peak GPU memory allocated (MiB)", "cuda_max_allocated_mib", 4)
        if cuda
        else ("peak RSS (MiB)", "peak_rss_mib", 4)
    )
    if not cuda:
        rows.append(("peak RSS during train() (MiB)", "train_peak_rss_mib", 4))
    rows.append(("RSS before train() (MiB)", "rss_before_train_mib", 4))
    for label, key, digits in rows:
        cells = []
        for impl in impls:
            s = summary[impl]
            cells.append(
                f"{fmt(s[key], digits)} [{fmt(s[key + '_min'], digits)}-{fmt(s[key + '_max'], digits)}]"
                if s[key] is not None
                else "-"
            )
        lines.append(f"| {label} | {' | '.join(cells + [fmt(summary[name][key], 3) for name in ratios])} |")
    lines += [
        "",
        f"Machine: {info['cpu']}, {info['usable_cpus']} usable / {info['logical_cpus']} logical CPUs"
        + (f", {info['memory_gib']} GiB RAM" if info.get("memory_gib") else "")
        + (f", GPU {info['gpu']}" if info.get("gpu") else "")
        + f"; load average at start {', '.join(f'{x:.2f}' for x in info['loadavg_start'])}"
        + (f", at end {', '.join(f'{x:.2f}' for x in info['loadavg_end'])}" if info.get("loadavg_end") else ""),
        f"Threads per run (torch.get_num_threads in the child): {info.get('threads_used') or '-'}"
        + ("" if args.threads else " (torch's default; on a shared machine prefer --threads 1, see README)"),
        f"Versions: python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
        f"accelerate {info['accelerate']}, datasets {info['datasets']}, trl {info.get('trl_child') or info['trl']}, "
        f"grpokit {info['grpokit']}" + (f" (git {info['grpokit_git']})" if info.get("grpokit_git") else ""),
        "Each run's own: " + "; ".join(f"{impl}: {v}" for impl, v in info.get("children", {}).items()),
    ]
    return "\n".join(lines)


def breakdown_table(results: list[dict], args) -> str:
    """The options each side ran with, and the memory breakdown of each library's first run (MiB)."""
    runs = {}
    for r in results:
        if "error" not in r and r.get("memory_breakdown_mib"):
            runs.setdefault(r["impl"], r)
    if not runs:
        return ""
    lines = [
        "",
        f"LoRA: {LORA}" if args.lora else "Full fine-tuning.",
        f"Extra arguments: grpokit {args.grpokit_args}, TRL {args.trl_args}"
        + (f", Unsloth {args.unsloth_args}" if "unsloth" in runs else "")
        + ".",
        "",
        "| memory (MiB) | " + " | ".join(runs) + " |",
        "|---" * (len(runs) + 1) + "|",
    ]
    keys = [k for k in next(iter(runs.values()))["memory_breakdown_mib"] if k not in ("parameters_by_dtype",)]
    peak_key = (
        "cuda_max_allocated_mib" if any(r.get("cuda_max_allocated_mib") for r in runs.values()) else "peak_rss_mib"
    )
    for key in [*keys, peak_key]:
        cells = [r["memory_breakdown_mib"].get(key) if key != peak_key else r[peak_key] for r in runs.values()]
        lines.append(
            f"| {key} | "
            + " | ".join(fmt(c, 4) if not isinstance(c, (str, type(None))) else str(c) for c in cells)
            + " |"
        )
    return "\n".join(lines)


def report(result: dict, config: dict, repeat: int):
    impl = result["impl"]
    if "error" in result:
        print(f"[bench] {impl} run {repeat} FAILED ({result['error']}):\n{result['stderr_tail']}", flush=True)
        return
    full = all(m == config["max_completion_length"] for m in result["completion_min_length"])
    print(
        f"[bench] {impl:8s} run {repeat}: {result['tokens_per_s']:10.1f} tokens/s, step "
        f"{result['step_time_median_s']:.3f} s, peak RSS {result['peak_rss_mib']:.0f} MiB"
        + (f", CUDA peak {result['cuda_max_allocated_mib']:.0f} MiB" if config["cuda"] else "")
        + f", tokens/step {result['tokens_per_step']:.0f}"
        + ("" if full else " (WARNING: some completions shorter than max_completion_length)"),
        flush=True,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="override the config's number of decoder layers (a cheaper proxy of the same widths)",
    )
    parser.add_argument("--steps", type=int, default=5, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps excluded from timing")
    parser.add_argument("--repeats", type=int, default=2, help="runs per library (alternating trl, grpokit)")
    parser.add_argument("--out", default=None, help="write all results (per run and summary) to this JSON file")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default=None,
        help="override the config's precision for both trainers (bf16: autocast)",
    )
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in the children (0: default)")
    parser.add_argument("--impls", default="trl,grpokit", help="order within one repeat, e.g. 'grpokit,trl'")
    parser.add_argument("--trl-python", default=sys.executable, help="interpreter for the TRL runs (e.g. a venv)")
    parser.add_argument("--grpokit-python", default=sys.executable, help="interpreter for the grpokit runs")
    parser.add_argument(
        "--unsloth-python",
        default=sys.executable,
        help="interpreter for the Unsloth runs (--impls unsloth,...; Unsloth pins its own TRL)",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child run")
    parser.add_argument("--keep", default=None, help="save the model here instead of a temporary directory")
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also run grpokit from this source tree (a directory holding a `grpokit` package, "
        "e.g. `git archive HEAD grpokit | tar -x -C DIR`), as a third implementation",
    )
    parser.add_argument(
        "--grpokit-args",
        default="{}",
        help="extra GRPOConfig arguments (JSON) for grpokit only, e.g. its memory options: "
        '\'{"ref_model_dtype": "bfloat16", "optim": "adamw_8bit"}\'',
    )
    parser.add_argument("--trl-args", default="{}", help="extra GRPOConfig arguments (JSON) for TRL only")
    parser.add_argument("--unsloth-args", default="{}", help="extra GRPOConfig arguments (JSON) for Unsloth's run")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run the libraries of one repeat at the same time, each pinned to its own CPU (use with "
        "--threads 1): both see the same machine load, and the run takes half the time",
    )
    parser.add_argument("--lora", action="store_true", help=f"train a LoRA adapter in both ({LORA})")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        spec = json.loads(Path(args.child).read_text())
        result = run_child(spec)
        Path(args.child_out).write_text(json.dumps(result))
        return 0

    config = dict(CONFIGS[args.config])
    if args.precision is not None:  # the same precision for both trainers (TRL's own default is bf16=True)
        config["bf16"] = args.precision == "bf16"
    if args.layers is not None:
        config["num_layers"] = args.layers
    if config["cuda"]:
        import torch

        if not torch.cuda.is_available():
            print(f"--config {args.config} needs a CUDA device; none is available, nothing to do.")
            return 0
    info = machine_info()
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    unknown = sorted(set(impls) - set(IMPLS) | ({BASELINE} & set(impls)))
    if unknown:
        raise SystemExit(f"--impls: unknown {unknown}; choose from trl, grpokit, unsloth (--baseline adds {BASELINE})")
    if args.baseline:
        impls.append(BASELINE)
    with tempfile.TemporaryDirectory(prefix="grpokit-bench-") as tmp:
        workdir = Path(tmp)
        model_dir = Path(args.keep) if args.keep else workdir / "model"
        model_info = build_model_dir(config, model_dir)
        print(f"[bench] {args.config}: {model_info['parameters']:,} parameters, model saved to {model_dir}", flush=True)
        prompts_per_step = config["batch"] * config["grad_accum"] // config["num_generations"]
        results = []
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if args.concurrent and len(cpus) < len(impls):
            raise SystemExit(f"--concurrent runs {len(impls)} children on their own CPUs; only {len(cpus)} usable")
        results = []
        for repeat in range(args.repeats):
            runs = []
            for slot, impl in enumerate(impls):
                spec = {
                    "impl": impl,
                    "config": config,
                    "model_dir": str(model_dir),
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "beta": args.beta,
                    "learning_rate": args.learning_rate,
                    "seed": args.seed,
                    "threads": args.threads,
                    "output_dir": str(workdir / f"out_{impl}_{repeat}"),
                    "num_prompts": max(64, prompts_per_step * (args.steps + args.warmup)),
                    "src": package_root(args.baseline) if impl == BASELINE else None,
                    "extra_args": {
                        "grpokit": json.loads(args.grpokit_args),
                        "trl": json.loads(args.trl_args),
                        "unsloth": json.loads(args.unsloth_args),
                    },
                    "lora": args.lora,
                    "cpu": cpus[slot] if args.concurrent else None,
                }
                python = {"trl": args.trl_python, "unsloth": args.unsloth_python}.get(impl, args.grpokit_python)
                runs.append(start(spec, python, workdir, repeat, spec["cpu"]))
                if not args.concurrent:
                    runs[-1] = finish(runs[-1], args.timeout)
            for result in runs if not args.concurrent else [finish(run, args.timeout) for run in runs]:
                result["repeat"] = repeat
                results.append(result)
                report(result, config, repeat)
    info["loadavg_end"] = os.getloadavg()
    trl_runs = [r for r in results if r["impl"] == "trl" and "error" not in r]
    info["trl_child"] = trl_runs[0]["version"] if trl_runs else None
    info["threads_used"] = sorted({r["threads"] for r in results if "error" not in r})
    # Each child's own versions: --trl-python / --unsloth-python may be other environments than this one.
    info["children"] = {
        r["impl"]: f"{r['version']}, transformers {r['transformers']}, torch {r['torch']}"
        for r in results
        if "error" not in r
    }
    ok = [r for r in results if "error" not in r]
    per_step = {r["impl"]: r["tokens_per_step"] for r in ok}
    if len(set(per_step.values())) > 1:
        print(f"[bench] WARNING: tokens per step differ between libraries: {per_step}")
    summary = summarise(results)
    table = markdown(args.config, config, model_info, summary, info, args) + breakdown_table(results, args)
    print()
    print(table)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "config_name": args.config,
                    "config": config,
                    "model": model_info,
                    "machine": info,
                    "settings": {k: v for k, v in vars(args).items() if not k.startswith("child")},
                    "common_args": common_args(
                        config, "<tmp>", args.warmup + args.steps, args.learning_rate, args.beta, args.seed
                    ),
                    "summary": summary,
                    "runs": results,
                    "markdown": table,
                },
                indent=1,
                default=str,
            )
        )
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
