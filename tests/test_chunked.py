"""The chunked LM head against its naive twin: log-probs, entropies and gradients, then `token_logprobs` on real
(tiny) models through both paths, LoRA included, and what the chunked path keeps in memory.

The naive twin is the computation the fast path replaces: logits = (hidden @ weight.T + bias) / temperature over the
whole batch, `log_softmax(...).gather(...)` and the entropy of that softmax, differentiated by autograd.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import grpokit.logprobs as policy
from grpokit.logprobs import chunked_token_logprobs, supports_chunked_head, token_logprobs
from grpokit.testing import build_tiny_model, build_tiny_model_of_type

ATOL32 = 1e-5


def naive_token_logprobs(hidden, weight, targets, temperature=1.0, bias=None):
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    logits = logits / temperature
    log_softmax = logits.log_softmax(-1)
    logprobs = log_softmax.gather(-1, targets[..., None]).squeeze(-1)
    entropies = -(log_softmax.exp() * log_softmax).sum(-1)
    return logprobs, entropies


def make_inputs(n=3, t=13, h=16, v=101, bias=True, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, h, generator=generator, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=generator, dtype=dtype) / h**0.5).requires_grad_()
    bias_ = torch.randn(v, generator=generator, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(v, (n, t), generator=generator)
    upstream = torch.randn(n, t, generator=generator, dtype=dtype)  # a random linear functional of the log-probs
    return hidden, weight, bias_, targets, upstream


def grads(loss, tensors):
    return torch.autograd.grad(loss, [x for x in tensors if x is not None and x.requires_grad])


# ------------------------------------------------------------------------------------------ the function


# N·T = 39 rows: chunks of 1, 7 (does not divide 39), 16, 39 (one chunk) and the default.
@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 39, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_naive(chunk_rows, temperature, with_bias):
    hidden, weight, bias, targets, upstream = make_inputs(bias=with_bias)
    logprobs, entropies = chunked_token_logprobs(
        hidden, weight, targets, temperature, bias=bias, chunk_rows=chunk_rows, with_entropy=True
    )
    expected_logprobs, expected_entropies = naive_token_logprobs(hidden, weight, targets, temperature, bias)
    assert logprobs.dtype == entropies.dtype == torch.float32 and logprobs.shape == targets.shape
    torch.testing.assert_close(logprobs, expected_logprobs, atol=ATOL32, rtol=0)
    torch.testing.assert_close(entropies, expected_entropies.detach(), atol=ATOL32, rtol=0)
    assert not entropies.requires_grad  # a metric: an entropy bonus takes the plain path

    for actual, expected in zip(
        grads((logprobs * upstream).sum(), (hidden, weight, bias)),
        grads((expected_logprobs * upstream).sum(), (hidden, weight, bias)),
    ):
        torch.testing.assert_close(actual, expected, atol=ATOL32, rtol=0)


@pytest.mark.parametrize("frozen_head", [False, True])
def test_float64_gradcheck(frozen_head):
    hidden, weight, bias, targets, _ = make_inputs(n=2, t=5, h=4, v=11, dtype=torch.float64)
    weight.requires_grad_(not frozen_head)
    bias.requires_grad_(not frozen_head)
    assert torch.autograd.gradcheck(
        lambda h, w, b: chunked_token_logprobs(h, w, targets, 0.8, bias=b, chunk_rows=3)[0], (hidden, weight, bias)
    )


def test_without_entropy_and_under_no_grad():
    hidden, weight, bias, targets, _ = make_inputs()
    expected, _ = naive_token_logprobs(hidden, weight, targets, 1.3, bias)
    with torch.no_grad():
        logprobs, entropies = chunked_token_logprobs(hidden, weight, targets, 1.3, bias=bias, chunk_rows=5)
    assert entropies is None and not logprobs.requires_grad
    torch.testing.assert_close(logprobs, expected.detach(), atol=ATOL32, rtol=0)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("trainable", ["hidden", "weight", "bias"])
def test_only_the_inputs_that_need_grad_get_one(trainable, with_entropy):
    # A frozen (or tied and frozen) LM head under LoRA — the backward without recomputed logits —, or a frozen
    # decoder: needs_input_grad is respected.
    hidden, weight, bias, targets, upstream = make_inputs()
    for name, tensor in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        tensor.requires_grad_(name == trainable)
    logprobs, _ = chunked_token_logprobs(
        hidden, weight, targets, 0.9, bias=bias, chunk_rows=8, with_entropy=with_entropy
    )
    (logprobs * upstream).sum().backward()
    tensors = {"hidden": hidden, "weight": weight, "bias": bias}
    for name, tensor in tensors.items():
        assert (tensor.grad is not None) == (name == trainable), name
    detached = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}
    expected_logprobs, _ = naive_token_logprobs(detached["hidden"], detached["weight"], targets, 0.9, detached["bias"])
    (expected_logprobs * upstream).sum().backward()
    torch.testing.assert_close(tensors[trainable].grad, detached[trainable].grad, atol=ATOL32, rtol=0)


def test_bf16_autocast_matches_the_plain_head_under_autocast():
    # Under autocast the chunk matmul runs in bf16 like nn.Linear's, the softmax in float32.
    hidden, weight, _, targets, upstream = make_inputs(h=64, v=300, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _entropies = chunked_token_logprobs(hidden, weight, targets, chunk_rows=7, with_entropy=True)
        plain_logits = torch.nn.functional.linear(hidden, weight)
    assert plain_logits.dtype == torch.bfloat16 and logprobs.dtype == torch.float32
    expected = plain_logits.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected, atol=2e-2, rtol=0)
    hidden_grad, weight_grad = grads((logprobs * upstream).sum(), (hidden, weight))
    expected_hidden_grad, expected_weight_grad = grads((expected * upstream).sum(), (hidden, weight))
    assert hidden_grad.dtype == hidden.dtype and weight_grad.dtype == weight.dtype
    torch.testing.assert_close(hidden_grad, expected_hidden_grad, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(weight_grad, expected_weight_grad, atol=5e-2, rtol=5e-2)


def peak_live_bytes(fn) -> int:
    """The most bytes torch's CPU allocator held at once during fn(), above what it held before (the profiler's
    allocation events, summed in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_a_bf16_heads_weight_gradient_is_added_by_blocks_bitwise_without_a_whole_product(monkeypatch):
    # Under bf16 autocast each chunk's [V, H] bf16 product is added into the float32 gradient: whole, it costs the
    # product and the float32 copy torch makes to add it (1.5x a float32 head at the backward's peak); by blocks of
    # vocabulary rows (`add_weight_grad`), neither, and the gradient is the same to the bit.
    import grpokit.head_autograd as head_autograd
    import grpokit.logprobs

    v, h = 16_384, 128
    hidden, weight, _, targets, upstream = make_inputs(n=2, t=128, h=h, v=v, bias=False)
    weight.data /= 4
    monkeypatch.setattr(head_autograd, "WEIGHT_GRAD_BLOCK_ELEMENTS", 2**16)  # 32 blocks

    def backward():
        weight.grad = hidden.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logprobs, _ = chunked_token_logprobs(hidden, weight, targets, chunk_rows=128)
        loss = (logprobs * upstream).sum()
        return peak_live_bytes(loss.backward), weight.grad.clone(), hidden.grad.clone()

    blocks_peak, grad, hidden_grad = backward()
    with monkeypatch.context() as patch:  # the formula before the blocks: the whole product, then its float32 copy
        patch.setattr(grpokit.logprobs, "add_weight_grad", lambda gw, gl, hc: gw.add_((gl.t() @ hc).to(gw.dtype)))
        whole_peak, whole_grad, whole_hidden_grad = backward()
    assert torch.equal(grad, whole_grad) and torch.equal(hidden_grad, whole_hidden_grad)
    float32_head = v * h * 4
    assert blocks_peak <= whole_peak - 1.25 * float32_head, (whole_peak, blocks_peak)


