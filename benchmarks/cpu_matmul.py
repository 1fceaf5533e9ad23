#!/usr/bin/env python
"""bfloat16 linear layers on the CPU: torch's bfloat16 kernel against grpokit's float32 route (grpokit/cpu_matmul.py).

    python benchmarks/cpu_matmul.py --threads 1 --out benchmarks/results/cpu_matmul.json

Qwen2.5-0.5B's projection shapes (hidden 896, MLP 4864), forward and forward + backward, at decode rows (16: one
token per sequence) and training rows (960: 16 sequences of 60 tokens), under the trainer's allocator setting
(`cpu_memory.keep_large_allocations_mapped`). Both run in the same process, interleaved,
and each figure is the fastest of `--repeats` runs (the least disturbed by other load). On a CPU with bfloat16
hardware (AVX512-BF16 / AMX) grpokit leaves the bfloat16 kernel in place: the table says which this CPU is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from grpokit.cpu_matmul import Float32Linear, cpu_has_bf16_matmul
from grpokit.cpu_memory import keep_large_allocations_mapped

SHAPES = [(896, 896), (896, 4864), (4864, 896)]  # (in, out): attention q/o, MLP gate/up, MLP down


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 960])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    keep_large_allocations_mapped()  # the allocator setting a training run has (each large allocation mapped)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    rows_out = []
    print("| rows | in x out | pass | bf16 kernel (ms) | float32 route (ms) | speed-up |\n|---|---|---|---|---|---|")
    for rows in args.rows:
        for fan_in, fan_out in SHAPES:
            x = torch.randn(rows, fan_in).bfloat16().requires_grad_()
            weight = (torch.randn(fan_out, fan_in) / fan_in**0.5).bfloat16().requires_grad_()
            grad = torch.randn(rows, fan_out).bfloat16()
            passes = {
                "forward": (
                    lambda x=x, weight=weight: torch.nn.functional.linear(x, weight),
                    lambda x=x, weight=weight: Float32Linear.apply(x, weight, None),
                ),
                "forward + backward": (
                    lambda x=x, weight=weight, grad=grad: torch.nn.functional.linear(x, weight).backward(grad),
                    lambda x=x, weight=weight, grad=grad: Float32Linear.apply(x, weight, None).backward(grad),
                ),
            }
            for name, (kernel, route) in passes.items():
                kernel(), route()  # warm-up
                times = {"kernel": [], "route": []}
                for _ in range(args.repeats):
                    times["kernel"].append(timed(kernel))
                    times["route"].append(timed(route))
                best = {k: min(v) * 1e3 for k, v in times.items()}
                rows_out.append({"rows": rows, "in": fan_in, "out": fan_out, "pass": name, **best})
                print(
                    f"| {rows} | {fan_in} x {fan_out} | {name} | {best['kernel']:.1f} | {best['route']:.1f} | "
                    f"{best['kernel'] / best['route']:.2f}x |",
                    flush=True,
                )
    info = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_hardware": cpu_has_bf16_matmul(),
        "threads": torch.get_num_threads(),
        "loadavg_start": load,
        "loadavg_end": os.getloadavg(),
    }
    print(f"\n{info}")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": info, "results": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
