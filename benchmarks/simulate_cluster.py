"""Asynchronous generation on a simulated cluster: grpokit's scheduler (grpokit.producer) driven by simulated inference
servers and a simulated trainer (grpokit.simulate), on a virtual clock.

    python benchmarks/simulate_cluster.py --check   # predict benchmarks/async_overlap.py's asynchronous rows
    python benchmarks/simulate_cluster.py           # a Qwen2.5-7B-like run on 8 trainer GPUs, 8-32 inference GPUs

--check calibrates the simulation on the synchronous runs of benchmarks/async_overlap.py (their seconds per batch
generating and training, on one thread: what each half of the asynchronous run gets) and predicts the asynchronous
run at max_staleness=1: its time per batch, tokens/s against the two-thread synchronous loop, and the trainer's mean
wait fraction (`perf/rollout_wait_fraction`). Where completions end at EOS, the asynchronous run's policy wrote
another number of tokens than the synchronous one: both phases are scaled by the ratio of tokens per batch.

The cluster table derives its costs from FLOP and byte counts, not from measurements (see `cluster_costs`): a
simulation of the schedule, under stated assumptions, not a measured run. Results go to
benchmarks/results/simulate_cluster_{check,h100}.json.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from grpokit.simulate import Costs, Workload, simulate

RESULTS = Path(__file__).parent / "results"
CHECKED = ("engine_fixed_length", "engine_training_heavy", "engine", "tool")
SYNC_2, SYNC_1, ASYNC = "sync, 2 threads", "sync, 1 thread", "async (max_staleness=1), 1 + 1 threads"
PROMPT_TOKENS = 2  # async_overlap's prompts ("a:"): 98 tokens a completion with --fixed-length --completion 96


def check_one(name: str) -> dict:
    """The asynchronous row of async_overlap_<name>.json predicted from its synchronous one-thread row."""
    measured = json.loads((RESULTS / f"async_overlap_{name}.json").read_text())
    options, rows = measured["options"], measured["results"]
    steps, completions = options["steps"], options["batch"]
    one, two, overlapped = rows[SYNC_1], rows[SYNC_2], rows[ASYNC]
    scale = overlapped["tokens"] / one["tokens"]  # 1 with --fixed-length and with the scripted agent
    per_completion = round(overlapped["tokens"] / (steps * completions))
    if options["tool_delay"]:
        # The scripted agent: a tool call, then an answer (a turn each); the synchronous loop runs the batch's 16 tool
        # calls one after another. What is left of its generating time is the two turns' engine calls.
        tools = completions * options["tool_delay"]
        workload = Workload(
            prompts=completions // 4,
            num_generations=4,
            prompt_tokens=per_completion - 2,
            completion_median=2,
            completion_sigma=0.0,
            max_completion_length=2,
            tool_calls=1,
            tool_latency_median_s=options["tool_delay"],
        )
        decode_step_s = (one["generate_s_per_batch"] - tools) / 2
    else:
        length = per_completion - PROMPT_TOKENS
        workload = Workload(
            prompts=completions // 4,
            num_generations=4,
            prompt_tokens=PROMPT_TOKENS,
            completion_median=length,
            completion_sigma=0.0,
            max_completion_length=length,
        )
        decode_step_s = one["generate_s_per_batch"] * scale / length
    costs = Costs(
        decode_step_s=decode_step_s,
        decode_token_s=0.0,
        train_token_s=one["train_s_per_batch"] * scale / (completions * per_completion),
    )
    predicted = simulate(workload, costs, steps=steps, max_staleness=1)
    predicted_tokens_per_s = overlapped["tokens"] / predicted.time_s
    return {
        "run": name,
        "steps": steps,
        "tokens_async_over_sync": scale,
        "sync_1_thread_s_per_batch": {"generate": one["generate_s_per_batch"], "train": one["train_s_per_batch"]},
        "async_s_per_batch": {"predicted": predicted.time_s / steps, "measured": overlapped["runtime_s"] / steps},
        "async_over_sync_2_threads": {
            "predicted": predicted_tokens_per_s / two["tokens_per_s"],
            "measured": overlapped["tokens_per_s"] / two["tokens_per_s"],
            "measured_runs": [r / two["tokens_per_s"] for r in overlapped["tokens_per_s_runs"]],
        },
        "trainer_wait_fraction": {
            "predicted": predicted.rollout_wait_fraction_mean,
            "measured": overlapped["trainer_wait_fraction"],
        },
    }


def check() -> None:
    rows = [check_one(name) for name in CHECKED]
    print(
        "| run | sync, 1 thread: generate + train s/batch | async s/batch: predicted / measured | "
        "async vs sync 2 threads: predicted / measured | trainer waited: predicted / measured |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        phases, per_batch = r["sync_1_thread_s_per_batch"], r["async_s_per_batch"]
        ratio, wait = r["async_over_sync_2_threads"], r["trainer_wait_fraction"]
        print(
            f"| {r['run']} | {phases['generate']:.3f} + {phases['train']:.3f} | {per_batch['predicted']:.3f} / "
            f"{per_batch['measured']:.3f} ({per_batch['predicted'] / per_batch['measured'] - 1:+.0%}) | "
            f"{ratio['predicted']:.2f}x / {ratio['measured']:.2f}x | {wait['predicted']:.1%} / "
            f"{wait['measured']:.1%} |"
        )
    (RESULTS / "simulate_cluster_check.json").write_text(json.dumps(rows, indent=1))


# ------------------------------------------------------------------------------------------- the cluster

# Qwen2.5-7B's shape (its config.json): hidden 3584, MLP 18944, 28 layers, 28 query and 4 key-value heads of 128,
# vocabulary 152064, untied embeddings.
HIDDEN, MLP, LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 3584, 18944, 28, 4, 128, 152064
PARAMETERS = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * MLP) + 2 * VOCAB * HIDDEN
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # keys and values, bf16
# H100 SXM, dense bf16 and HBM3 (NVIDIA's datasheet).
PEAK_FLOPS, HBM_BYTES_PER_S = 989e12, 3.35e12


def cluster_costs(options: argparse.Namespace, servers: int) -> Costs:
    """Training: 6·N FLOPs a token (forward and backward) on the trainer GPUs at options.mfu of peak. Sampling, one
    server per GPU (the bf16 weights fit one H100): prefill 2·N FLOPs a prompt token at options.compute_util of peak;
    a decode step reads the weights once (2·N bytes at options.hbm_util of the bandwidth), and each row still decoding
    adds its 2·N FLOPs and its KV cache's bytes at a mean context of the prompt plus half a mean completion."""
    mean_context = options.prompt_tokens + options.completion_median / 2
    decode_flops_s = 2 * PARAMETERS / (PEAK_FLOPS * options.compute_util)
    return Costs(
        decode_step_s=2 * PARAMETERS / (HBM_BYTES_PER_S * options.hbm_util),
        decode_token_s=decode_flops_s + KV_BYTES_PER_TOKEN * mean_context / (HBM_BYTES_PER_S * options.hbm_util),
        prefill_token_s=decode_flops_s,
        train_token_s=6 * PARAMETERS / (options.trainer_gpus * PEAK_FLOPS * options.mfu),
        servers=servers,
        weight_sync_s=options.weight_sync_s,
    )