class SavedTensorSizes(torch.autograd.graph.saved_tensors_hooks):
    """Records the number of elements of every tensor autograd saves for the backward (parameters aside: saving
    one costs no memory)."""

    def __init__(self):
        self.sizes: list[int] = []

        def pack(tensor):
            if not isinstance(tensor, torch.nn.Parameter):
                self.sizes.append(tensor.numel())
            return tensor

        super().__init__(pack, lambda tensor: tensor)

    def __enter__(self):
        super().__enter__()
        return self


def test_no_saved_tensor_spans_the_logits_32k_vocabulary():
    n, t, h, v = 64, 64, 8, 32_000  # N·T = 4,096 rows: the [N, T, V] logits would be 131M floats (500 MiB)
    hidden, weight, _, targets, upstream = make_inputs(n=n, t=t, h=h, v=v, bias=False)
    with SavedTensorSizes() as saved:
        logprobs, _ = chunked_token_logprobs(hidden, weight, targets, with_entropy=True)
    assert saved.sizes and max(saved.sizes) < n * t * v // 100, saved.sizes
    (logprobs * upstream).sum().backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


# ------------------------------------------------------------------------------------------ token_logprobs

VOCAB = 1024  # large enough that the logits outsize every decoder activation of these tiny models


def batch(n=6, length=14, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, as prompts have
    mask[n - 1, :1] = 0
    return ids, mask


def both_paths(model, ids, mask, width, temperature=0.8, seed=2, **kwargs):
    """Log-probs, entropies and parameter gradients of a random linear functional, per path."""
    upstream = torch.randn(ids.shape[0], width, generator=torch.Generator().manual_seed(seed))
    results = {}
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        with SavedTensorSizes() as saved:
            logprobs, entropies = token_logprobs(
                model, ids, mask, width, temperature, with_entropy=True, chunked=chunked, **kwargs
            )
        if logprobs.requires_grad:
            (logprobs * upstream).sum().backward()
        gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[chunked] = logprobs.detach(), entropies, gradients, max(saved.sizes, default=0)
    return results


def assert_paths_agree(results, ids, width):
    (plain_lp, plain_ent, plain_grads, plain_saved), (lp, ent, grads_, saved) = results[False], results[True]
    torch.testing.assert_close(lp, plain_lp, atol=ATOL32, rtol=0)
    torch.testing.assert_close(ent, plain_ent, atol=ATOL32, rtol=0)
    assert grads_.keys() == plain_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(grads_[name], plain_grads[name], atol=ATOL32, rtol=0, msg=name)
    # The paths did differ: the plain one saved a tensor as large as the logits, the chunked one did not.
    if plain_grads:
        assert plain_saved >= ids.shape[0] * width * VOCAB > saved


@pytest.mark.parametrize("tied", [True, False])
def test_token_logprobs_chunked_equals_plain_on_qwen2(tied):
    model = build_tiny_model(VOCAB, tie_word_embeddings=tied)
    assert supports_chunked_head(model)
    ids, mask = batch()
    results = both_paths(model, ids, mask, width=5)
    assert_paths_agree(results, ids, 5)
    assert ("lm_head.weight" in results[True][2]) == (not tied)


def test_token_logprobs_picks_the_chunked_path_by_default(monkeypatch):
    model = build_tiny_model(VOCAB)
    ids, mask = batch()
    calls = []
    original = policy.chunked_token_logprobs
    monkeypatch.setattr(policy, "chunked_token_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
    token_logprobs(model, ids, mask, 4, with_entropy=True)
    assert calls == [1]
    monkeypatch.setattr(policy, "USE_CHUNKED_HEAD", False)
    assert not supports_chunked_head(model)
    token_logprobs(model, ids, mask, 4, with_entropy=True)
    assert calls == [1]


def test_entropy_bonus_takes_the_plain_path():
    model = build_tiny_model(VOCAB)
    ids, mask = batch()
    _, entropies = token_logprobs(model, ids, mask, 4, with_entropy=True, entropy_grad=True)
    assert entropies.requires_grad  # the plain path's entropy, with its graph
    with pytest.raises(ValueError, match="entropy bonus"):
        token_logprobs(model, ids, mask, 4, with_entropy=True, entropy_grad=True, chunked=True)


def test_lora_model_and_its_disabled_adapter():
    peft = pytest.importorskip("peft")
    base = build_tiny_model(VOCAB, tie_word_embeddings=False)
    # Random B (not the zero init) so that the adapter changes the outputs and disabling it is visible.
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    assert supports_chunked_head(model)
    ids, mask = batch()
    results = both_paths(model, ids, mask, width=5)
    assert_paths_agree(results, ids, 5)
    assert results[True][2] and all("lora_" in name for name in results[True][2])
    with model.disable_adapter(), torch.no_grad():
        disabled = both_paths(model, ids, mask, width=5)
    assert_paths_agree(disabled, ids, 5)
    assert not torch.allclose(disabled[True][0], results[True][0], atol=1e-3)
    # get_peft_model injected the LoRA layers into `base`: its own forward is the adapted model's.
    with torch.no_grad():
        base_logprobs, _ = token_logprobs(base, ids, mask, 5, 0.8, chunked=False)
    torch.testing.assert_close(base_logprobs, results[True][0], atol=ATOL32, rtol=0)


def test_lora_on_the_lm_head_falls_back_to_the_plain_path():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        build_tiny_model(VOCAB, tie_word_embeddings=False), peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"])
    )
    assert not supports_chunked_head(model)


def test_heads_the_chunked_path_must_not_take():
    class LogitsOnly(torch.nn.Module):  # any module whose forward returns logits
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 8)
            self.head = torch.nn.Linear(8, VOCAB)

        def forward(self, input_ids):
            return self.head(self.embed(input_ids))

    assert not supports_chunked_head(LogitsOnly())
    ids, mask = batch()
    logprobs, _ = token_logprobs(LogitsOnly(), ids, torch.ones_like(mask), 4)
    assert logprobs.shape == (6, 4)

    capped = build_tiny_model(VOCAB)
    capped.config.final_logit_softcapping = 30.0  # Gemma 2's tanh soft-capping after the head
    assert not supports_chunked_head(capped)
    scaled = build_tiny_model(VOCAB)
    scaled.config.logits_scaling = 8.0  # Granite divides the logits by it
    assert not supports_chunked_head(scaled)
    scaled = build_tiny_model(VOCAB)
    scaled.logit_scale = torch.nn.Parameter(torch.tensor(0.5))  # Cohere multiplies by the model's logit_scale
    assert not supports_chunked_head(scaled)
    unscaled = build_tiny_model(VOCAB)
    unscaled.config.logits_scaling = 1.0
    assert supports_chunked_head(unscaled)

    class ScaledHead(torch.nn.Linear):  # e.g. a quantised Linear subclass
        pass

    custom = build_tiny_model(VOCAB, tie_word_embeddings=False)
    custom.lm_head = ScaledHead(custom.config.hidden_size, VOCAB, bias=False)
    assert not supports_chunked_head(custom)


