"""Asynchronous generation on a simulated cluster: grpokit's scheduler (grpokit.producer) driven by simulated inference
servers and a simulated trainer (grpokit.simulate), on a virtual clock.

    python benchmarks/simulate_cluster.py --measure --synchronous  # async_overlap's runs, every phase timed
    python benchmarks/simulate_cluster.py --check                  # each measured run against its simulation
    python benchmarks/simulate_cluster.py                          # a Qwen2.5-7B-like run on 8 trainer GPUs

--measure runs benchmarks/async_overlap.py's cases (the options recorded in results/async_overlap_<case>.json) at
max_staleness=1 on one thread each side, `--repeats` times, and with --synchronous each case's synchronous loop once
(the agent's excepted), timing every generation batch where it is made (engine call and scoring) with its
completions' lengths, and every optimizer step with its tokens (results/simulate_cluster_measured.json). --check
fits the simulation's cost model to each run's own phases (a batch: a part a batch, a part a decode step of its
longest row, a part a row-token decoded; a training step: a part a step, a part a token), replays the run's
completion lengths batch by batch, adds the measured start of the engine process and end of the run, and simulates
the run: its tokens/s and the trainer's idle fraction against the measured ones (results/simulate_cluster_check.json).
What it checks is the schedule given the phases; the phases themselves are the asynchronous run's, which differ from
the synchronous loop's (the two sides share the machine): the asynchronous runs are also simulated from their
synchronous loop's phases, to show by how much.

The cluster table derives its costs from FLOP and byte counts, not from measurements (see `cluster_costs`): a
simulation of the schedule, under stated assumptions, not a measured run (results/simulate_cluster_h100.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from grpokit.rollout import PromptBatch
from grpokit.simulate import Costs, Workload, simulate
from grpokit.state import TrainerCallback

RESULTS = Path(__file__).parent / "results"
CASES = ("engine_fixed_length", "engine_training_heavy", "engine", "tool")  # async_overlap_<case>.json


# ------------------------------------------------------------------------- the real runs, measured phase by phase


@contextlib.contextmanager
def timed_engine_calls(calls: list[dict]):
    """Every generation batch of a run timed where it is made, the producer's thread or the synchronous loop
    (`ExperienceMaker.make`: the engine call, then the scoring), with its prompts' tokens and its completions'
    lengths from the engine call inside (`HFEngine.generate` in the loop's process, `ProcessEngine.generate` for
    the engine in a process of its own). Streamed agents' groups are timed by engine call instead
    (`BatchingEngine._serve`: a turn of the scripted engine, then π_old's forward of the sampling weights). The
    trainer and the producer have no timing seam, and this benchmark must not change what it times: the methods
    are wrapped for the run and restored."""
    from grpokit.experience import ExperienceMaker
    from grpokit.rollout.batching import BatchingEngine
    from grpokit.rollout.hf import HFEngine
    from grpokit.rollout.process_engine import ProcessEngine

    originals = (ExperienceMaker.make, HFEngine.generate, ProcessEngine.generate, BatchingEngine._serve)
    make, *_, serve = originals

    def timed_generate(original):
        def generate(engine, prompts, params, seed):
            started = time.perf_counter()
            rollout = original(engine, prompts, params, seed)
            calls.append(call_record(started, prompts, rollout.lengths.tolist()))
            return rollout

        return generate

    def timed_make(maker, generation, trainer_state=None, sampled=None):
        started, before = time.perf_counter(), len(calls)
        experience = make(maker, generation, trainer_state, sampled)
        if sampled is None and len(calls) > before:  # a whole batch: its engine call, then its scoring
            inside = calls[before:]
            del calls[before:]
            calls.append(
                {
                    "start": started,
                    "seconds": time.perf_counter() - started,
                    "prefill_tokens": sum(c["prefill_tokens"] for c in inside),
                    "lengths": [n for c in inside for n in c["lengths"]],
                }
            )
        return experience

    def timed_serve(engine, requests):
        started = time.perf_counter()
        serve(engine, requests)
        lengths = [n for r in requests if r.rollout is not None for n in r.rollout.lengths.tolist()]
        calls.append(call_record(started, PromptBatch.concat([r.prompts for r in requests]), lengths))

    ExperienceMaker.make, BatchingEngine._serve = timed_make, timed_serve
    HFEngine.generate, ProcessEngine.generate = timed_generate(originals[1]), timed_generate(originals[2])
    try:
        yield
    finally:
        ExperienceMaker.make, HFEngine.generate, ProcessEngine.generate, BatchingEngine._serve = originals


def call_record(started: float, prompts: PromptBatch, lengths: list[int]) -> dict:
    return {
        "start": started,
        "seconds": time.perf_counter() - started,
        "prefill_tokens": sum(len(ids) * count for ids, count in zip(prompts.ids, prompts.counts)),
        "lengths": lengths,
    }


class StepTimes(TrainerCallback):
    """When each optimizer step ended, and the tokens trained by then."""

    def __init__(self):
        self.began, self.steps = None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"end": time.perf_counter(), "num_tokens": state.num_tokens})


def measure_once(name: str, asynchronous: bool) -> dict:
    """async_overlap's run of case `name` on one thread, asynchronous (max_staleness=1, the exact schedule, the
    engine in a process of its own) or synchronous, after its warm-up, with every generation batch and optimizer
    step timed."""
    import async_overlap  # this directory's

    options = async_overlap_options(name)
    async_overlap.DELAY = options.tool_delay
    torch.set_num_threads(1)
    overrides = {"max_staleness": 1} if asynchronous else {}
    calls, times = [], StepTimes()
    with tempfile.TemporaryDirectory() as directory, timed_engine_calls(calls):
        async_overlap.trainer_for(Path(directory) / "warm", options, **overrides, max_steps=1).train()
        calls.clear()
        trainer = async_overlap.trainer_for(Path(directory) / "run", options, **overrides)
        trainer.add_callback(times)
        runtime = trainer.train().metrics["train_runtime"]
    for call in calls:
        call["start"] -= times.began
    if asynchronous:  # the trainer's wait for each batch
        waits = [r["perf/rollout_wait_s"] for r in trainer.state.log_history if "perf/rollout_wait_s" in r]
    else:  # the loop's own generation of each batch
        waits = [c["seconds"] for c in calls]
    ends = [step["end"] - times.began for step in times.steps]
    tokens = [step["num_tokens"] for step in times.steps]
    return {
        "asynchronous": asynchronous,
        "runtime_s": runtime,
        "tokens": trainer.state.num_tokens,
        "waits_s": waits,
        "calls": calls,
        # Per step: when it ended, its tokens, and the trainer's busy time: since the previous step ended (the first:
        # since the first batch was started, after the engine process's start), less the wait for its batch.
        "step_end_s": ends,
        "step_tokens": [b - a for a, b in zip([0, *tokens], tokens)],
        "step_busy_s": [end - start - wait for start, end, wait in zip([calls[0]["start"], *ends], ends, waits)],
        "load_average": os.getloadavg(),
    }


def measure(names: list[str], repeats: int, synchronous: bool) -> None:
    """Each case's asynchronous run `repeats` times, interleaved (a slow spell of the machine then hits every case
    alike), and with `synchronous` its synchronous loop once, first (not the agent's: its tool calls run inside the
    batch's making); results/simulate_cluster_measured.json keeps every run."""
    logging.getLogger("grpokit").setLevel(logging.ERROR)
    out = RESULTS / "simulate_cluster_measured.json"
    runs = json.loads(out.read_text()) if out.exists() else {}
    for repeat in range(repeats):
        for name in names:
            for asynchronous in (False, True) if synchronous and repeat == 0 and name != "tool" else (True,):
                run = measure_once(name, asynchronous)
                runs.setdefault(name, []).append(run)
                print(f"{name}, {setting(run)}: {run['tokens'] / run['runtime_s']:.1f} tokens/s", flush=True)
                out.write_text(json.dumps(runs))


def setting(run: dict) -> str:
    return "max_staleness=1" if run["asynchronous"] else "synchronous"


# --------------------------------------------------------------------------- from measured phases to the simulation


def least_squares(rows: list[list[float]], values: list[float]) -> list[float]:
    """Non-negative coefficients of `rows` (columns: features) that best give `values`: a feature whose coefficient
    comes out negative (noise, or a feature that does not vary) is left out and the rest fitted again."""
    keep = list(range(len(rows[0])))
    while True:
        matrix = torch.tensor([[row[k] for k in keep] for row in rows], dtype=torch.float64)
        solution = torch.linalg.lstsq(matrix, torch.tensor(values, dtype=torch.float64)[:, None]).solution[:, 0]
        if (solution >= 0).all() or len(keep) == 1:
            coefficients = [0.0] * len(rows[0])
            for k, value in zip(keep, solution.clamp(min=0).tolist()):
                coefficients[k] = value
            return coefficients
        keep.pop(int(solution.argmin()))


def measured_costs(run: dict, workload: Workload) -> tuple[Costs, float]:
    """The cost model from one run's phases, and the seconds before its first batch was started (the engine
    process's start, which the trainer waits out). A whole generation batch: a part a batch (the request and the
    rollout crossing the pipe, the prefill of its 2-token prompts, the scoring), a part a decode step of its longest
    row and a part a token decoded (a row still decoding). The scripted agent's turn: a part a call and a part a row
    (π_old's forward of the row's context; the scripted engine's own work is nothing), charged through the
    simulation's decode terms over a turn's tokens. A training step: a part a step and a part a token."""
    calls = run["calls"]
    if workload.tool_calls:
        per_call, per_row = least_squares([[1.0, len(c["lengths"])] for c in calls], [c["seconds"] for c in calls])
        turn_tokens = workload.completion_median / (workload.tool_calls + 1)  # what a turn writes, in the simulation
        step, token, prefill = per_call / turn_tokens, per_row / turn_tokens, 0.0
    else:
        per_call, step, token = least_squares(
            [[1.0, max(c["lengths"]), sum(c["lengths"])] for c in calls], [c["seconds"] for c in calls]
        )
        prefill = per_call / (workload.completions * workload.prompt_tokens)  # a batch's part, over its prefill
    train = least_squares([[1.0, n] for n in run["step_tokens"]], run["step_busy_s"])
    costs = Costs(
        decode_step_s=step, decode_token_s=token, prefill_token_s=prefill, train_step_s=train[0], train_token_s=train[1]
    )
    return costs, calls[0]["start"]


def case_workload(name: str, run: dict, steps: int, completions: int) -> Workload:
    """What each batch of the run asked for: its completions' lengths as the run's policy wrote them (whole
    batches), or the scripted agent's two turns (a tool call, then an answer, each of one length), with the tool's
    result between them (the tokens trained on that neither the prompt nor the turns hold)."""
    calls = run["calls"]
    prompt_tokens = round(calls[0]["prefill_tokens"] / len(calls[0]["lengths"]))
    if name == "tool":
        written = sum({n for c in calls for n in c["lengths"]})
        trained = run["tokens"] / (steps * completions)
        return Workload(
            prompts=completions // 4,
            num_generations=4,
            prompt_tokens=prompt_tokens,
            completion_median=written,
            completion_sigma=0.0,
            max_completion_length=written,
            tool_calls=1,
            tool_latency_median_s=async_overlap_options(name).tool_delay,
            tool_result_tokens=round(trained - prompt_tokens - written),
        )
    batches = tuple(tuple(c["lengths"]) for c in calls[:steps])
    return Workload(
        prompts=completions // 4,
        num_generations=4,
        prompt_tokens=prompt_tokens,
        completion_median=0,
        completion_sigma=0.0,
        max_completion_length=max(map(max, batches)),
        replayed=batches,
    )


def async_overlap_options(name: str) -> argparse.Namespace:
    """The options async_overlap's run of case `name` was made with (its results file records them)."""
    return argparse.Namespace(**json.loads((RESULTS / f"async_overlap_{name}.json").read_text())["options"])


def check_one(name: str, run: dict, synchronous: dict | None = None) -> dict:
    """One measured run of case `name` against its simulation from its own phase costs (`measured_costs`) and
    lengths: the engine process's start and the run's end (after its last step) are measured, the rest simulated.
    With the case's `synchronous` run, the asynchronous one is also simulated from the synchronous loop's phases
    (what the check assumed before: each side as fast as in the loop that alternates them)."""
    options = async_overlap_options(name)
    workload = case_workload(name, run, options.steps, options.batch)
    costs, startup_s = measured_costs(run, workload)
    ending_s = max(run["runtime_s"] - run["step_end_s"][-1], 0.0)

    def simulated(costs: Costs) -> tuple[float, float]:
        predicted = simulate(workload, costs, steps=options.steps, max_staleness=1 if run["asynchronous"] else None)
        time_s = startup_s + predicted.time_s + ending_s
        return predicted.tokens / time_s, (startup_s + sum(predicted.trainer_wait_s)) / time_s

    tokens_per_s, idle = simulated(costs)
    checked = {
        "setting": setting(run),
        "tokens_per_s": {"simulated": tokens_per_s, "measured": run["tokens"] / run["runtime_s"]},
        "trainer_idle": {
            "simulated": idle,
            "measured": (run["calls"][0]["start"] + sum(run["waits_s"])) / run["runtime_s"],
        },
        "costs": vars(costs),
        "startup_s": startup_s,
        "ending_s": ending_s,
        "load_average": run["load_average"],
    }
    if synchronous is not None and run["asynchronous"]:
        loop_costs, _ = measured_costs(synchronous, case_workload(name, synchronous, options.steps, options.batch))
        checked["from_synchronous_phases"] = dict(zip(("tokens_per_s", "trainer_idle"), simulated(loop_costs)))
        checked["synchronous_costs"] = vars(loop_costs)
    return checked


def spread(values: list[float], form: str) -> str:
    """The median (of two: their mean), then the lowest and the highest."""
    low, high = min(values), max(values)
    return f"{form.format(statistics.median(values))} ({form.format(low)}–{form.format(high)})"


def check() -> None:
    """Every measured run (`--measure`) against its simulation; the table of docs/benchmarks.md."""
    measured = json.loads((RESULTS / "simulate_cluster_measured.json").read_text())
    rows = {}
    for name, runs in measured.items():
        loop = next((run for run in runs if not run["asynchronous"]), None)
        rows[name] = [check_one(name, run, loop) for run in runs]
    print(
        "| run | setting | runs | tokens/s: measured | simulated | simulated / measured | trainer idle: measured | "
        "simulated |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, checked in rows.items():
        for kind in ("synchronous", "max_staleness=1"):
            runs = [r for r in checked if r["setting"] == kind]
            if not runs:
                continue
            tokens, idle = [r["tokens_per_s"] for r in runs], [r["trainer_idle"] for r in runs]
            print(
                f"| {name} | {kind} | {len(runs)} | {spread([t['measured'] for t in tokens], '{:.0f}')} | "
                f"{spread([t['simulated'] for t in tokens], '{:.0f}')} | "
                f"{spread([t['simulated'] / t['measured'] for t in tokens], '{:.2f}')} | "
                f"{spread([100 * i['measured'] for i in idle], '{:.0f}%')} | "
                f"{spread([100 * i['simulated'] for i in idle], '{:.0f}%')} |"
            )
    print("\nThe asynchronous runs simulated from their synchronous loop's phases (the same lengths):\n")
    print("| run | simulated / measured tokens/s | trainer idle: measured | simulated |")
    print("|---|---|---|---|")
    for name, checked in rows.items():
        runs = [r for r in checked if "from_synchronous_phases" in r]
        if runs:
            ratios = [r["from_synchronous_phases"]["tokens_per_s"] / r["tokens_per_s"]["measured"] for r in runs]
            print(
                f"| {name} | {spread(ratios, '{:.2f}')} | "
                f"{spread([100 * r['trainer_idle']['measured'] for r in runs], '{:.0f}%')} | "
                f"{spread([100 * r['from_synchronous_phases']['trainer_idle'] for r in runs], '{:.0f}%')} |"
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
    parser.add_argument(
        "--measure",
        nargs="*",
        choices=CASES,
        default=None,
        help="run async_overlap's asynchronous runs with every phase timed (all cases when none is named), "
        "adding to results/simulate_cluster_measured.json",
    )
    parser.add_argument("--repeats", type=int, default=3, help="--measure: runs of each case, interleaved")
    parser.add_argument("--synchronous", action="store_true", help="--measure: each case's synchronous loop too, once")
    parser.add_argument("--check", action="store_true", help="simulate every measured run from its phases")
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
    if options.measure is not None:
        measure(options.measure or list(CASES), options.repeats, options.synchronous)
    elif options.check:
        check()
    else:
        cluster(options)


if __name__ == "__main__":
    main()
