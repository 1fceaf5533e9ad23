"""Images encoded once per group: the training forward (policy log-probs, forward and backward) of a VLM batch of
B prompts x G completions, with shared prompts (each prompt and its image through the vision encoder and the
decoder once) against one row at a time (every row encodes its image). Each mode runs in a fresh process; the
figures are the step's wall time (median of --repeats) and the peak resident memory it adds over the process
after setup (ru_maxrss).

    python benchmarks/vision_prompts.py --prompts 4 --generations 8 --image-size 224 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))  # this tree's grpokit, not an installed one


def run_mode(options, share: bool) -> dict:
    import torch

    from grpokit.logprobs import token_logprobs
    from grpokit.rollout import HFEngine, PromptCodec
    from grpokit.testing import build_tiny_vlm, solid_image

    torch.set_num_threads(options.threads)
    model, processor = build_tiny_vlm(
        options.model_type,
        image_size=options.image_size,
        hidden_size=64,
        vision_hidden_size=options.vision_hidden_size,
        vision_layers=options.vision_layers,
    )
    model.train()
    rows = [
        {
            "prompt": [{"role": "user", "content": "colour?"}],
            "image": solid_image((20 * i, 90, 200 - 20 * i), options.image_size),
        }
        for i in range(options.prompts)
    ]
    codec = PromptCodec(processor, model)
    prompts = codec.encode(rows, [options.generations] * options.prompts)
    rollout = HFEngine(model).generate(prompts, codec.sampling_params(options.completion_length), seed=0)
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.attention_mask], 1)
    encoded = []
    model.model.vision_tower.register_forward_hook(
        lambda module, args, kwargs, out: encoded.append((args[0] if args else kwargs["pixel_values"]).shape[0]),
        with_kwargs=True,
    )
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(options.repeats):
        encoded.clear()
        model.zero_grad()
        started = time.perf_counter()
        logprobs, _ = token_logprobs(
            model, ids, mask, rollout.completion_ids.shape[1], share_prompts=share, multimodal=rollout.multimodal
        )
        (logprobs * rollout.attention_mask).sum().backward()
        times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "share_prompts": share,
        "step_seconds": statistics.median(times),
        "times": times,
        "peak_rss_added_mib": (peak - baseline) / 1024,
        "images_encoded": sum(encoded),
        "rows": len(rollout),
        "prompt_tokens": rollout.prompt_ids.shape[1],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-type", default="llava")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--vision-hidden-size", type=int, default=128)
    parser.add_argument("--vision-layers", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mode", choices=["shared", "per_row"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    if options.mode:
        print(json.dumps(run_mode(options, options.mode == "shared")))
        return
    results = []
    for mode in ("shared", "per_row"):
        command = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        results.append(json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout))
    for r in results:
        print(
            f"share_prompts={r['share_prompts']!s:5}  images encoded {r['images_encoded']:3d}  "
            f"step {r['step_seconds']:.3f} s  peak RSS +{r['peak_rss_added_mib']:.0f} MiB  "
            f"({r['rows']} rows, {r['prompt_tokens']} prompt tokens)"
        )
    if options.out:
        with open(options.out, "w") as handle:
            json.dump({"options": vars(options), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
