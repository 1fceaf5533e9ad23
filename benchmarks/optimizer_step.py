"""Time of one `adamw_torch_bf16` step (bf16 weights and states, stochastic rounding) over a model's parameters:
torchao's own `_AdamW` against grpokit's row-chunked one (`grpokit.optim.row_chunked`), in one process.

    python benchmarks/optimizer_step.py                     # the Qwen2.5-0.5B shapes (494M parameters)
    python benchmarks/optimizer_step.py --layers 4 --repeats 3
    python benchmarks/optimizer_step.py --device cuda   # on a GPU both round as torchao does: the row blocks' cost

The parameters are random tensors of the model's shapes (tied embedding, 24 decoder layers of attention, MLP and
norms), their gradients random too. Both optimizers update copies of the same weights with the same gradients;
each is stepped once first (torch.compile's compilation, not timed), then `--repeats` times, and the best time is
printed with the time per parameter. The two differ in how they round: torchao draws a random 16-bit integer per
element (`torch.randint` inside its compiled step, which its CPU kernel draws one element at a time); grpokit
computes torchao's float32 update and rounds it with `grpokit.optim.stochastic_round_to_bf16` (a hash of the
element's index). The states they keep are the same (tests/test_memory.py).
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # this tree's grpokit, not an installed one

from grpokit.optim import row_chunked

QWEN05 = dict(vocab=151_936, hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2)


def parameter_shapes(vocab, hidden, intermediate, layers, heads, kv_heads) -> list[tuple[int, ...]]:
    head_dim = hidden // heads
    layer = [
        (hidden, hidden),
        (hidden,),
        (kv_heads * head_dim, hidden),
        (kv_heads * head_dim,),
        (kv_heads * head_dim, hidden),
        (kv_heads * head_dim,),
        (hidden, hidden),  # q (bias), k, v, o
        (intermediate, hidden),
        (intermediate, hidden),
        (hidden, intermediate),  # gate, up, down
        (hidden,),
        (hidden,),
    ]  # the two norms
    return [(vocab, hidden)] + layer * layers + [(hidden,)]


def timed_steps(optimizer, repeats: int, device: torch.device) -> float:
    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    optimizer.step()  # compiles
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        optimizer.step()
        synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=QWEN05["layers"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from torchao.optim import _AdamW

    shapes = parameter_shapes(**{**QWEN05, "layers": args.layers})
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator).bfloat16().to(device) for shape in shapes]
    gradients = [(torch.randn(shape, generator=generator) * 1e-3).bfloat16().to(device) for shape in shapes]
    count = sum(w.numel() for w in weights)
    results = {
        "parameters": count,
        "threads": args.threads,
        "torch": torch.__version__,
        "device": str(device),
        "processor": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
    }
    for name, cls in (("torchao _AdamW", _AdamW), ("grpokit row-chunked _AdamW", row_chunked(_AdamW))):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(params, gradients):
            p.grad = g
        optimizer = cls(params, lr=1e-5, weight_decay=0.0, bf16_stochastic_round=True)
        seconds = timed_steps(optimizer, args.repeats, device)
        results[name] = seconds
        print(
            f"{name}: {seconds:.2f} s per step, {seconds / count * 1e9:.2f} ns per parameter "
            f"({count / 1e6:.0f}M parameters, {args.threads} thread(s))"
        )
        del params, optimizer
    ratio = results["torchao _AdamW"] / results["grpokit row-chunked _AdamW"]
    results["speedup"] = ratio
    print(f"grpokit / torchao: {ratio:.2f}x faster")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
