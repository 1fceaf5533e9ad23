#!/usr/bin/env python
"""How far a bfloat16 or int8 reference (`ref_model_dtype="bfloat16"` / `"int8"`) moves the reference log-probs
from a float32 one.

    python benchmarks/reference_dtype.py --config qwen05            # builds the random-weight model (bench_vs_trl)
    python benchmarks/reference_dtype.py --model-dir DIR --rows 16   # or a saved model

Both references are `grpokit.models.frozen_copy` of the same float32 model; both run grpokit's training forward
(`token_logprobs`) under bf16 autocast, as the trainer runs the reference when `bf16=True`, on the same random
prompt + completion tokens. Under autocast the matmuls run in bf16 either way; what the bf16 copy changes is the
embeddings, norm weights and residual stream rounding to bf16. Prints the per-token differences and the k3 KL
estimate between the two (what a policy equal to the float32 reference would log as `kl` against the bf16 one),
and, for scale, how far bf16 autocast itself moves the float32 reference from a float32 forward without autocast.
The int8 reference is the bfloat16 copy with its linear layers quantized (`grpokit.quantized.quantize_linears`,
one scale per weight row); its figures are against the same float32 reference (`int8_*`), and its weights' size
against the bfloat16 copy's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="qwen05", help="a bench_vs_trl.py configuration to build")
    parser.add_argument("--model-dir", default=None, help="a saved model instead (config.json + weights)")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=25)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from grpokit.cpu_matmul import float32_matmuls
    from grpokit.logprobs import token_logprobs
    from grpokit.models import frozen_copy
    from grpokit.quantized import quantize_linears

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_vs_trl import CONFIGS, build_model_dir

            model_dir = Path(tmp) / "model"
            build_model_dir(CONFIGS[args.config], model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        float32_matmuls(model, "cpu")  # as the trainer runs bf16 matmuls on a CPU without bf16 hardware (else no-op)
        vocab = model.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        length = args.prompt_length + args.completion_length
        ids = torch.randint(0, vocab, (args.rows, length), generator=generator)
        mask = torch.ones_like(ids)
        results, sizes = {}, {}
        for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16), ("int8", torch.bfloat16)):
            reference = frozen_copy(model, dtype)
            if name == "int8":
                quantize_linears(reference)
            tensors = {t.data_ptr(): t for t in (*reference.parameters(), *reference.buffers())}.values()
            sizes[name] = sum(t.numel() * t.element_size() for t in tensors) / 2**20
            started = time.perf_counter()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                logprobs, _ = token_logprobs(reference, ids, mask, args.completion_length, 1.0)
            results[name] = (logprobs.float(), time.perf_counter() - started)
            del reference
        # For scale: what bf16 autocast itself moves, against the float32 reference run without autocast.
        with torch.no_grad():
            exact, _ = token_logprobs(frozen_copy(model), ids, mask, args.completion_length, 1.0)
    full, light, int8 = results["float32"][0], results["bfloat16"][0], results["int8"][0]
    autocast_delta = full - exact.float()
    delta = light - full
    kl = torch.exp(delta) - delta - 1  # k3(ref=bf16 || policy=fp32 reference), per token
    int8_delta = int8 - full
    int8_kl = torch.exp(int8_delta) - int8_delta - 1
    out = {
        "model_dir": str(model_dir),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens": int(full.numel()),
        "mean_logprob_float32": full.mean().item(),
        "abs_diff_max": delta.abs().max().item(),
        "abs_diff_mean": delta.abs().mean().item(),
        "abs_diff_p99": delta.abs().flatten().quantile(0.99).item(),
        "diff_mean (bias)": delta.mean().item(),
        "k3_kl_mean": kl.mean().item(),
        "autocast_itself_abs_diff_max": autocast_delta.abs().max().item(),
        "autocast_itself_abs_diff_mean": autocast_delta.abs().mean().item(),
        "forward_s_float32": results["float32"][1],
        "forward_s_bfloat16": results["bfloat16"][1],
        "torch": torch.__version__,
        "int8_abs_diff_max": int8_delta.abs().max().item(),
        "int8_abs_diff_mean": int8_delta.abs().mean().item(),
        "int8_abs_diff_p99": int8_delta.abs().flatten().quantile(0.99).item(),
        "int8_diff_mean (bias)": int8_delta.mean().item(),
        "int8_k3_kl_mean": int8_kl.mean().item(),
        "forward_s_int8": results["int8"][1],
        "weights_mib": sizes,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
