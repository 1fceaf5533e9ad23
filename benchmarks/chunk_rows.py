"""Forward + backward time of the chunked LM head against its chunk size, at a real vocabulary.

    python benchmarks/chunk_rows.py                       # Qwen2.5-0.5B's head: V = 151,936, H = 896
    python benchmarks/chunk_rows.py --vocab 32000 --hidden 256
    python benchmarks/chunk_rows.py --frozen --rows 64,128,256,512   # a LoRA policy's head: frozen bf16 weight

With --frozen the weight is bf16 and needs no gradient and entropies are computed, as in a LoRA policy's forward:
the backward is then a gather, so only the forward's speed and memory depend on the chunk size
(`grpokit.logprobs.MIN_FROZEN_CHUNK_ROWS`). On Linux each line also gives the peak resident memory the pass added
(the kernel's high-water mark, reset before each pass).

Each chunk of the backward adds a [V, H] product into the weight's gradient, so with a large vocabulary chunks of
few rows make that pass dominate: this is what `grpokit.logprobs.MIN_CHUNK_ROWS` is chosen from. `0` in --rows is
the plain head (all logits at once), for comparison. Prints seconds per forward + backward (best of --repeats).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # this tree's grpokit, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import current_rss_mib, peak_rss_since_reset_mib, reset_peak_rss

from grpokit.logprobs import chunked_token_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--tokens", type=int, default=512, help="rows through the head (completion tokens)")
    parser.add_argument("--rows", default="27,128,256,512,0", help="chunk sizes to time; 0 = the plain head")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--frozen", action="store_true", help="a bf16 weight without gradient, with entropies")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_(True)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    if args.frozen:
        weight = weight.detach().bfloat16()
        hidden = hidden.detach().bfloat16().requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.tokens,))

    def step(rows: int) -> float:
        weight.grad = hidden.grad = None
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if rows == 0:
                logprobs = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(-1, targets[:, None])
            else:
                logprobs, _ = chunked_token_logprobs(hidden, weight, targets, chunk_rows=rows, with_entropy=args.frozen)
        logprobs.sum().backward()
        return time.perf_counter() - start

    for rows in (int(r) for r in args.rows.split(",")):
        step(rows)  # warm-up
        start_rss = current_rss_mib()
        measured = reset_peak_rss()
        best = min(step(rows) for _ in range(args.repeats))
        added = f", peak +{peak_rss_since_reset_mib() - start_rss:,.0f} MiB" if measured else ""
        print(f"{'plain head' if rows == 0 else f'{rows}-row chunks':>16}: {best:.2f} s{added}", flush=True)


if __name__ == "__main__":
    main()
