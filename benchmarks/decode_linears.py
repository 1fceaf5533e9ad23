#!/usr/bin/env python
"""The in-process engine's rollout with its float32 linear layers packed for oneDNN (`rollout.fast.packed_linears`)
against the same rollout through torch's own `nn.Linear` (MKL), on a bench_vs_trl.py configuration.

    python benchmarks/decode_linears.py --config small --repeats 7

Builds the configuration's random-weight model, then samples its batch (8 prompts x 8 completions of 64 tokens for
`small`) alternately with the packed layers and without (`PACKED_LINEARS_MAX_BYTES = 0`), `--repeats` times each,
in one process, and prints the median rollout time of each, their ratio, whether the tokens are the same and the
largest difference of the sampling log-probs (float rounding: another kernel sums the same products).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import CONFIGS, PROMPT_TEMPLATE, build_model_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(c for c in CONFIGS if not CONFIGS[c]["cuda"]), default="small")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.rollout import SamplingParams, fast
    from grpokit.rollout.hf import generate

    config = CONFIGS[args.config]
    with tempfile.TemporaryDirectory(prefix="grpokit-decode-") as tmp:
        build_model_dir(config, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    groups, size = config["batch"] // config["num_generations"], config["num_generations"]
    prompts = [PROMPT_TEMPLATE.format(index=i, a=i, b=2 * i) for i in range(groups)]
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    ids, mask = (encoded[k].repeat_interleave(size, 0) for k in ("input_ids", "attention_mask"))
    params = SamplingParams(
        max_new_tokens=config["max_completion_length"],
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
    )
    budget = fast.PACKED_LINEARS_MAX_BYTES
    times: dict[bool, list[float]] = {True: [], False: []}
    rollouts = {}
    for repeat in range(args.repeats + 1):  # the first round warms both up, untimed
        for packed in (True, False):
            fast.PACKED_LINEARS_MAX_BYTES = budget if packed else 0
            started = time.perf_counter()
            rollout = generate(
                model, ids, mask, params, generator=torch.Generator().manual_seed(repeat), num_generations=size
            )
            if repeat:
                times[packed].append(time.perf_counter() - started)
            rollouts[packed] = rollout
    fast.PACKED_LINEARS_MAX_BYTES = budget
    packed, plain = (statistics.median(times[k]) for k in (True, False))
    same = torch.equal(rollouts[True].completion_ids, rollouts[False].completion_ids)
    gap = (rollouts[True].sampling_logprobs - rollouts[False].sampling_logprobs).abs().max().item()
    available = "available" if fast._can_pack_linears() else "UNAVAILABLE"
    print(
        f"`{args.config}`, {ids.shape[0]} rows x {params.max_new_tokens} tokens, {torch.get_num_threads()} threads, "
        f"{args.repeats} rollouts each (alternating), packing {available}"
    )
    print(f"rollout, packed oneDNN linears: {packed:.3f} s (median)")
    print(f"rollout, nn.Linear (MKL):       {plain:.3f} s (median)")
    print(f"speed-up: {plain / packed:.2f}x; same tokens: {same}; largest log-prob difference: {gap:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