# One tiny model per architecture in the allow-list: the chunked path equals the model's own logits.
@pytest.mark.parametrize("model_type", sorted(policy.CHUNKED_HEAD_MODEL_TYPES))
def test_every_allowed_architecture_matches_its_plain_head(model_type):
    model = build_tiny_model_of_type(model_type)
    assert supports_chunked_head(model)
    ids, mask = batch(n=4, length=10)
    assert_paths_agree(both_paths(model, ids, mask, width=6), ids, 6)


# ------------------------------------------------------------------------------------------ the trainer


def test_one_training_step_is_the_same_through_either_head(tmp_path, monkeypatch):
    from datasets import Dataset

    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.testing import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "model", chars="abcd:", hidden_size=32))
    dataset = Dataset.from_list([{"prompt": f"{c}:"} for c in "abcd"] * 4)

    def reward(completions, **kwargs):
        return [float(c.count("a")) for c in completions]

    calls = []
    original = policy.chunked_token_logprobs
    monkeypatch.setattr(policy, "chunked_token_logprobs", lambda *a, **k: calls.append(1) or original(*a, **k))
    weights = {}
    for chunked in (False, True):
        monkeypatch.setattr(policy, "USE_CHUNKED_HEAD", chunked)
        args = GRPOConfig(
            output_dir=str(tmp_path / f"out{chunked}"),
            per_device_train_batch_size=16,
            num_generations=4,
            max_completion_length=6,
            learning_rate=1e-2,
            beta=0.04,
            temperature=0.9,
            max_steps=2,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            report_to="none",
        )
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset)
        trainer.train()
        weights[chunked] = {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}
        weights[chunked, "log"] = trainer.state.log_history[:-1]
        # Per step: the reference forward and the policy's forward (plus nothing else: μ = 1, float32).
        assert len(calls) == (4 if chunked else 0)
    for name, value in weights[False].items():
        torch.testing.assert_close(weights[True][name], value, atol=ATOL32, rtol=0, msg=name)
    for plain, chunked_ in zip(weights[False, "log"], weights[True, "log"]):
        assert chunked_["entropy"] == pytest.approx(plain["entropy"], abs=1e-5)
        assert chunked_["kl"] == pytest.approx(plain["kl"], abs=1e-6)


