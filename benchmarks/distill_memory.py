"""Peak memory of the distillation loss (forward + backward) against the vocabulary V and the completion length T:
the chunked loss from hidden states and LM heads (`grpokit.distillation.chunked_distillation_loss`) against the
naive one on full [T, V] logits of both models (`grpokit.loss.distillation_loss`).

    python benchmarks/distill_memory.py                                  # the default grid, CPU, peak RSS
    python benchmarks/distill_memory.py --vocab 32768 --tokens 512,2048 --json benchmarks/results/x.json
    python benchmarks/distill_memory.py --device cuda                   # peak CUDA allocation instead

Each measurement runs in a fresh subprocess (one thread): it builds the inputs (student hidden [T, H] and head
[V, H], both with gradients; the teacher's, without), resets the kernel's resident-set high-water mark, runs one
forward and backward and reports how far the peak rose above the resident set at the reset (on CUDA:
`max_memory_allocated` above the allocation at the reset). So the figure is what the loss itself adds, inputs and
the head's [V, H] weight excluded (its gradient included). The naive loss is skipped above --naive-max elements
(V·T), where it would need several GiB.

The children run with glibc's mmap threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_, unless --glibc-default), so
that every [c, V] buffer is returned to the OS when freed and the resident set tracks the live tensors: with the
default, dynamic threshold, glibc keeps freed buffers in its heap and the same run's peak varies by ~100 MiB from
one run to the next (the fragmentation benchmarks/README.md describes for QLoRA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # this tree's grpokit, not an installed one
sys.path.insert(0, str(HERE))


def measure(method: str, vocab: int, tokens: int, hidden: int, beta: float, device: str) -> dict:
    """One forward + backward in this process; returns the peak it added (MiB) and its time."""
    import torch
    from bench_vs_trl import current_rss_mib, peak_rss_since_reset_mib, reset_peak_rss

    from grpokit.distillation import chunked_distillation_loss
    from grpokit.loss import distillation_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    student_hidden = torch.randn(1, tokens, hidden, device=device, requires_grad=True)
    student_weight = (torch.randn(vocab, hidden, device=device) * 0.1).requires_grad_(True)
    teacher_hidden = torch.randn(1, tokens, hidden, device=device)
    teacher_weight = torch.randn(vocab, hidden, device=device) * 0.1
    mask = torch.ones(1, tokens, device=device)

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = current_rss_mib()
        if not reset_peak_rss():
            raise SystemExit("cannot reset the resident-set high-water mark (needs Linux /proc/self/clear_refs)")
    start = time.perf_counter()
    if method == "naive":
        loss, _ = distillation_loss(
            student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T, mask, beta=beta
        )
    else:
        loss, _ = chunked_distillation_loss(
            student_hidden, student_weight, teacher_hidden, teacher_weight, mask, beta=beta
        )
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = peak_rss_since_reset_mib() - base
    return {
        "method": method,
        "vocab": vocab,
        "tokens": tokens,
        "hidden": hidden,
        "beta": beta,
        "device": device,
        "peak_mib": round(peak, 1),
        "seconds": round(time.perf_counter() - start, 3),
        "loss": loss.item(),
    }


def cell(row: dict, method: str, key: str, width: int) -> str:
    return f"{row[method][key]:>{width}}" if method in row else f"{'-':>{width}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="8192,32768,131072", help="vocabulary sizes V")
    parser.add_argument("--tokens", default="512,2048,8192", help="completion tokens T")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size H (the loss's peak hardly depends on it)")
    parser.add_argument("--beta", type=float, default=0.5, help="0 forward KL, 0.5 JSD (most buffers), 1 reverse KL")
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold")
    parser.add_argument("--naive-max", type=int, default=2**26, help="largest V·T the naive loss is run at")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "V", "T"), help=argparse.SUPPRESS)  # a child's run
    args = parser.parse_args()
    if args.one:
        method, vocab, tokens = args.one
        print(json.dumps(measure(method, int(vocab), int(tokens), args.hidden, args.beta, args.device)))
        return

    results = []
    print(f"{'V':>8} {'T':>6} {'V·T':>12} {'naive MiB':>10} {'chunked MiB':>12} {'naive s':>8} {'chunked s':>10}")
    for vocab in map(int, args.vocab.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            row = {}
            for method in ("naive", "chunked"):
                if method == "naive" and vocab * tokens > args.naive_max:
                    continue
                command = [
                    sys.executable,
                    __file__,
                    "--one",
                    method,
                    str(vocab),
                    str(tokens),
                    "--hidden",
                    str(args.hidden),
                    "--beta",
                    str(args.beta),
                    "--device",
                    args.device,
                ]
                env = dict(os.environ) if args.glibc_default else {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
                out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
                row[method] = json.loads(out.strip().splitlines()[-1])
                results.append(row[method])
            if "naive" in row:
                assert abs(row["naive"]["loss"] - row["chunked"]["loss"]) < 1e-4 * max(1.0, abs(row["naive"]["loss"]))
            print(
                f"{vocab:>8} {tokens:>6} {vocab * tokens:>12,} {cell(row, 'naive', 'peak_mib', 10)} "
                f"{cell(row, 'chunked', 'peak_mib', 12)} {cell(row, 'naive', 'seconds', 8)} "
                f"{cell(row, 'chunked', 'seconds', 10)}",
                flush=True,
            )
    if args.json:
        import torch

        meta = {
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "command": " ".join(["python benchmarks/distill_memory.py", *sys.argv[1:]]),
            "malloc_mmap_threshold": None if args.glibc_default else 2**20,
        }
        if args.device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name()
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