def workload_of(options: argparse.Namespace, prompts: int, agents: bool) -> Workload:
    tools = {
        "tool_calls": options.tool_calls,
        "tool_latency_median_s": options.tool_latency_median_s,
        "tool_latency_sigma": options.tool_latency_sigma,
        "tool_result_tokens": options.tool_result_tokens,
    }
    return Workload(
        prompts=prompts,
        num_generations=options.num_generations,
        prompt_tokens=options.prompt_tokens,
        completion_median=options.completion_median,
        completion_sigma=options.completion_sigma,
        max_completion_length=options.max_completion_length,
        **(tools if agents else {}),
    )


def table(options: argparse.Namespace, agents: bool) -> list[dict]:
    """One row per batch shape and number of inference GPUs: the synchronous loop, then max_staleness 1, 2, 4."""
    rows = []
    for prompts in options.agent_prompts if agents else options.prompts:
        workload = workload_of(options, prompts, agents)
        for servers in options.servers:
            costs = cluster_costs(options, servers)
            runs = {k: simulate(workload, costs, options.steps, max_staleness=k) for k in STALENESSES}
            sync = runs[None]
            rows.append(
                {
                    "prompts": prompts,
                    "num_generations": options.num_generations,
                    "servers": servers,
                    "generate_s_per_batch": sum(sync.generation_s) / sync.steps,
                    "train_s_per_batch": costs.training_s(sync.tokens / sync.steps),
                    "runs": {str(k): r.summary() for k, r in runs.items()},
                }
            )
    print(
        "| completions a step | inference GPUs | synchronous: generate + train s/batch, tokens/s | "
        + " | ".join(f"max_staleness={k}" for k in STALENESSES[1:])
        + " |"
    )
    print("|---|---|---|" + "---|" * (len(STALENESSES) - 1))
    for r in rows:
        base = r["runs"]["None"]["tokens_per_s"]
        cells = []
        for k, s in r["runs"].items():
            if k != "None" and agents:  # against tool calls one after another, the ratio says little: tokens/s
                cells.append(
                    f"{s['tokens_per_s']:,.0f}, idle {s['trainer_idle_fraction']:.0%}, {s['drop_rate']:.1%} dropped"
                )
            elif k != "None":
                cells.append(f"{s['tokens_per_s'] / base:.2f}×, idle {s['trainer_idle_fraction']:.0%}")
        print(
            f"| {r['prompts']} × {r['num_generations']} | {r['servers']} | {r['generate_s_per_batch']:.1f} + "
            f"{r['train_s_per_batch']:.1f}, {base:,.0f} | " + " | ".join(cells) + " |"
        )
    return rows


