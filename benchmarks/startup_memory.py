#!/usr/bin/env python
"""What a QLoRA run holds before its first step: the process's resident memory after each part of the set-up, on a
bench_vs_trl configuration (default: the Qwen2.5-0.5B shape), in grpokit's QLoRA arguments of the README.

    python benchmarks/startup_memory.py --config qwen05 [--model-dir DIR] [--out results.txt]

The model directory is built in a child process (its writing would count here otherwise). Each figure is the RSS
(psutil) right after the named step, in this order: imports (torch, transformers, peft, grpokit), the tokenizer, the
dataset (datasets and pyarrow load here), the policy (4-bit base + adapter, `build_policy`), the reference
(`build_reference`: none with LoRA), the finished trainer. The model's own tensors are then counted by dtype, and
bitsandbytes' NF4 scales (`quant_state.absmax`, which are not parameters) on their own.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

QLORA = {
    "gradient_checkpointing": True,
    "padding_free": True,
    "model_init_kwargs": {
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_compute_dtype": "bfloat16",
        },
    },
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen05")
    parser.add_argument("--model-dir", default=None, help="reuse (or build once into) this directory")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    options = parser.parse_args(argv)
    model_dir = Path(options.model_dir or tempfile.mkdtemp(prefix="startup_memory_")) / options.config
    if not (model_dir / "config.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                f"from pathlib import Path; from bench_vs_trl import CONFIGS, build_model_dir; "
                f"build_model_dir(CONFIGS[{options.config!r}], Path({str(model_dir)!r}))",
            ],
            check=True,
        )
    lines = []

    import psutil

    process = psutil.Process()
    previous = [process.memory_info().rss]

    def record(what: str) -> None:
        rss = process.memory_info().rss
        lines.append(f"| {what} | {rss / 2**20:,.0f} | {(rss - previous[0]) / 2**20:+,.0f} |")
        previous[0] = rss

    lines += ["| after | RSS (MiB) | added |", "|---|---|---|"]
    record("Python started")
    import torch

    torch.set_num_threads(1)
    import peft
    import transformers
    from bench_vs_trl import CONFIGS, LORA, common_args, make_dataset, reward_len

    import grpokit.trainer as trainer_module
    from grpokit import GRPOConfig, GRPOTrainer

    record("imports (torch, transformers, peft, grpokit)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    record(f"the tokenizer ({len(tokenizer):,} tokens)")
    dataset = make_dataset(64, 42)
    record("the dataset (datasets, pyarrow)")
    args = GRPOConfig(**common_args(CONFIGS[options.config], tempfile.mkdtemp(), 1, 1e-5, 0.04, 42) | QLORA)

    def after(function, what):
        def wrapped(*a, **k):
            result = function(*a, **k)
            record(what)
            return result

        return wrapped

    trainer_module.build_policy = after(trainer_module.build_policy, "the policy (NF4 base + LoRA adapter)")
    trainer_module.build_reference = after(trainer_module.build_reference, "the reference (the adapter-off base)")
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward_len,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(task_type="CAUSAL_LM", **LORA),
    )
    record("the rest of the trainer")
    by_dtype, scales = {}, 0
    tensors = {id(t): t for t in [*trainer.model.parameters(), *trainer.model.buffers()]}
    for tensor in tensors.values():
        by_dtype[str(tensor.dtype)] = by_dtype.get(str(tensor.dtype), 0) + tensor.untyped_storage().nbytes()
    for module in trainer.model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            scales += state.absmax.untyped_storage().nbytes()
            if state.nested:
                scales += state.state2.absmax.untyped_storage().nbytes()
    lines.append("")
    lines.append(
        "model tensors, MiB: "
        + ", ".join(f"{k.removeprefix('torch.')} {v / 2**20:,.1f}" for k, v in sorted(by_dtype.items()))
    )
    lines.append(f"NF4 scales (quant_state.absmax, not parameters), MiB: {scales / 2**20:,.1f}")
    report = "\n".join(lines)
    print(report)
    if options.out:
        Path(options.out).write_text(f"# python benchmarks/startup_memory.py --config {options.config}\n\n{report}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
