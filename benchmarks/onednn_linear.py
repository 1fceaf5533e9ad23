#!/usr/bin/env python
"""float32 linear layers on the CPU: torch's F.linear (MKL) against grpokit's oneDNN route (grpokit/onednn_linear.py).

    python benchmarks/onednn_linear.py --out benchmarks/results/onednn_linear.json

The `small` benchmark model's training shapes (4,296 rows: 64 completions of 64 tokens and 8 shared prompts of 25,
through its 256 -> 256, 256 -> 128, 256 -> 1024 and 1024 -> 256 layers), then calls around the route's size floor
(`onednn_linear.MIN_MACS` multiply-adds): the forward alone, and the forward with the backward to the input and
the weight. Both in the same process, interleaved, each figure the fastest of `--repeats` runs (the least disturbed
by other load). The table also says whether the trainer takes the route on this machine (`onednn_is_faster`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from grpokit.onednn_linear import MIN_MACS, OnednnLinear, cpu_vendor, onednn_is_faster

TRAINING = [(4296, 256, 256), (4296, 256, 128), (4296, 256, 1024), (4296, 1024, 256)]  # (rows, in, out)
AROUND_FLOOR = [(256, 32, 64), (256, 64, 64), (512, 64, 64), (256, 128, 128), (64, 256, 256), (1024, 128, 128)]


def fastest(fn, repeats: int, calls: int) -> float:
    """The fastest of `repeats` runs of `calls` calls, in seconds a call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def measure(rows: int, features_in: int, features_out: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, features_in, generator=g).requires_grad_()
    weight = (torch.randn(features_out, features_in, generator=g) / features_in**0.5).requires_grad_()
    bias = torch.zeros(features_out).requires_grad_()
    grad_out = torch.randn(rows, features_out, generator=g)
    calls = max(5, int(2e9 // (rows * features_in * features_out)))  # ~0.01-0.02 s of products a run at least

    def forward(fn):
        with torch.no_grad():
            fn(x, weight, bias)

    def training(fn):
        fn(x, weight, bias).backward(grad_out)

    result = {"rows": rows, "in": features_in, "out": features_out, "macs": rows * features_in * features_out}
    for name, fn in (("mkl", torch.nn.functional.linear), ("onednn", OnednnLinear.apply)):
        result[f"{name}_forward_us"] = 1e6 * fastest(lambda fn=fn: forward(fn), repeats, calls)
        result[f"{name}_forward_backward_us"] = 1e6 * fastest(lambda fn=fn: training(fn), repeats, calls)
    for phase in ("forward", "forward_backward"):
        result[f"{phase}_speedup"] = result[f"mkl_{phase}_us"] / result[f"onednn_{phase}_us"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure(*shape, args.repeats) for shape in TRAINING + AROUND_FLOOR]
    info = {
        "cpu": platform.processor() or platform.machine(),
        "vendor": cpu_vendor(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "trainer_takes_onednn": onednn_is_faster(),
        "min_macs": MIN_MACS,
    }
    print(
        f"{info['vendor']}, torch CPU capability {info['capability']}, {info['threads']} threads, torch "
        f"{info['torch']}; the trainer takes oneDNN here: {info['trainer_takes_onednn']} (from {MIN_MACS:,} MACs)"
    )
    print("| rows x in x out | MACs | forward MKL / oneDNN (us) | speed-up | fwd + bwd MKL / oneDNN (us) | speed-up |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rows']} x {r['in']} x {r['out']} | {r['macs'] / 1e6:.1f}M | {r['mkl_forward_us']:.0f} / "
            f"{r['onednn_forward_us']:.0f} | {r['forward_speedup']:.2f}x | {r['mkl_forward_backward_us']:.0f} / "
            f"{r['onednn_forward_backward_us']:.0f} | {r['forward_backward_speedup']:.2f}x |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": info, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
