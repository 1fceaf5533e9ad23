"""The direct decode step (grpokit/rollout/direct.py): bitwise the model's own forward, or not taken at all."""

from __future__ import annotations

import pytest
import torch

from grpokit.rollout import SamplingParams, decoders, direct, fast
from grpokit.rollout.hf import generate
from grpokit.testing import build_tiny_model_of_type

pytestmark = pytest.mark.skipif(not fast._can_pack_linears(), reason="this torch has no oneDNN linear packing")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def prompts(vocab: int = 64):
    ids = torch.randint(3, vocab, (4, 6), generator=seeded(1)).repeat_interleave(3, 0)
    mask = torch.ones_like(ids)
    mask[3:6, :2] = 0  # left padding: the direct step masks it as the model's mask does
    mask[9:12, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def tiny_model(model_type: str, num_layers: int = 2, **overrides):
    """A random-weight model whose norm weights and biases are random too (initialised to 1 and 0 they would hide
    a change in the order of the operations that read them)."""
    model = build_tiny_model_of_type(model_type, num_layers=num_layers, vocab_size=64, **overrides)
    generator = seeded(5)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model


def sample(model, monkeypatch, direct_step: bool, params: SamplingParams, seed: int = 2):
    """A rollout with the direct step on or off, and how many decode steps took it."""
    taken = []
    original = direct.DirectStep.__call__

    def counted(self, *args):
        taken.append(1)
        return original(self, *args)

    monkeypatch.setattr(direct.DirectStep, "__call__", counted)
    monkeypatch.setattr(decoders, "DIRECT_STEP", direct_step)
    ids, mask = prompts(model.config.vocab_size)
    rollout = generate(model, ids, mask, params, generator=seeded(seed), num_generations=3)
    return rollout, len(taken)


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("mistral", {}),
        ("qwen2", {}),
        ("qwen3", {}),
    ],
    ids=["llama", "llama-biases", "mistral", "qwen2", "qwen3"],
)
def test_direct_step_samples_bitwise_what_the_model_forward_samples(model_type, overrides, monkeypatch):
    # Every decode step after the prefill takes the direct step; tokens and sampling log-probs are bitwise those of
    # the model's own forward (same cache, packed layers and one-token attention), through left padding, rows
    # that finish early and are dropped from the batch, and a completion longer than the prompts.
    model = tiny_model(model_type, **overrides)
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(2, 7, 9, 11), pad_token_id=0)
    ours, steps = sample(model, monkeypatch, True, params)
    plain, plain_steps = sample(model, monkeypatch, False, params)
    assert plain_steps == 0 and steps >= params.max_new_tokens - 1 - 3  # rows dropped late still step
    assert bool(ours.is_truncated.any()) and not bool(ours.is_truncated.all())  # some rows finished early
    assert torch.equal(ours.completion_ids, plain.completion_ids)
    assert torch.equal(ours.sampling_logprobs, plain.sampling_logprobs)
    assert torch.equal(ours.lengths, plain.lengths)


def test_direct_step_logits_equal_the_forward_logits_step_by_step():
    # One decoder, the same cache state: the direct step's logits [n, V] against the model forward's, each step.
    model = tiny_model("qwen2", num_layers=3)
    ids, mask = prompts()
    with torch.no_grad(), fast.one_token_attention(model, ids.device), fast.packed_linears(model, ids.device):
        ours, theirs = decoders.CachedDecoder(model, 20), decoders.CachedDecoder(model, 20)
        theirs.use_direct = False
        first, first_plain = ours.prefill(ids, mask), theirs.prefill(ids, mask)
        assert ours.direct is not None and ours.padded and theirs.direct is None
        assert torch.equal(first, first_plain)
        tokens = first.argmax(-1)
        for _ in range(6):
            logits, plain = ours.step(tokens), theirs.step(tokens)
            assert torch.equal(logits, plain)
            tokens = torch.multinomial(plain.softmax(-1), 1, generator=seeded(3)).squeeze(-1)


@pytest.mark.parametrize("change", ["hook", "subclass", "autocast", "eager", "replaced forward", "unpacked"])
def test_direct_step_is_not_taken_where_it_would_not_be_the_forward(change, monkeypatch):
    # Anything the direct step does not reproduce sends the decode through the model's forward: a forward hook on
    # any module, a subclass of the family's class, autocast, another attention, a module whose forward was
    # replaced, linear layers left unpacked. The rollout is then the forward's.
    model = tiny_model("qwen2")
    params = SamplingParams(max_new_tokens=6, pad_token_id=0)
    if change == "hook":
        model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: output * 1.0)
    elif change == "subclass":
        model.__class__ = type("MyQwen2", (type(model),), {})
    elif change == "eager":
        model.config._attn_implementation = "eager"
    elif change == "replaced forward":
        norm = model.model.norm
        norm.forward = type(norm).forward.__get__(norm)
    elif change == "unpacked":
        monkeypatch.setattr(fast, "PACKED_LINEARS_MAX_BYTES", 0)
    if change == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, steps = sample(model, monkeypatch, True, params)
    else:
        ours, steps = sample(model, monkeypatch, True, params)
    assert steps == 0
    assert ours.completion_ids.shape[0] == 12


def test_direct_step_is_not_taken_for_other_families(monkeypatch):
    # gemma scales its embeddings and uses (1 + weight) norms: not a family the direct step reproduces.
    model = tiny_model("gemma")
    _, steps = sample(model, monkeypatch, True, SamplingParams(max_new_tokens=6, pad_token_id=0))
    assert steps == 0
