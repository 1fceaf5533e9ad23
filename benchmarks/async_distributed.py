"""Asynchronous generation against the synchronous loop in several training processes (DDP), in one run of this
script under torchrun: tokens per second on the same model, data and config.

    torchrun --nproc_per_node 2 benchmarks/async_distributed.py                  # 2 CPU processes (gloo)
    torchrun --nproc_per_node 8 benchmarks/async_distributed.py --hidden 1024 --layers 8 --batch 64 --completion 128
                                                                                   # a GPU machine: one GPU a process

Settings (each a fresh model with the same seed, `async_overlap.py`'s letter task and shape): the synchronous loop,
and max_staleness=1 (one producer per process over its share of each batch, the exact schedule). tokens/s is
grpokit's num_tokens (prompt + completion tokens of every trained batch, all processes) over train()'s runtime,
after a one-step warm-up run that is not counted; the median of --repeats interleaved runs. Rank 0 writes
benchmarks/results/async_distributed_<name>.json. On a CPU each process's engine runs in a process of its own: with
fewer cores than twice the processes, sampling and training compete for them and the overlap cannot pay.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from async_overlap import trainer_for


def measure(options, **overrides) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        trainer_for(Path(directory) / "warm", options, **{**overrides, "max_steps": 1}).train()
        trainer = trainer_for(Path(directory) / "run", options, **overrides)
        summary = trainer.train().metrics
        tokens, processes = trainer.state.num_tokens, trainer.accelerator.num_processes
    return {
        **overrides,
        "processes": processes,
        "tokens": tokens,
        "runtime_s": summary["train_runtime"],
        "tokens_per_s": tokens / summary["train_runtime"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="completions per process and step")
    parser.add_argument("--completion", type=int, default=96)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ddp-backend", default=None, help="e.g. gloo for several processes on one GPU")
    parser.add_argument("--name", default=None)
    options = parser.parse_args()
    options.tool_delay, options.fixed_length = 0.0, False  # async_overlap's trainer_for reads them
    common = {"ddp_backend": options.ddp_backend} if options.ddp_backend else {}
    settings = {"sync": common, "async (max_staleness=1)": {**common, "max_staleness": 1}}
    runs = {name: [] for name in settings}
    for _ in range(options.repeats):
        for name, overrides in settings.items():
            runs[name].append(measure(options, **overrides))
    if int(os.environ.get("RANK", "0")) == 0:
        rows = {
            name: sorted(measured, key=lambda r: r["tokens_per_s"])[len(measured) // 2]
            for name, measured in runs.items()
        }
        base = rows["sync"]["tokens_per_s"]
        for name, row in rows.items():
            print(
                f"{name:28s} {row['processes']} processes {row['tokens_per_s']:9.1f} tokens/s "
                f"{row['tokens_per_s'] / base:5.2f}x"
            )
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
        out = Path(__file__).parent / "results" / f"async_distributed_{options.name or 'cpu'}.json"
        out.write_text(
            json.dumps(
                {"options": vars(options), "machine": device, "torch": torch.__version__, "results": rows}, indent=1
            )
        )
        print(f"wrote {out}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
