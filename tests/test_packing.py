"""Padding-free (packed) training forwards against their naive twin, the padded forward.

The twin is `token_logprobs(..., chunked=True, share_prompts=False)`: one decoder forward of the whole padded
[N, P + T] rows and the chunked head on the real completion tokens (itself tested against the model's own logits in
tests/test_chunked.py). Packed must give the same log-probs, entropies and parameter gradients in float32 (1e-5,
gradients relative to their scale as in test_chunked), on rows of very different lengths: empty completions
(EOS-only rows trimmed to nothing), one-token completions, holes, several distinct prompts with different left
padding, rows shuffled.
"""

from __future__ import annotations

import pytest
import torch

import grpokit.logprobs as policy
from grpokit.compat import is_activation_checkpointing
from grpokit.forward import position_ids_from_mask
from grpokit.logprobs import packing_refusal, token_logprobs
from grpokit.packing import pack_rows
from grpokit.testing import build_tiny_model, build_tiny_model_of_type

ATOL32 = 1e-5
VOCAB = 1024
# Layers that are not all full attention (sliding windows; NemotronH's Mamba): a 4D mask would bypass the window or
# the recurrent state, so these are refused.
REFUSED_TYPES = {"gemma3_text", "gpt_oss", "mistral", "nemotron_h", "olmo3"}