STALENESSES = (None, 1, 2, 4)


def cluster(options: argparse.Namespace) -> None:
    logging.getLogger("grpokit").setLevel(logging.ERROR)  # the producer's warnings on dropped prompts, every run
    print(
        f"N = {PARAMETERS / 1e9:.2f} B parameters; {options.steps} steps; prompts {options.prompt_tokens} tokens, "
        f"completions log-normal (median {options.completion_median}, sigma {options.completion_sigma}, at most "
        f"{options.max_completion_length})"
    )
    print("\nSingle-turn completions, whole generation batches (exact schedule):\n")
    single = table(options, agents=False)
    print(
        f"\nAgents: {options.tool_calls} tool calls a completion, each log-normal (median "
        f"{options.tool_latency_median_s} s, sigma {options.tool_latency_sigma}), {options.tool_result_tokens} tokens "
        f"of result; streamed group by group when max_staleness > 0:\n"
    )
    agents = table(options, agents=True)
    out = RESULTS / "simulate_cluster_h100.json"
    out.write_text(
        json.dumps(
            {"options": vars(options), "parameters": PARAMETERS, "single_turn": single, "agents": agents}, indent=1
        )
    )
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="predict async_overlap's asynchronous rows")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 128, 256], help="prompts a step")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--servers", type=int, nargs="+", default=[8, 16, 32], help="inference GPUs, one server each")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--completion-median", type=float, default=1000)
    parser.add_argument("--completion-sigma", type=float, default=0.6)
    parser.add_argument("--max-completion-length", type=int, default=4096)
    parser.add_argument("--trainer-gpus", type=int, default=8)
    parser.add_argument("--mfu", type=float, default=0.4, help="training's share of the GPUs' peak FLOP/s")
    parser.add_argument("--compute-util", type=float, default=0.5, help="prefill's and decode's share of peak FLOP/s")
    parser.add_argument("--hbm-util", type=float, default=0.7, help="decode's share of the HBM bandwidth")
    parser.add_argument("--weight-sync-s", type=float, default=1.0, help="seconds to push new weights to the servers")
    parser.add_argument("--agent-prompts", type=int, nargs="+", default=[128], help="prompts a step, agents' table")
    parser.add_argument("--tool-calls", type=int, default=3, help="tool calls a completion (agents' table)")
    parser.add_argument("--tool-latency-median-s", type=float, default=1.0)
    parser.add_argument("--tool-latency-sigma", type=float, default=1.0)
    parser.add_argument("--tool-result-tokens", type=int, default=100)
    options = parser.parse_args()
    check() if options.check else cluster(options)


if __name__ == "__main__":
    main()