# ------------------------------------------------------------------------------------------ shared prompts


def grouped_batch(prompts=3, group=3, prompt_length=7, completion_length=6, seed=3):
    """Rows that repeat prompts (one left-padded), completions ragged (one ends early), rows shuffled."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (prompts, prompt_length), generator=generator).repeat_interleave(group, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[:group, :3] = 0
    completion_ids = torch.randint(3, VOCAB, (prompts * group, completion_length), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 2:] = 0
    order = torch.randperm(prompts * group, generator=generator)
    return torch.cat([prompt_ids, completion_ids], 1)[order], torch.cat([prompt_mask, completion_mask], 1)[order]


def shared_and_full(model, ids, mask, width, monkeypatch):
    """(log-probs, entropies, gradients) with and without shared prompts; asserts which path ran."""
    shared_runs = []
    original = policy.shared_prompt_hidden
    monkeypatch.setattr(policy, "shared_prompt_hidden", lambda *a, **k: shared_runs.append(1) or original(*a, **k))
    upstream = torch.randn(ids.shape[0], width, generator=torch.Generator().manual_seed(4))
    results = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logprobs, entropies = token_logprobs(
            model, ids, mask, width, 0.8, with_entropy=True, chunked=True, share_prompts=share
        )
        (logprobs * upstream * mask[:, -width:]).sum().backward()
        results[share] = (
            logprobs.detach(),
            entropies,
            {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None},
        )
    assert shared_runs == [1]
    return results


def assert_same_where_real(results, mask, width):
    real = mask[:, -width:].bool()
    (lp, ent, grads_), (shared_lp, shared_ent, shared_grads) = results[False], results[True]
    torch.testing.assert_close(shared_lp[real], lp[real], atol=ATOL32, rtol=0)
    torch.testing.assert_close(shared_ent[real], ent[real], atol=ATOL32, rtol=0)
    assert shared_grads.keys() == grads_.keys() and grads_
    for name in grads_:  # float32 rounding, relative to the gradient's scale (some reach ~30 here)
        scale = max(1.0, grads_[name].abs().max().item())
        torch.testing.assert_close(shared_grads[name], grads_[name], atol=ATOL32 * scale, rtol=0, msg=name)


# Sliding-window attention in some layers by default (or Mamba layers, NemotronH): the prompt is never shared.
UNSHARED_TYPES = {"gemma3_text", "gpt_oss", "mistral", "nemotron_h", "olmo3"}


@pytest.mark.parametrize("model_type", sorted(policy.CHUNKED_HEAD_MODEL_TYPES))
def test_shared_prompts_give_the_full_forward_on_every_allowed_architecture(model_type, monkeypatch):
    # Each distinct prompt through the decoder once, its cache indexed out to its rows, the completions run
    # against it: the same log-probs, entropies and parameter gradients as one forward over the whole rows.
    model = build_tiny_model_of_type(model_type, num_layers=2)
    assert policy.can_share_prompts(model) == (model_type not in UNSHARED_TYPES)
    if model_type in UNSHARED_TYPES:
        return
    ids, mask = grouped_batch()
    assert_same_where_real(shared_and_full(model, ids, mask, 6, monkeypatch), mask, 6)


def test_shared_prompts_with_lora_and_a_one_token_completion(monkeypatch):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        build_tiny_model(VOCAB, tie_word_embeddings=False),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    ids, mask = grouped_batch(completion_length=1)
    results = shared_and_full(model, ids, mask, 1, monkeypatch)
    assert_same_where_real(results, mask, 1)
    assert all("lora_" in name for name in results[True][2])


def test_prompts_are_shared_only_where_it_pays_and_the_cache_is_exact():
    model = build_tiny_model(VOCAB)
    ids, mask = batch()  # six distinct prompts: nothing to share
    position_ids = policy.position_ids_from_mask(mask)
    assert policy.shared_prompt_hidden(model.model, ids, mask, position_ids, 5) is None
    ids, mask = grouped_batch()  # three prompts for nine rows
    assert policy.shared_prompt_hidden(model.model, ids, mask, policy.position_ids_from_mask(mask), 6) is not None
    mask[:, -6:] = 0  # no real completion token: the plain forward takes the edge
    assert policy.shared_prompt_hidden(model.model, ids, mask, policy.position_ids_from_mask(mask), 6) is None
    model.gradient_checkpointing_enable()  # transformers turns the cache off under checkpointing
    assert not policy.can_share_prompts(model)
    windowed = build_tiny_model(VOCAB)
    windowed.config.layer_types = ["sliding_attention"] * len(windowed.config.layer_types)
    windowed.config.sliding_window = 4  # a sliding layer's cache needs its window
    assert not policy.can_share_prompts(windowed)


def ragged_batch(prompts=4, group=4, prompt_length=5, completion_length=12, seed=5):
    """Grouped, shuffled rows whose completions end anywhere from 0 to 12 tokens (right-padded)."""
    ids, mask = grouped_batch(prompts, group, prompt_length, completion_length, seed)
    lengths = torch.tensor([12, 11, 3, 0, 7, 12, 1, 5, 9, 2, 12, 6, 4, 10, 8, 12])[: prompts * group]
    mask[:, prompt_length:] = (torch.arange(completion_length) < lengths[:, None]).long()
    return ids, mask


def test_completions_run_in_length_groups_and_the_head_only_on_real_tokens(monkeypatch):
    # Completions of lengths 0..12 run in groups of similar length against their prompt's shared cache: fewer
    # token positions than one padded forward, the same values (0 on padding) and the same gradients.
    model = build_tiny_model(VOCAB)
    ids, mask = ragged_batch()
    width = 12
    lengths = mask[:, -width:].sum(-1)
    groups = policy.length_groups(lengths)
    assert 2 <= len(groups) <= policy.LENGTH_GROUPS
    assert sorted(torch.cat(groups).tolist()) == list(range(len(ids)))
    for longer, shorter in itertools.pairwise(groups):
        assert lengths[shorter].max() <= lengths[longer].min()
    positions = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: positions.append((args[0] if args else kwargs["hidden_states"]).shape[:2].numel()),
        with_kwargs=True,
    )
    try:
        results = shared_and_full(model, ids, mask, width, monkeypatch)
    finally:
        handle.remove()
    full, shared = positions[0], sum(positions[1:])
    assert full == ids.numel() and shared < 0.75 * full, positions
    assert_same_where_real(results, mask, width)
    padding = ~mask[:, -width:].bool()
    assert (results[True][0][padding] == 0).all() and (results[True][1][padding] == 0).all()


def test_the_full_path_runs_the_head_only_on_real_tokens():
    model = build_tiny_model(VOCAB)
    ids, mask = batch()  # distinct prompts: no sharing
    mask[2, -3:] = 0
    with torch.no_grad():
        logprobs, entropies = token_logprobs(model, ids, mask, 5, with_entropy=True)
        plain, plain_entropies = token_logprobs(model, ids, mask, 5, with_entropy=True, chunked=False)
    real = mask[:, -5:].bool()
    torch.testing.assert_close(logprobs[real], plain[real], atol=ATOL32, rtol=0)
    torch.testing.assert_close(entropies[real], plain_entropies[real], atol=ATOL32, rtol=0)
    assert (logprobs[~real] == 0).all() and (entropies[~real] == 0).all()
