"""Padding-free (packed) training forwards against the padded and shared-prompt ones, on completions of spread lengths.

    python benchmarks/packing.py --config small --threads 1 --repeats 3
    python benchmarks/packing.py --config 50m --threads 1 --repeats 2
    python benchmarks/packing.py --config qwen05x4 --threads 1 --repeats 2   # Qwen2.5-0.5B widths, 4 layers

The workload is one training micro-batch: B prompts x G completions, prompts of spread lengths (left-padded), and
completions that end at EOS: each completion token is EOS with probability p (`--eos-prob`, default 3 / T), so
lengths are geometric with mean ~T/3, truncated at T, the lengths a policy whose EOS probability is p at every step
samples (a long tail cut at max_completion_length, as in RL runs). Rows are shuffled, as the trainer shuffles them.

Each mode runs `grpokit.logprobs.token_logprobs` forward and backward (a random linear functional of the log-probs)
in a fresh process, with the same model and batch:

- `padded`: one decoder forward of the padded [N, P + T] rows (the chunked head on real tokens);
- `shared`: today's default, each distinct prompt once and the completions against its KV cache, in length groups;
- `packed`: padding_free=True at the default row bound (PACKED_ROW_WIDTH x the padded row), and `packed-k1`,
  `packed-k4`, `packed-1row` at other bounds (one row: the whole micro-batch in one [1, M] sequence);
- `padded-ckpt` / `packed-ckpt`: the same under gradient checkpointing (where `shared` cannot run).

Reported per mode: seconds per forward + backward (median of --repeats after one warm-up), the peak RSS added during
a step (sampled every millisecond, relative to the RSS just before it), the bytes the autograd graph saved for the
backward (saved_tensors_hooks, unique storages), and the positions the decoder ran. Results JSON under
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # this tree's grpokit, not an installed one

CONFIGS = {
    # bench_vs_trl's `small` shape: 4 layers, hidden 256, SwiGLU 1024, 4 / 2 heads; 64 completions of at most 64.
    "small": dict(
        vocab_size=64,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=1024,
        prompts=8,
        generations=8,
        prompt_length=32,
        completion_length=64,
        bf16=False,
    ),
    # ~46M parameters: 8 layers, hidden 512, SwiGLU 2048, 8 / 2 heads, vocab 32,000 (tied); 16 completions (2 prompts
    # x 8) of at most 128 tokens after prompts of 24 to 48.
    "50m": dict(
        vocab_size=32_000,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=2048,
        prompts=2,
        generations=8,
        prompt_length=48,
        completion_length=128,
        bf16=False,
    ),
    # Qwen2.5-0.5B widths (hidden 896, MLP 4864, 14 / 2 heads, vocab 151,936, tied) with 4 of its 24 layers, float32
    # (this CPU has no bf16 instructions; --bf16 for autocast); 16 completions (2 prompts x 8) of at most 128 tokens.
    "qwen05x4": dict(
        vocab_size=151_936,
        hidden_size=896,
        num_layers=4,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        prompts=2,
        generations=8,
        prompt_length=48,
        completion_length=128,
        bf16=False,
    ),
}
MODES = {  # name -> (how, row bound factor or None, gradient checkpointing)
    "padded": ("padded", None, False),
    "shared": ("shared", None, False),
    "packed": ("packed", None, False),
    "packed-k1": ("packed", 1, False),
    "packed-k4": ("packed", 4, False),
    "packed-1row": ("packed", 10**6, False),
    "padded-ckpt": ("padded", None, True),
    "packed-ckpt": ("packed", None, True),
}


def make_batch(config: dict, eos_prob: float, seed: int):
    """input_ids, attention_mask [N, P + T] and the completion lengths: spread prompt lengths, geometric completion
    lengths (EOS with probability eos_prob per token), rows shuffled."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompts, group = config["prompts"], config["generations"]
    n, width_p, width_t, vocab = (
        prompts * group,
        config["prompt_length"],
        config["completion_length"],
        config["vocab_size"],
    )
    eos = 1
    prompt_lengths = torch.randint(width_p // 2, width_p + 1, (prompts,), generator=generator)
    prompt_ids = torch.randint(3, vocab, (prompts, width_p), generator=generator)
    prompt_mask = (torch.arange(width_p) >= width_p - prompt_lengths[:, None]).long()
    prompt_ids = (prompt_ids * prompt_mask).repeat_interleave(group, 0)
    prompt_mask = prompt_mask.repeat_interleave(group, 0)
    completion_ids = torch.randint(3, vocab, (n, width_t), generator=generator)
    is_eos = torch.rand(n, width_t, generator=generator) < eos_prob
    first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), width_t)  # [N] index of EOS, or T
    lengths = (first_eos + 1).clamp(max=width_t)  # EOS is a real completion token
    completion_ids[torch.arange(n), first_eos.clamp(max=width_t - 1)] = torch.where(
        first_eos < width_t, eos, completion_ids[torch.arange(n), first_eos.clamp(max=width_t - 1)]
    )
    completion_mask = (torch.arange(width_t) < lengths[:, None]).long()
    completion_ids = completion_ids * completion_mask
    order = torch.randperm(n, generator=generator)
    ids = torch.cat([prompt_ids, completion_ids], 1)[order]
    mask = torch.cat([prompt_mask, completion_mask], 1)[order]
    return ids, mask, lengths[order]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Highest RSS while inside the block, sampled every millisecond by a thread, minus the RSS on entry."""

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.added = self.peak - self.start


def build(spec: dict):
    import torch

    from grpokit.testing import build_tiny_model

    torch.set_num_threads(spec["threads"])
    config = spec["config"]
    model = build_tiny_model(
        config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_layers"],
        num_heads=config["num_heads"],
        num_kv_heads=config["num_kv_heads"],
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=4096,
        seed=0,
    )
    model.train()
    ids, mask, lengths = make_batch(config, spec["eos_prob"], spec["seed"])
    upstream = torch.randn(ids.shape[0], config["completion_length"], generator=torch.Generator().manual_seed(1))
    positions = []
    model.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: positions.append((args[0] if args else kwargs["hidden_states"]).shape[:2].numel()),
        with_kwargs=True,
    )
    return model, ids, mask, lengths, upstream, positions


def step(model, ids, mask, upstream, mode: str, bf16: bool) -> tuple[float, int]:
    """One forward + backward in `mode`: (seconds, bytes saved for the backward)."""
    import torch

    import grpokit.logprobs as logprobs_module
    from grpokit.compat import is_activation_checkpointing
    from grpokit.logprobs import token_logprobs

    how, row_factor, checkpointing = MODES[mode]
    if checkpointing != is_activation_checkpointing(model):
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    logprobs_module.PACKED_ROW_WIDTH = row_factor or 2
    model.zero_grad(set_to_none=True)
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logprobs, _ = token_logprobs(
                model,
                ids,
                mask,
                upstream.shape[1],
                with_entropy=True,
                chunked=True,
                share_prompts=how == "shared",
                padding_free=how == "packed",
            )
        loss = (logprobs * upstream).sum()
    loss.backward()
    return time.perf_counter() - start, sum(saved.values())


def child_time(spec: dict) -> dict:
    """Every mode in one process, interleaved round by round (the machine's load drifts): seconds per mode."""
    model, ids, mask, lengths, upstream, positions = build(spec)
    modes, bf16 = spec["modes"], spec["config"]["bf16"]
    times = {mode: [] for mode in modes}
    runs = {}
    for round_ in range(spec["repeats"] + 1):  # round 0 warms up
        for mode in modes:
            positions.clear()
            seconds, _ = step(model, ids, mask, upstream, mode, bf16)
            runs[mode] = sum(positions)  # the layer's hooks stay outside checkpointing's recomputation
            if round_:
                times[mode].append(seconds)
    return {
        "times": times,
        "positions": runs,
        "rows": int(ids.shape[0]),
        "padded_positions": int(ids.numel()),
        "real_tokens": int(mask.sum()),
        "completion_lengths": lengths.tolist(),
    }


def child_memory(spec: dict) -> dict:
    """One mode in a fresh process: peak RSS added by a step (after a warm-up step) and bytes saved for backward."""
    import ctypes

    model, ids, mask, _lengths, upstream, _positions = build(spec)
    step(model, ids, mask, upstream, spec["mode"], spec["config"]["bf16"])
    model.zero_grad(set_to_none=True)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give what the warm-up freed back, so that the step's peak shows
    with PeakRss() as rss:
        _, saved = step(model, ids, mask, upstream, spec["mode"], spec["config"]["bf16"])
    return {"peak_rss_added_mib": rss.added / 2**20, "saved_for_backward_mib": saved / 2**20}


def run_child(spec: dict, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, env=env, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eos-prob", type=float, default=None, help="per-token EOS probability (default 3 / T)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (default: the config's)")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/packing_<config>.json)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child_time(spec) if spec["kind"] == "time" else child_memory(spec)))
        return 0
    config = {**CONFIGS[args.config], **({"bf16": True} if args.bf16 else {})}
    eos_prob = args.eos_prob if args.eos_prob is not None else 3 / config["completion_length"]
    modes = args.modes.split(",")
    start_load = os.getloadavg()
    common = dict(config=config, threads=args.threads, eos_prob=eos_prob, seed=args.seed)
    timing = run_child({**common, "kind": "time", "modes": modes, "repeats": args.repeats}, args.threads)
    results = []
    for mode in modes:
        memory = run_child({**common, "kind": "memory", "mode": mode}, args.threads)
        seconds = statistics.median(timing["times"][mode])
        results.append(
            {
                "mode": mode,
                "seconds": seconds,
                "all_seconds": timing["times"][mode],
                "decoder_positions": timing["positions"][mode],
                **memory,
            }
        )
        print(
            f"{mode:>12}: {seconds:7.3f} s  peak +{memory['peak_rss_added_mib']:7.1f} MiB  saved "
            f"{memory['saved_for_backward_mib']:7.1f} MiB  positions {timing['positions'][mode]}",
            flush=True,
        )
    lengths = timing["completion_lengths"]
    summary = {
        "config": args.config,
        **config,
        "eos_prob": eos_prob,
        "threads": args.threads,
        "repeats": args.repeats,
        "load_average_at_start": start_load,
        "load_average_at_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "rows": timing["rows"],
        "padded_positions": timing["padded_positions"],
        "real_tokens": timing["real_tokens"],
        "completion_lengths": {
            "min": min(lengths),
            "mean": sum(lengths) / len(lengths),
            "max": max(lengths),
            "all": lengths,
        },
        "results": results,
    }
    by_mode = {r["mode"]: r for r in results}
    if "padded" in by_mode:
        summary["speedup_vs_padded"] = {r["mode"]: by_mode["padded"]["seconds"] / r["seconds"] for r in results}
    import torch
    import transformers

    summary["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"packing_{args.config}.json")
    out.write_text(json.dumps(summary, indent=2))
    spread = {k: round(v, 1) for k, v in summary["completion_lengths"].items() if k != "all"}
    print(f"load average {start_load} at start, {os.getloadavg()} at end; completion lengths {spread}; written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
