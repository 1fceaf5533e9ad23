"""Every architecture TRL 1.16's GRPOTrainer trains, trained here: two GRPO steps through `GRPOTrainer` on a tiny
random-weight model of each, the sampling log-probs against the training forward's, and which fast path each
architecture takes or is refused (`grpokit.rollout.fast`, `grpokit.logprobs`).

Shapes as in rollout.py: N = B·G rows, P prompt tokens (left-padded), T completion tokens (right-padded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from grpokit.logprobs import can_share_prompts, supports_chunked_head, token_logprobs
from grpokit.rollout import SamplingParams, decoders, direct, fast
from grpokit.rollout.hf import generate
from grpokit.testing import build_char_tokenizer, build_tiny_model_of_type

LOGPROB_ATOL = 1e-5  # float32: sampling forwards (KV cache) vs training forward (one pass)


@dataclass(frozen=True)
class Architecture:
    model_type: str
    config: dict  # overrides of build_tiny_model_of_type's tiny config
    chunked_head: bool  # the LM head in chunks (logprobs.CHUNKED_HEAD_MODEL_TYPES, no logit transform)
    shared_prompts: bool  # each prompt through the decoder once in the training forward
    one_token_attention: bool  # decode steps' attention as two matmuls (models that run SDPA, on CPU)
    cache_layers: tuple[str, ...]  # the sampling cache's layer classes for a rollout longer than the window
    direct_step: bool = False  # decode steps through rollout/direct.py (Llama-family classes, float32 on CPU)


PRE, SLIDING = "PreallocatedLayer", "DynamicSlidingWindowLayer"
ROUTER_LOGITS = {"output_router_logits": True}  # as a MoE config trained with a load-balancing loss sets it
ARCHITECTURES = {
    "qwen2": Architecture("qwen2", {}, True, True, True, (PRE, PRE), direct_step=True),
    "qwen3": Architecture("qwen3", {}, True, True, True, (PRE, PRE), direct_step=True),
    "qwen3_moe": Architecture("qwen3_moe", ROUTER_LOGITS, True, True, True, (PRE, PRE)),
    "llama": Architecture("llama", {}, True, True, True, (PRE, PRE), direct_step=True),
    # Gemma 2: soft-capped logits (no chunked head) and attention (eager, so no one-token attention).
    "gemma2": Architecture("gemma2", {}, False, False, False, (SLIDING, PRE)),
    "gemma3_text": Architecture("gemma3_text", {}, True, False, True, (SLIDING, PRE)),
    # Cohere 2: logits scaled by `logit_scale` (no chunked head).
    "cohere2": Architecture("cohere2", {}, False, False, True, (SLIDING, PRE)),
    "glm4_moe": Architecture("glm4_moe", ROUTER_LOGITS, True, True, True, (PRE, PRE)),
    # GPT-OSS: attention sinks, eager attention only.
    "gpt_oss": Architecture("gpt_oss", ROUTER_LOGITS, True, False, False, (SLIDING, PRE)),
    # NemotronH: a Mamba-2 block (its state is no key/value cache), an attention block and a MoE block.
    "nemotron_h": Architecture("nemotron_h", {}, True, False, True, ("LinearAttentionLayer", PRE, "DummyLayer")),
}
NAMES = sorted(ARCHITECTURES)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tiny models gain nothing from intra-op threads, and on a shared 2-core machine a thread waiting for a
    busy core made this file ten times slower (100 s against 10 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(name: str, vocab_size: int = 64):
    arch = ARCHITECTURES[name]
    return build_tiny_model_of_type(arch.model_type, num_layers=2, vocab_size=vocab_size, **arch.config)


# ------------------------------------------------------------------------------------------------ training


@pytest.mark.parametrize("name", NAMES)
def test_two_grpo_steps_through_the_trl_style_trainer(name, tmp_path):
    from datasets import Dataset

    from grpokit import GRPOConfig, GRPOTrainer

    tokenizer = build_char_tokenizer("abcd:")
    model = tiny_model(name, vocab_size=len(tokenizer))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    dataset = Dataset.from_list([{"prompt": f"{c}:"} for c in "abcd"])

    def count_a(completions, **kwargs):
        return [float(c.count("a")) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_prompt_length=8,
        max_completion_length=6,
        learning_rate=1e-2,
        beta=0.04,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=count_a, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()

    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) and math.isfinite(log["kl"]) for log in logs), logs
    after = trainer.unwrapped_model.state_dict()
    assert any(not torch.equal(after[key], value) for key, value in before.items())


# ------------------------------------------------------------------------------------------------ sampling


def grouped_prompts(seed=1):
    """Three prompts of 6, 3 and 5 tokens (left-padded), each twice: [6, 6]."""
    prompt_ids = torch.randint(3, 64, (3, 6), generator=torch.Generator().manual_seed(seed)).repeat_interleave(2, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[2:4, :3] = 0
    prompt_mask[4:, :1] = 0
    return prompt_ids, prompt_mask


# Every fifth token ends a completion: rows finish between 1 and 10 tokens and leave the decode batch.
PARAMS = SamplingParams(max_new_tokens=10, eos_token_ids=tuple(range(1, 64, 5)), pad_token_id=0, temperature=0.8)


@pytest.mark.parametrize("name", NAMES)
def test_sampling_logprobs_are_the_training_forwards(name):
    # The decode loop (prompt run once per group, KV cache, finished rows dropped, one-token attention where it
    # applies) samples what the plain loop (the whole sequence re-run each step, no cache) samples, and its
    # log-probs are the training forward's, by either head, to float rounding.
    model = tiny_model(name)
    prompt_ids, prompt_mask = grouped_prompts()
    router_logits = []  # what the model's forwards returned as router logits while sampling
    hook = model.register_forward_hook(
        lambda module, args, out: router_logits.append(getattr(out, "router_logits", None))
    )
    try:
        rollout = generate(
            model, prompt_ids, prompt_mask, PARAMS, generator=torch.Generator().manual_seed(2), num_generations=2
        )
    finally:
        hook.remove()
    plain = generate(
        model,
        prompt_ids,
        prompt_mask,
        PARAMS,
        generator=torch.Generator().manual_seed(2),
        num_generations=2,
        use_cache=False,
    )
    assert torch.equal(rollout.completion_ids, plain.completion_ids)
    assert (rollout.sampling_logprobs - plain.sampling_logprobs).abs().max() <= LOGPROB_ATOL
    assert rollout.lengths.min() < rollout.lengths.max()  # rows left the decode batch at different steps
    assert all(logits is None for logits in router_logits)  # none computed for sampling, even where configured

    ids = torch.cat([prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([prompt_mask, rollout.attention_mask], 1)
    real = rollout.attention_mask.bool()
    width = ids.shape[1] - prompt_ids.shape[1]
    with torch.no_grad():
        for chunked in (None, False):  # the default head (chunked where supported) and the model's own logits
            logprobs, _ = token_logprobs(model, ids, mask, width, PARAMS.temperature, chunked=chunked)
            diff = (rollout.sampling_logprobs[real] - logprobs[real]).abs().max()
            assert diff <= LOGPROB_ATOL, f"chunked={chunked}: max |sampling - training| log-prob {diff:.2e}"


# ------------------------------------------------------------------------------------------------ fast paths


@pytest.mark.parametrize("name", NAMES)
def test_each_fast_path_is_taken_or_refused_as_intended(name, monkeypatch):
    arch = ARCHITECTURES[name]
    model = tiny_model(name)
    assert supports_chunked_head(model) == arch.chunked_head
    assert can_share_prompts(model) == arch.shared_prompts
    capacity = 16  # longer than the tiny sliding windows (4 positions)
    assert tuple(type(layer).__name__ for layer in fast.sampling_cache(model, capacity).layers) == arch.cache_layers

    def decode_paths(direct_step: bool) -> tuple[bool, bool]:
        """Whether the decode steps went through the one-token attention, and through the direct step."""
        query_lengths, direct_steps = [], []
        original, original_direct = fast.one_token_attention_forward, direct.DirectStep.__call__
        monkeypatch.setattr(
            fast,
            "one_token_attention_forward",
            lambda *a, **k: query_lengths.append(a[1].shape[2]) or original(*a, **k),
        )
        monkeypatch.setattr(direct.DirectStep, "__call__", lambda *a: direct_steps.append(1) or original_direct(*a))
        monkeypatch.setattr(decoders, "DIRECT_STEP", direct_step)
        fast._register_one_token_attention.cache_clear()  # registers the spy
        try:
            prompt_ids, prompt_mask = grouped_prompts()
            generate(
                model, prompt_ids, prompt_mask, PARAMS, generator=torch.Generator().manual_seed(2), num_generations=2
            )
        finally:
            monkeypatch.undo()
            fast._register_one_token_attention.cache_clear()
            fast._register_one_token_attention()  # the real function again
        return 1 in query_lengths, bool(direct_steps)

    # The direct step computes the one-token attention itself: with it off, the model's forward takes that path.
    assert decode_paths(direct_step=False) == (arch.one_token_attention, False)
    assert decode_paths(direct_step=True) == (arch.one_token_attention and not arch.direct_step, arch.direct_step)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_a_window_as_long_as_the_rollout_is_preallocated(name):
    # A sliding window that never drops a position of the rollout keeps what a full-attention layer keeps.
    model = tiny_model(name)
    window = model.config.sliding_window
    assert type(fast.sampling_cache(model, window).layers[0]).__name__ == PRE
    assert type(fast.sampling_cache(model, window + 1).layers[0]).__name__ == SLIDING


def test_soft_capped_gemma3_logits_take_the_plain_head():
    assert supports_chunked_head(tiny_model("gemma3_text"))
    assert not supports_chunked_head(
        build_tiny_model_of_type("gemma3_text", vocab_size=64, final_logit_softcapping=30.0)
    )
