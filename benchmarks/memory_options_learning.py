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

SETTINGS = {
    "float32 weights, AdamW (TRL's default)": {},
    "bf16 reference": {"ref_model_dtype": "bfloat16"},
    "bf16 reference, 8-bit AdamW (bitsandbytes)": {"ref_model_dtype": "bfloat16", "optim": "adamw_8bit"},
    "bf16 weights, AdamW (no master, round to nearest)": {"model_init_kwargs": {"dtype": "bfloat16"}},
    "bf16 weights, 8-bit AdamW, stochastic rounding (torchao)": {
        "model_init_kwargs": {"dtype": "bfloat16"}, "optim": "adamw_torch_8bit",
        "optim_args": "bf16_stochastic_round=True"},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "tests")]
    warnings.filterwarnings("ignore")
    from grpokit import GRPOTrainer
    from grpokit.testing import save_tiny_model
    from letters import LETTERS, letter_config, letter_dataset, repeat_letter

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_tiny_model(Path(tmp) / "model", chars=LETTERS + ":", hidden_size=64))
        for name, options in SETTINGS.items():
            config = letter_config(Path(tmp) / str(len(results)), bf16=True, beta=0.04, max_steps=args.steps,
                                   logging_steps=5, learning_rate=args.learning_rate, **options)  # fmt: skip
            started = time.perf_counter()
            trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=config,
                                  train_dataset=letter_dataset())  # fmt: skip
            trainer.train()
            rewards = [round(r["reward"], 3) for r in trainer.state.log_history[:-1]]
            results[name] = {"options": options, "rewards": rewards, "seconds": round(time.perf_counter() - started, 1)}
            print(f"{name}: rewards {rewards}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"learning_rate": args.learning_rate, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