def ragged_batch(prompts=4, group=4, prompt_length=6, completion_length=12, seed=0):
    """Rows repeating `prompts` prompts `group` times, with different left padding per prompt; completions of
    lengths 0 to 12 (right-padded), one with a hole; rows shuffled."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (prompts, prompt_length), generator=generator).repeat_interleave(group, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    for p in range(prompts):  # prompt p has p padding tokens on the left (0 to prompts - 1)
        prompt_mask[p * group : (p + 1) * group, :p] = 0
    completion_ids = torch.randint(3, VOCAB, (prompts * group, completion_length), generator=generator)
    lengths = torch.tensor([12, 1, 0, 7, 12, 2, 5, 1, 9, 0, 12, 3, 4, 11, 6, 12])[: prompts * group]
    completion_mask = (torch.arange(completion_length) < lengths[:, None]).long()
    completion_mask[0, 4:5] = 0  # a hole inside a completion: attended by nothing, as in the padded forward
    order = torch.randperm(prompts * group, generator=generator)
    ids = torch.cat([prompt_ids, completion_ids], 1)[order]
    mask = torch.cat([prompt_mask, completion_mask], 1)[order]
    return ids, mask


def forward(model, ids, mask, width, padding_free, seed=4, **kwargs):
    """(log-probs, entropies, parameter gradients) of a random linear functional of the log-probs."""
    model.zero_grad(set_to_none=True)
    upstream = torch.randn(ids.shape[0], width, generator=torch.Generator().manual_seed(seed))
    if padding_free and kwargs:  # packed rows of another bound than token_logprobs' default
        logprobs, entropies = policy.packed_token_logprobs(model, ids, mask, width, 0.8, with_entropy=True, **kwargs)
    elif padding_free:
        logprobs, entropies = token_logprobs(model, ids, mask, width, 0.8, with_entropy=True, padding_free=True)
    else:
        logprobs, entropies = token_logprobs(
            model, ids, mask, width, 0.8, with_entropy=True, chunked=True, share_prompts=False
        )
    (logprobs * upstream).sum().backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropies, gradients


def assert_packed_equals_padded(model, ids, mask, width, **kwargs):
    padded, packed = forward(model, ids, mask, width, False), forward(model, ids, mask, width, True, **kwargs)
    torch.testing.assert_close(packed[0], padded[0], atol=ATOL32, rtol=0)
    torch.testing.assert_close(packed[1], padded[1], atol=ATOL32, rtol=0)
    padding = ~mask[:, -width:].bool()
    assert (packed[0][padding] == 0).all() and (packed[1][padding] == 0).all()
    assert packed[2].keys() == padded[2].keys() and padded[2]
    for name, gradient in padded[2].items():
        scale = max(1.0, gradient.abs().max().item())
        torch.testing.assert_close(packed[2][name], gradient, atol=ATOL32 * scale, rtol=0, msg=name)
    return packed


def decoder_positions(model, run):
    """Positions (batch x sequence) that the first decoder layer processed during `run()`."""
    positions = []
    layer = policy.decoder_of(policy.causal_lm_of(model)).layers[0]
    handle = layer.register_forward_pre_hook(
        lambda module, args, kwargs: positions.append((args[0] if args else kwargs["hidden_states"]).shape[:2].numel()),
        with_kwargs=True,
    )
    try:
        run()
    finally:
        handle.remove()
    return sum(positions)


# ------------------------------------------------------------------------------------------ the layout


def test_pack_rows_layout_by_hand():
    # Two prompts (one left-padded by 1), three rows: completions of 3, 1 and 2 real tokens (width 3).
    ids = torch.tensor([[0, 5, 6, 10, 11, 12], [7, 8, 9, 20, 0, 0], [0, 5, 6, 30, 31, 0]])
    mask = (ids != 0).long()
    packed = pack_rows(ids, mask, position_ids_from_mask(mask), 3, row_tokens=100)
    # One row: prompt [5 6], its rows 0 (tokens 10 11; 12 predicts nothing) and 2 (30), then prompt [7 8 9] (row
    # 1's only token is predicted by the prompt's end). Longest segment first: [5 6 10 11 30] has 5 tokens.
    assert packed.input_ids.tolist() == [[5, 6, 10, 11, 30, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    allowed = packed.allowed[0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],  # row 2's token sees its prompt and itself, not row 0's tokens
        [0, 0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1],
    ]
    # Real completion tokens (row, column) and the packed position whose hidden state predicts each.
    targets = sorted(zip(packed.rows.tolist(), packed.columns.tolist(), packed.hidden_index.tolist()))
    assert targets == [(0, 0, 1), (0, 1, 2), (0, 2, 3), (1, 0, 7), (2, 0, 1), (2, 1, 4)]


def test_pack_rows_bounds_rows_and_repeats_a_prompt_that_does_not_fit():
    ids, mask = ragged_batch()
    width, real_tokens = ids.shape[1], int(mask.sum())
    for row_tokens in (None, 2 * width, 1000):
        packed = pack_rows(ids, mask, position_ids_from_mask(mask), 12, row_tokens)
        assert packed.input_ids.shape[1] <= max(width - 1, row_tokens or 0)
        assert len(packed.rows) == int(mask[:, -12:].sum())  # every real completion token, once
        assert packed.num_tokens < real_tokens  # prompts shared, last tokens not run
    one_row = pack_rows(ids, mask, position_ids_from_mask(mask), 12, 1000)
    assert one_row.input_ids.shape[0] == 1
    # Four prompts of 6 - p real tokens each once, then every completion but its last token (hole included).
    lengths = torch.tensor([12, 1, 0, 7, 12, 2, 5, 1, 9, 0, 12, 3, 4, 11, 6, 12])
    assert one_row.num_tokens == (6 + 5 + 4 + 3) + int((lengths - 1).clamp(min=0).sum())


def test_pack_rows_edges():
    ids, mask = ragged_batch()
    mask[:, -12:] = 0
    assert pack_rows(ids, mask, position_ids_from_mask(mask), 12) is None  # nothing to predict
    ids, mask = ragged_batch()
    mask[3, :6] = 0
    with pytest.raises(ValueError, match="prompt has no real token"):
        pack_rows(ids, mask, position_ids_from_mask(mask), 12)


# ------------------------------------------------------------------------------------------ packed = padded


@pytest.mark.parametrize("model_type", sorted(policy.CHUNKED_HEAD_MODEL_TYPES))
def test_packed_equals_padded_on_every_architecture_or_is_refused(model_type):
    model = build_tiny_model_of_type(model_type, num_layers=2)
    reason = packing_refusal(model)
    assert (reason is None) == (model_type not in REFUSED_TYPES), reason
    ids, mask = ragged_batch()
    if reason is not None:
        assert "not full attention" in reason
        with pytest.raises(ValueError, match="padding_free=True cannot run here"):
            token_logprobs(model, ids, mask, 12, padding_free=True)
        return
    assert_packed_equals_padded(model, ids, mask, 12)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("row_tokens", [None, 1, 1000])
def test_packed_equals_padded_qwen2_llama(model_type, attn_implementation, row_tokens):
    # row_tokens 1: the narrowest rows (one completion and its prompt per segment where need be); 1000: one row.
    model = build_tiny_model_of_type(model_type, num_layers=2, attn_implementation=attn_implementation)
    assert model.config._attn_implementation == attn_implementation
    ids, mask = ragged_batch()
    assert_packed_equals_padded(model, ids, mask, 12, row_tokens=row_tokens)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_packed_under_gradient_checkpointing(model_type):
    # No KV cache is needed, so packing runs with checkpointing on (where shared prompts cannot), and equals both
    # the padded forward under checkpointing and the packed one without it.
    model = build_tiny_model_of_type(model_type, num_layers=2).train()  # checkpointing acts in training mode
    ids, mask = ragged_batch()
    plain = forward(model, ids, mask, 12, True)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert not policy.can_share_prompts(model) and packing_refusal(model) is None
    recomputed = []
    inner = model.model.layers[0].mlp  # inside the checkpointed forward (the layer's own hooks stay outside it)
    handle = inner.register_forward_pre_hook(lambda *args: recomputed.append(1))
    try:
        checkpointed = assert_packed_equals_padded(model, ids, mask, 12)
    finally:
        handle.remove()
    assert len(recomputed) == 4  # padded and packed, each a forward plus its recomputation in the backward
    torch.testing.assert_close(checkpointed[0], plain[0], atol=ATOL32, rtol=0)
    for name, gradient in plain[2].items():
        torch.testing.assert_close(checkpointed[2][name], gradient, atol=ATOL32, rtol=0, msg=name)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_packed_with_lora(model_type):
    peft = pytest.importorskip("peft")
    base = build_tiny_model_of_type(model_type, num_layers=2)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    assert packing_refusal(model) is None
    ids, mask = ragged_batch()
    packed = assert_packed_equals_padded(model, ids, mask, 12)
    assert packed[2] and all("lora_" in name for name in packed[2])
    with model.disable_adapter(), torch.no_grad():  # the LoRA reference: the adapter-off base, packed too
        padded_ref, _ = token_logprobs(model, ids, mask, 12, chunked=True, share_prompts=False)
        packed_ref, _ = token_logprobs(model, ids, mask, 12, padding_free=True)
    torch.testing.assert_close(packed_ref, padded_ref, atol=ATOL32, rtol=0)


def test_packed_runs_fewer_positions_and_handles_the_edges():
    model = build_tiny_model(VOCAB)
    ids, mask = ragged_batch()
    padded = decoder_positions(model, lambda: forward(model, ids, mask, 12, False))
    packed = decoder_positions(model, lambda: forward(model, ids, mask, 12, True))
    assert padded == ids.numel() and packed < 0.6 * padded, (padded, packed)
    # One-token completions only: the decoder runs the prompts alone.
    ids1, mask1 = ragged_batch(completion_length=1)
    mask1[:, -1] = 1
    assert_packed_equals_padded(model, ids1, mask1, 1)
    # No real completion token at all: zeros, as the padded path gives on padding.
    mask[:, -12:] = 0
    logprobs, entropies = token_logprobs(model, ids, mask, 12, with_entropy=True, padding_free=True)
    assert (logprobs == 0).all() and (entropies == 0).all()


def test_packed_under_no_grad_and_bf16_autocast():
    model = build_tiny_model(VOCAB)
    ids, mask = ragged_batch()
    with torch.no_grad():
        packed, _ = token_logprobs(model, ids, mask, 12, padding_free=True)
        padded, _ = token_logprobs(model, ids, mask, 12, chunked=True, share_prompts=False)
    torch.testing.assert_close(packed, padded, atol=ATOL32, rtol=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packed, _ = token_logprobs(model, ids, mask, 12, padding_free=True)
        padded, _ = token_logprobs(model, ids, mask, 12, chunked=True, share_prompts=False)
    # bf16 matmuls on differently shaped inputs round differently: close, not equal.
    assert (packed - padded).abs().max() < 0.1


# ------------------------------------------------------------------------------------------ refusals


def test_refusals_name_the_reason():
    ids, mask = ragged_batch()
    model = build_tiny_model(VOCAB)
    with pytest.raises(ValueError, match="entropy bonus"):
        token_logprobs(model, ids, mask, 12, with_entropy=True, entropy_grad=True, padding_free=True)
    with pytest.raises(ValueError, match="router logits"):
        token_logprobs(model, ids, mask, 12, router_logits=[], padding_free=True)
    windowed = build_tiny_model(VOCAB)
    windowed.config.layer_types = ["sliding_attention"] * len(windowed.config.layer_types)
    windowed.config.sliding_window = 4
    assert "not full attention" in packing_refusal(windowed)
    flash = build_tiny_model(VOCAB)
    flash.config._attn_implementation = "flex_attention"
    assert "attn_implementation='flex_attention'" in packing_refusal(flash)
    policy_off = build_tiny_model(VOCAB)
    policy_off.config.final_logit_softcapping = 30.0  # no chunked head: no packed forward
    assert "chunked LM head" in packing_refusal(policy_off)


def test_vision_language_models_are_refused():
    from grpokit.testing import build_tiny_qwen_vl

    model, _ = build_tiny_qwen_vl()
    assert "vision-language" in packing_refusal(model)


def test_config_refuses_an_entropy_bonus():
    from grpokit import GRPOConfig

    with pytest.raises(ValueError, match="padding_free=True gives entropies without a gradient"):
        GRPOConfig(padding_free=True, entropy_coef=0.01)
    with pytest.raises(ValueError, match="padding_free=True gives entropies without a gradient"):
        GRPOConfig(padding_free=True, use_adaptive_entropy=True)
    GRPOConfig(padding_free=True)


def test_trainer_refuses_an_moe_aux_loss_and_a_sliding_window(tmp_path):
    from datasets import Dataset

    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer("abcd:")
    dataset = Dataset.from_list([{"prompt": "a:"}] * 4)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=3,
        padding_free=True,
        save_strategy="no",
        report_to="none",
    )
    moe = build_tiny_model_of_type("qwen3_moe", vocab_size=len(tokenizer), router_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01"):
        GRPOTrainer(
            model=moe,
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    windowed = build_tiny_model_of_type("mistral", vocab_size=len(tokenizer))
    with pytest.raises(ValueError, match="cannot run the policy: some layers are not full attention"):
        GRPOTrainer(
            model=windowed,
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )


# ------------------------------------------------------------------------------------------ the trainer


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_training_is_the_same_with_and_without_padding_free(tmp_path, gradient_checkpointing, monkeypatch):
    # A seeded tiny run whose completions end at different lengths (EOS is one of 6 tokens): the final weights,
    # losses and KL of padding_free=True equal those of the padded forward (the same samples: the policies agree
    # to float rounding). SGD, not Adam: Adam divides by the gradient's scale, so on a weight whose gradient is ~0
    # float rounding alone moves its update by up to the learning rate.
    from datasets import Dataset

    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.testing import build_char_tokenizer, save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "model", chars="abcd:", hidden_size=32))
    dataset = Dataset.from_list([{"prompt": f"{c}:" * (1 + i % 3)} for i, c in enumerate("abcd")] * 4)

    def reward(completions, **kwargs):
        return [float(c.count("a")) - 0.1 * len(c) for c in completions]

    packed_calls = []
    original = policy.packed_token_logprobs
    monkeypatch.setattr(policy, "packed_token_logprobs", lambda *a, **k: packed_calls.append(1) or original(*a, **k))
    results = {}
    for padding_free in (False, True):
        args = GRPOConfig(
            output_dir=str(tmp_path / f"out{padding_free}"),
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            num_generations=4,
            max_completion_length=10,
            learning_rate=0.5,
            optim="sgd",
            beta=0.04,
            num_iterations=2,
            temperature=1.0,
            max_steps=3,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            report_to="none",
            gradient_checkpointing=gradient_checkpointing,
            padding_free=padding_free,
        )
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
        assert is_activation_checkpointing(trainer.unwrapped_model) == gradient_checkpointing
        trainer.train()
        # 3 optimizer steps of 2 micro-batches each, and per generation (2) π_ref in 2 parts (π_old is the
        # sampler's own float32 log-probs): every forward is packed.
        assert len(packed_calls) == (0 if not padding_free else 3 * 2 + 2 * 2)
        results[padding_free] = (
            {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()},
            trainer.state.log_history[:-1],
        )
    (padded_weights, padded_log), (packed_weights, packed_log) = results[False], results[True]
    sampled = [entry for entry in padded_log if "completions/min_length" in entry]  # steps that generated
    assert sampled and all(e["completions/min_length"] < e["completions/max_length"] for e in sampled), sampled
    for name, value in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], value, atol=ATOL32, rtol=0, msg=name)
    start = build_tiny_model(len(build_char_tokenizer("abcd:")), hidden_size=32).state_dict()
    moved = max((padded_weights[name] - start[name]).abs().max().item() for name in start)
    assert moved > 100 * ATOL32  # the runs trained: the comparison is not between two untouched models
    for padded, packed in zip(padded_log, packed_log):
        assert packed.get("completions/mean_length") == padded.get("completions/mean_length")
        assert packed["loss"] == pytest.approx(padded["loss"], abs=1e-5)
        assert packed["kl"] == pytest.approx(padded["kl"], abs=1e-6)
