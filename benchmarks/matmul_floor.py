#!/usr/bin/env python
"""The matrix products one GRPO step must compute, per phase, for TRL and for grpokit, and how long they take alone.

    python benchmarks/matmul_floor.py --config small --repeats 5

For a bench_vs_trl.py configuration (fp32 only) this counts the multiply-adds of each phase's linear layers
(attention projections, MLP, LM head) and attention scores, as each trainer runs them with the same numbers:
TRL runs every row's prompt in the rollout's prefill and in both log-prob forwards; grpokit runs each distinct
prompt once per group (the rollout's prefill and `logprobs.shared_prompt_hidden`) and the completions against its
KV cache, and does not run the completion's last token through the training forwards. Both run one decode forward
per completion token but the last. The backward is two products per forward product (the inputs' and the weights'
gradients). The GEMMs of each phase are then timed alone at their shapes (torch.mm, float32, the fastest of
`--repeats`), which is the phase's floor on this CPU: a step that did nothing but its matrix products.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import CONFIGS, PROMPT_TEMPLATE, build_model_dir


def linear_shapes(config: dict, vocab_size: int) -> list[tuple[int, int]]:
    """(in, out) of every linear layer a token goes through: per decoder layer q, k, v, o, gate, up, down."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_heads"], config["num_kv_heads"]
    head_dim, mlp = hidden // heads, config["intermediate_size"]
    layer = [
        (hidden, heads * head_dim),
        (hidden, kv_heads * head_dim),
        (hidden, kv_heads * head_dim),
        (heads * head_dim, hidden),
        (hidden, mlp),
        (hidden, mlp),
        (mlp, hidden),
    ]
    return layer * config["num_layers"]


def phases(config: dict, prompt_length: int) -> dict:
    """Per phase and trainer: a list of (rows, repeats) forward passes of the decoder's linear layers, the LM head's
    rows, and the attention's (query, key) pairs."""
    n, groups, t = config["batch"], config["batch"] // config["num_generations"], config["max_completion_length"]
    p = prompt_length

    def decode(prefill_rows):  # prefill, then one forward per token but the last
        pairs = prefill_rows * p * (p + 1) // 2 + n * sum(p + i for i in range(1, t))
        return {"passes": [(prefill_rows * p, 1), (n, t - 1)], "head_rows": n * t, "attention_pairs": pairs}

    trl_forward = {
        "passes": [(n * (p + t), 1)],
        "head_rows": n * (t + 1),  # logits_to_keep = T + 1
        "attention_pairs": n * (p + t) * (p + t + 1) // 2,
    }
    completions = t - 1  # the last token predicts nothing
    grpokit_forward = {
        "passes": [(groups * p, 1), (n * completions, 1)],
        "head_rows": n * t,
        "attention_pairs": groups * p * (p + 1) // 2 + n * sum(p + i for i in range(1, completions + 1)),
    }
    return {
        "trl": {"rollout": decode(n), "reference forward": trl_forward, "policy forward": trl_forward},
        "grpokit": {"rollout": decode(groups), "reference forward": grpokit_forward, "policy forward": grpokit_forward},
    }


def flops(phase: dict, shapes, vocab_size: int, hidden: int, num_layers: int) -> float:
    linear = sum(rows * repeats * 2 * i * o for rows, repeats in phase["passes"] for i, o in shapes)
    head = 2 * phase["head_rows"] * hidden * vocab_size
    attention = 2 * 2 * phase["attention_pairs"] * hidden * num_layers  # scores and values, every query head
    return linear + head + attention


def time_products(phase: dict, shapes, vocab_size: int, hidden: int, backward: bool, repeats: int) -> float:
    """Seconds for the phase's linear-layer and head GEMMs alone (attention left out: under 1 % of the FLOPs here)."""
    jobs = []
    for rows, count in phase["passes"]:
        for i, o in shapes:
            x, w = torch.randn(rows, i), torch.randn(o, i)
            if backward:
                g = torch.randn(rows, o)
                jobs.append((count, lambda g=g, w=w: torch.mm(g, w)))  # the input's gradient
                jobs.append((count, lambda g=g, x=x: torch.mm(g.t(), x)))  # the weight's gradient
            else:
                jobs.append((count, lambda x=x, w=w: torch.mm(x, w.t())))
    x, w = torch.randn(phase["head_rows"], hidden), torch.randn(vocab_size, hidden)
    jobs.append((2 if backward else 1, lambda: torch.mm(x, w.t())))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for count, job in jobs:
            for _ in range(count):
                job()
        best = min(best, time.perf_counter() - started)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=[name for name, c in CONFIGS.items() if not c["bf16"]], default="small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = CONFIGS[args.config]
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:  # the benchmark's tokenizer, as the trainers load it
        vocab_size = build_model_dir(config, Path(tmp) / "model")["model_vocab"]
        tokenizer = AutoTokenizer.from_pretrained(Path(tmp) / "model")
    prompt_length = len(tokenizer(PROMPT_TEMPLATE.format(index=0, a=0, b=0))["input_ids"])
    shapes, hidden = linear_shapes(config, vocab_size), config["hidden_size"]
    print(
        f"`{args.config}`: {config['batch']} completions of {config['max_completion_length']} tokens, prompts of "
        f"{prompt_length} tokens, {torch.get_num_threads()} threads\n"
    )
    print("| phase | TRL GFLOP | grpokit GFLOP | TRL matmuls alone (s) | grpokit matmuls alone (s) |")
    print("|---|---|---|---|---|")
    totals = {"trl": [0.0, 0.0], "grpokit": [0.0, 0.0]}
    plan = phases(config, prompt_length)
    rows = [("rollout", "rollout", False), ("reference forward", "reference forward", False)]
    rows += [("policy forward", "policy forward", False), ("backward", "policy forward", True)]
    for label, phase_name, backward in rows:
        cells = []
        for impl in ("trl", "grpokit"):
            phase = plan[impl][phase_name]
            gflop = (2 if backward else 1) * flops(phase, shapes, vocab_size, hidden, config["num_layers"]) / 1e9
            seconds = time_products(phase, shapes, vocab_size, hidden, backward, args.repeats)
            totals[impl][0] += gflop
            totals[impl][1] += seconds
            cells.append((gflop, seconds))
        (trl_gflop, trl_s), (kit_gflop, kit_s) = cells
        print(f"| {label} | {trl_gflop:.1f} | {kit_gflop:.1f} | {trl_s:.3f} | {kit_s:.3f} |")
    (trl_gflop, trl_s), (kit_gflop, kit_s) = totals["trl"], totals["grpokit"]
    print(f"| **step** | **{trl_gflop:.1f}** | **{kit_gflop:.1f}** | **{trl_s:.3f}** | **{kit_s:.3f}** |")
    print(f"\nTRL's step does {trl_gflop / kit_gflop:.2f}x grpokit's FLOPs; their matmuls alone, {trl_s / kit_s:.2f}x.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
