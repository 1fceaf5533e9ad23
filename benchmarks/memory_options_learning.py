#!/usr/bin/env python
"""The learning effect of grpokit's memory options on the letter task (tests/letters.py): the reward logged every 5
steps for each setting, same seed, same tiny Qwen2 (hidden 64), bf16 autocast, beta=0.04.

    pip install 'grpokit[lowmem]'
    python benchmarks/memory_options_learning.py --steps 30 --learning-rate 1e-2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # this tree's grpokit, not an installed one

SETTINGS = {
    "float32 weights, AdamW (TRL's default)": {},
    "bf16 reference": {"ref_model_dtype": "bfloat16"},
    "bf16 reference, 8-bit AdamW (bitsandbytes)": {"ref_model_dtype": "bfloat16", "optim": "adamw_8bit"},
    "bf16 weights, AdamW (no master, round to nearest)": {"model_init_kwargs": {"dtype": "bfloat16"}},
    "bf16 weights, 8-bit AdamW (torchao), stochastic rounding": {
        "model_init_kwargs": {"dtype": "bfloat16"},
        "optim": "adamw_torch_8bit",
        "optim_args": "bf16_stochastic_round=True",
    },
    "bf16 weights, bf16 AdamW states, stochastic rounding (adamw_torch_bf16)": {
        "model_init_kwargs": {"dtype": "bfloat16"},
        "optim": "adamw_torch_bf16",
    },
}


def update_check(learning_rate: float, steps: int = 5) -> dict:
    """How much of AdamW's update bf16 weights keep: `steps` steps on the same batches from the same float32 start,
    float32 AdamW vs bf16 weights with round-to-nearest AdamW, with torchao's 8-bit AdamW and its own stochastic
    rounding, and with grpokit's optimizers (its stochastic rounding); the relative error of each one's total
    weight change against float32's, and the share of weights left unchanged."""
    from types import SimpleNamespace

    import torch

    from grpokit.optim import build_optimizer, row_chunked

    def grpokit_optimizer(optim):
        args = SimpleNamespace(
            optim=optim,
            optim_args="",
            learning_rate=learning_rate,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            weight_decay=0.0,
        )
        return lambda p: build_optimizer(list(p), args)

    from grpokit.testing import build_tiny_model

    def run(dtype, optimizer_factory):
        model = build_tiny_model(64, hidden_size=256, num_layers=2, seed=0).to(dtype)
        start = {k: v.detach().float().clone() for k, v in model.named_parameters()}
        optimizer = optimizer_factory(model.parameters())
        generator = torch.Generator().manual_seed(0)
        for _ in range(steps):
            ids = torch.randint(3, 64, (8, 16), generator=generator)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.detach().float() - start[k] for k, v in model.named_parameters()}

    from torchao.optim import AdamW8bit

    reference = run(torch.float32, lambda p: torch.optim.AdamW(p, lr=learning_rate, weight_decay=0.0))
    results = {}
    for name, dtype, factory in [
        (
            "bf16 weights, AdamW round to nearest",
            torch.bfloat16,
            lambda p: torch.optim.AdamW(p, lr=learning_rate, weight_decay=0.0),
        ),
        (
            "bf16 weights, torchao AdamW8bit stochastic rounding",
            torch.bfloat16,
            lambda p: AdamW8bit(p, lr=learning_rate, weight_decay=0.0, bf16_stochastic_round=True),
        ),
        (
            "bf16 weights, grpokit row-chunked AdamW8bit, its stochastic rounding",
            torch.bfloat16,
            lambda p: row_chunked(AdamW8bit)(p, lr=learning_rate, weight_decay=0.0, bf16_stochastic_round=True),
        ),
        (
            "bf16 weights, grpokit adamw_torch_bf16 (bf16 states, its stochastic rounding)",
            torch.bfloat16,
            grpokit_optimizer("adamw_torch_bf16"),
        ),
        (
            "float32 weights, torchao AdamW8bit",
            torch.float32,
            lambda p: AdamW8bit(p, lr=learning_rate, weight_decay=0.0),
        ),
    ]:
        delta = run(dtype, factory)
        error = sum((delta[k] - reference[k]).pow(2).sum() for k in reference).sqrt()
        norm = sum(reference[k].pow(2).sum() for k in reference).sqrt()
        unchanged = sum((delta[k] == 0).sum() for k in reference) / sum(v.numel() for v in reference.values())
        results[name] = {
            "relative_error_of_update": round((error / norm).item(), 4),
            "weights_unchanged": round(unchanged.item(), 4),
        }
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--update-check", action="store_true", help="only compare the weight updates (update_check)")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root / "src"), str(root / "tests")]
    warnings.filterwarnings("ignore")
    from letters import LETTERS, letter_config, letter_dataset, repeat_letter

    from grpokit import GRPOTrainer
    from grpokit.testing import save_tiny_model

    if args.update_check:
        print(json.dumps({"learning_rate": args.learning_rate, **update_check(args.learning_rate)}, indent=1))
        return 0
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_tiny_model(Path(tmp) / "model", chars=LETTERS + ":", hidden_size=64))
        for name, options in SETTINGS.items():
            config = letter_config(
                Path(tmp) / str(len(results)),
                bf16=True,
                beta=0.04,
                max_steps=args.steps,
                logging_steps=5,
                learning_rate=args.learning_rate,
                **options,
            )
            started = time.perf_counter()
            trainer = GRPOTrainer(
                model=model_dir, reward_funcs=repeat_letter, args=config, train_dataset=letter_dataset()
            )
            trainer.train()
            rewards = [round(r["reward"], 3) for r in trainer.state.log_history[:-1]]
            results[name] = {"options": options, "rewards": rewards, "seconds": round(time.perf_counter() - started, 1)}
            print(f"{name}: rewards {rewards}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"learning_rate": args.learning_rate, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
