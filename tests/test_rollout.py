"""Sampling (`grpokit.rollout`): the recorded log-probs, the fast decode paths against the naive loop, EOS
handling, and the sampling distribution on hand-made logits.

Shapes as in rollout.py: N = B·G rows, P prompt tokens (left-padded), T completion tokens (right-padded).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch

from grpokit.logprobs import token_logprobs
from grpokit.rollout import PromptCodec, SamplingParams
from grpokit.rollout.hf import generate, supports_kv_cache
from grpokit.rollout.sampling import apply_repetition_penalty, filter_logits, sample_tokens
from grpokit.testing import build_char_tokenizer, build_tiny_model

LOGPROB_ATOL = 1e-5  # float32: sampling forward (KV cache) vs training forward (one pass)
PLAIN_PROMPTS = ["1+1=", "what is 12+30?", "a"]  # 4, 14 and 1 characters: real left padding
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(len(tokenizer), hidden_size=32, num_layers=2, seed=0).eval()


def params_for(tokenizer, **overrides) -> SamplingParams:
    values = dict(max_new_tokens=12, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
    values.update(overrides)
    return SamplingParams(**values)


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def grouped(prompts, tokenizer, num_generations):
    """Prompt ids/mask [B·G, P], left-padded, as the trainer encodes them (`PromptCodec`): each prompt repeated G
    times, consecutively (the trainer's layout)."""
    batch = PromptCodec(tokenizer, None).encode([{"prompt": p} for p in prompts], [num_generations] * len(prompts))
    return batch.padded(tokenizer.pad_token_id)


def training_logprobs(model, rollout, temperature, chunked=None):
    """The training forward's log-probs of the rollout's tokens, renormalised over its sampling mask where it has one."""
    with torch.no_grad():
        logprobs, _ = token_logprobs(
            model,
            torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
            torch.cat([rollout.prompt_mask, rollout.attention_mask], 1),
            rollout.completion_ids.shape[1],
            temperature,
            chunked=chunked,
            sampling_mask=rollout.sampling_mask,
        )
    return logprobs


# ------------------------------------------------------------------------- sampling log-probs = training forward


def test_chat_template_renders_conversations_left_padded(tokenizer):
    ids, mask = grouped(CONVERSATIONS, tokenizer, 1)
    texts = tokenizer.batch_decode([row[m.bool()] for row, m in zip(ids, mask)])
    assert texts == [
        "<|user|>hi<|end|><|assistant|>",
        "<|system|>be brief<|end|><|user|>what is 2+2?<|end|><|assistant|>",
    ]
    # The longer conversation fills the width; the shorter one is padded on the left only.
    assert mask[1].all() and mask[0].tolist() == sorted(mask[0].tolist())
    assert int(mask[0].sum()) == 1 + 2 + 1 + 1  # <|user|> h i <|end|> <|assistant|>


@pytest.mark.parametrize("prompts", [PLAIN_PROMPTS, CONVERSATIONS], ids=["plain", "conversational"])
@pytest.mark.parametrize(
    "temperature, filters",
    [(1.0, {}), (0.7, {}), (0.7, {"top_k": 8, "top_p": 0.9, "repetition_penalty": 1.3})],
    ids=["T1", "T0.7", "T0.7-filtered"],
)
def test_sampling_logprobs_equal_training_forward(model, tokenizer, prompts, temperature, filters):
    ids, mask = grouped(prompts, tokenizer, 2)
    params = params_for(tokenizer, temperature=temperature, **filters)
    rollout = generate(model, ids, mask, params, generator=seeded(1), num_generations=2)
    completion_mask = rollout.attention_mask.bool()
    assert completion_mask.sum() >= 2 * len(prompts)  # something was sampled for every row

    # With filters the engine records each token's kept set, and the training forward renormalises over it.
    assert (rollout.sampling_mask is not None) == bool(filters)
    expected = training_logprobs(model, rollout, temperature)
    diff = (rollout.sampling_logprobs - expected).abs()[completion_mask]
    assert diff.max() <= LOGPROB_ATOL, f"max |sampling - training| log-prob = {diff.max():.2e}"
    assert (rollout.sampling_logprobs[completion_mask] < 0).all()
    assert (rollout.sampling_logprobs[~completion_mask] == 0).all()


def test_temperature_changes_the_recorded_logprobs(model, tokenizer):
    """Guards the test above: a training forward at the wrong temperature must not match."""
    ids, mask = grouped(PLAIN_PROMPTS, tokenizer, 1)
    rollout = generate(model, ids, mask, params_for(tokenizer, temperature=0.7), generator=seeded(1))
    wrong = training_logprobs(model, rollout, 1.0)
    completion_mask = rollout.attention_mask.bool()
    assert (rollout.sampling_logprobs - wrong).abs()[completion_mask].max() > 1e-2


# ------------------------------------------------------------------------------- fast paths = the naive loop


FAST_PATH_PARAMS = {
    "plain": {},
    "filtered": {"temperature": 0.8, "top_k": 20, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.3},
}


@pytest.mark.parametrize("sampling", list(FAST_PATH_PARAMS), ids=list(FAST_PATH_PARAMS))
def test_fast_paths_match_the_naive_loop(model, tokenizer, sampling):
    num_generations, max_new_tokens = 4, 12
    ids, mask = grouped(PLAIN_PROMPTS, tokenizer, num_generations)
    params = params_for(tokenizer, max_new_tokens=max_new_tokens, **FAST_PATH_PARAMS[sampling])

    def run(use_cache, share_prefix, drop_finished):
        return generate(
            model,
            ids,
            mask,
            params,
            generator=seeded(0),
            num_generations=num_generations,
            use_cache=use_cache,
            share_prefix=share_prefix,
            drop_finished=drop_finished,
        )

    naive = run(use_cache=False, share_prefix=False, drop_finished=False)
    # The compaction path only runs when at least a quarter of the rows finish before the last step, and it only
    # matters when others keep running.
    lengths = naive.lengths
    assert int((lengths < max_new_tokens).sum()) >= len(lengths) / 4, lengths.tolist()
    assert naive.is_truncated.any(), lengths.tolist()
    assert naive.completion_ids.shape[1] == max_new_tokens

    for use_cache, share_prefix, drop_finished in itertools.product([False, True], repeat=3):
        fast = run(use_cache, share_prefix, drop_finished)
        label = f"use_cache={use_cache} share_prefix={share_prefix} drop_finished={drop_finished}"
        assert torch.equal(fast.completion_ids, naive.completion_ids), label
        assert torch.equal(fast.attention_mask, naive.attention_mask), label
        assert torch.equal(fast.is_truncated, naive.is_truncated), label
        assert (fast.sampling_logprobs - naive.sampling_logprobs).abs().max() <= LOGPROB_ATOL, label


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])
def test_lora_model_samples_with_the_kv_cache(tokenizer, task_type, monkeypatch):
    """A LoRA PeftModel's forward names no past_key_values; sampling must still take the KV-cached decoder (not
    re-run the whole sequence every step), with the tokens and log-probs of the no-cache loop (float rounding)."""
    peft = pytest.importorskip("peft")
    from grpokit.rollout import hf

    base = build_tiny_model(len(tokenizer), hidden_size=32, num_layers=2, seed=0)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type=task_type)
    model = peft.get_peft_model(base, config).eval()
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: make the adapter do something
            torch.nn.init.normal_(param, std=0.5)
    ids, mask = grouped(PLAIN_PROMPTS, tokenizer, 4)
    params = params_for(tokenizer, max_new_tokens=8)
    naive = generate(model, ids, mask, params, generator=seeded(0), num_generations=4, use_cache=False)
    with model.disable_adapter():
        no_adapter = generate(model, ids, mask, params, generator=seeded(0), num_generations=4, use_cache=False)
    assert not torch.equal(no_adapter.completion_ids, naive.completion_ids)  # the adapter is in the samples

    steps = []
    monkeypatch.setattr(
        hf.CachedDecoder, "step", lambda self, tokens, _s=hf.CachedDecoder.step: steps.append(1) or _s(self, tokens)
    )
    fast = generate(model, ids, mask, params, generator=seeded(0), num_generations=4)
    assert steps, "a LoRA model sampled without its KV cache"
    assert torch.equal(fast.completion_ids, naive.completion_ids)
    assert torch.equal(fast.attention_mask, naive.attention_mask)
    assert (fast.sampling_logprobs - naive.sampling_logprobs).abs().max() <= LOGPROB_ATOL


def weight_casts(fn) -> int:
    """How many tensor copies with a dtype change (aten::_to_copy) fn runs."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if event.key == "aten::_to_copy")


def test_frozen_weights_are_cast_once_per_rollout_under_autocast(tokenizer):
    """A LoRA base loaded in float32 is frozen: autocast would cast its weights to bf16 again at every decode step.
    The engine keeps one cast per rollout: the same tokens and log-probs bit for bit, fewer casts, and the
    parameters' requires_grad flags as they were."""
    peft = pytest.importorskip("peft")
    from grpokit.rollout import HFEngine
    from grpokit.rollout.hf import autocast_keeps_frozen_casts

    base = build_tiny_model(len(tokenizer), hidden_size=32, num_layers=2, seed=0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    assert not all(flags.values()) and any(flags.values())
    ids, mask = grouped(PLAIN_PROMPTS, tokenizer, 4)
    params = params_for(tokenizer, max_new_tokens=8)

    def sample(keep_casts: bool):
        with (
            torch.autocast("cpu", dtype=torch.bfloat16),
            autocast_keeps_frozen_casts(model) if keep_casts else contextlib.nullcontext(),
        ):
            return generate(model, ids, mask, params, generator=seeded(0), num_generations=4)

    naive, fast = sample(False), sample(True)
    assert torch.equal(fast.completion_ids, naive.completion_ids)
    assert torch.equal(fast.sampling_logprobs, naive.sampling_logprobs)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    naive_casts, fast_casts = weight_casts(lambda: sample(False)), weight_casts(lambda: sample(True))
    frozen_linears = 2 * 7  # per decode step, each frozen projection weight was cast anew
    assert naive_casts - fast_casts >= frozen_linears * (params.max_new_tokens - 2), (naive_casts, fast_casts)

    engine = HFEngine(model, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    prompts = PromptCodec(tokenizer, None).encode([{"prompt": p} for p in PLAIN_PROMPTS], [4] * 3)
    engine_casts = weight_casts(lambda: engine.generate(prompts, params, seed=0))
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    with pytest.raises(RuntimeError), autocast_keeps_frozen_casts(model):  # restored on errors too
        raise RuntimeError
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert engine_casts < naive_casts


# ------------------------------------------------------------------------------------------------- EOS


def test_eos_masks_and_pads_after_the_first_eos(model, tokenizer):
    """With EOS the completion is the no-EOS completion (same seed) cut after its first EOS token."""
    num_generations, max_new_tokens, pad = 4, 12, 5  # a pad id no prompt uses, so padding is visible
    eos_ids = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("e"))  # two EOS ids
    ids, mask = grouped(PLAIN_PROMPTS, tokenizer, num_generations)

    def run(eos, max_tokens=max_new_tokens):
        params = params_for(tokenizer, max_new_tokens=max_tokens, eos_token_ids=eos, pad_token_id=pad)
        return generate(model, ids, mask, params, generator=seeded(3), num_generations=num_generations)

    free = run(eos=())  # never stops early
    assert free.completion_ids.shape[1] == max_new_tokens
    assert free.attention_mask.all() and free.is_truncated.all()

    rollout = run(eos=eos_ids)
    expected_lengths, expected_truncated = [], []
    for row in free.completion_ids.tolist():
        hits = [t for t, token in enumerate(row) if token in eos_ids]
        expected_lengths.append(hits[0] + 1 if hits else max_new_tokens)
        expected_truncated.append(not hits)
    assert min(expected_lengths) < max_new_tokens and any(expected_truncated)

    width = max(expected_lengths)
    assert rollout.completion_ids.shape == (len(ids), width)
    assert rollout.is_truncated.tolist() == expected_truncated
    for row, length in enumerate(expected_lengths):
        assert rollout.attention_mask[row].tolist() == [1] * length + [0] * (width - length), row
        assert rollout.completion_ids[row, :length].tolist() == free.completion_ids[row, :length].tolist(), row
        assert (rollout.completion_ids[row, length:] == pad).all(), row
        assert (rollout.sampling_logprobs[row, length:] == 0).all(), row

    # EOS exactly on the last allowed token: the row is complete (not truncated) and keeps its full length.
    row = next(r for r, length in enumerate(expected_lengths) if length > 1 and not expected_truncated[r])
    last = expected_lengths[row]
    cut = run(eos=eos_ids, max_tokens=last)
    assert cut.completion_ids.shape[1] <= last
    assert cut.lengths[row] == last and not cut.is_truncated[row]
    assert cut.completion_ids[row].tolist() == rollout.completion_ids[row, :last].tolist()


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_max_new_tokens_is_respected(model, tokenizer, max_new_tokens):
    ids, mask = grouped(PLAIN_PROMPTS, tokenizer, 2)
    params = params_for(tokenizer, max_new_tokens=max_new_tokens, eos_token_ids=())
    rollout = generate(model, ids, mask, params, generator=seeded(0), num_generations=2)
    assert rollout.completion_ids.shape == (len(ids), max_new_tokens)
    assert rollout.lengths.tolist() == [max_new_tokens] * len(ids)
    assert rollout.is_truncated.all()


# ------------------------------------------------------------------------------- the sampling distribution

# Probabilities [0.5, 0.3, 0.15, 0.05] as logits.
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])


def kept(scores: torch.Tensor) -> list[int]:
    return torch.isfinite(scores[0]).nonzero().squeeze(-1).tolist()


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.4, [0]),
        (0.5, [0]),
        (0.6, [0, 1]),
        (0.8, [0, 1]),
        (0.81, [0, 1, 2]),
        (0.96, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, expected):
    assert kept(filter_logits(LOGITS, SamplingParams(1, top_p=top_p))) == expected


def test_top_p_on_unsorted_logits():
    # The same probabilities in another order: the kept set follows the tokens, not the positions.
    order = [2, 0, 3, 1]  # token i has probability PROBS[order[i]]
    logits = torch.tensor([[math.log(PROBS[i]) for i in order]])
    assert kept(filter_logits(logits, SamplingParams(1, top_p=0.8))) == [1, 3]
    assert kept(filter_logits(logits, SamplingParams(1, top_p=0.81))) == [0, 1, 3]


@pytest.mark.parametrize(
    "top_k, expected", [(1, [0]), (2, [0, 1]), (3, [0, 1, 2]), (4, [0, 1, 2, 3]), (None, [0, 1, 2, 3])]
)
def test_top_k_keeps_the_k_best(top_k, expected):
    assert kept(filter_logits(LOGITS, SamplingParams(1, top_k=top_k))) == expected


@pytest.mark.parametrize("min_p, expected", [(0.05, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.59, [0, 1]), (0.61, [0])])
def test_min_p_drops_tokens_below_min_p_times_the_best(min_p, expected):
    # Thresholds: 0.025, 0.1, 0.295 and 0.305 against probabilities 0.5, 0.3, 0.15, 0.05.
    assert kept(filter_logits(LOGITS, SamplingParams(1, min_p=min_p))) == expected


def test_filter_logits_divides_by_temperature():
    scores = filter_logits(torch.tensor([[2.0, -1.0, 0.5]]), SamplingParams(1, temperature=0.5))
    assert scores.tolist() == [[4.0, -2.0, 1.0]]


def test_min_p_applies_after_temperature():
    # At T = 2 the probabilities are ∝ sqrt(p): 0.7071, 0.5477, 0.3873, 0.2236 (sum 1.8657), so the best is 0.379
    # and min_p = 0.5 keeps tokens above 0.190: the first three (0.294, 0.208) but not 0.120.
    assert kept(filter_logits(LOGITS, SamplingParams(1, temperature=2.0, min_p=0.5))) == [0, 1, 2]
    assert kept(filter_logits(LOGITS, SamplingParams(1, temperature=1.0, min_p=0.5))) == [0, 1]


def test_repetition_penalty_on_hand_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 0.0]])
    seen = torch.tensor([[True, True, False, False, True]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, -0.5, 0.0]]


def test_inverse_cdf_picks_tokens_by_uniform():
    # CDF of PROBS: 0.5, 0.8, 0.95, 1.0.
    uniforms = torch.tensor([0.0, 0.1, 0.49, 0.51, 0.79, 0.81, 0.94, 0.96, 0.999])
    tokens, logprobs, _ = sample_tokens(LOGITS.expand(len(uniforms), -1), uniforms, SamplingParams(1))
    assert tokens.tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 3]
    expected = torch.tensor([math.log(PROBS[t]) for t in tokens.tolist()])
    assert torch.allclose(logprobs, expected, atol=1e-6)


def test_filtered_tokens_are_never_drawn_even_at_the_edges():
    # top_k = 1 keeps only token 2; uniforms at both ends of [0, 1) must still land on it.
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    uniforms = torch.tensor([0.0, 1e-9, 0.5, 1 - 2**-24])
    tokens, _, _ = sample_tokens(logits.expand(4, -1), uniforms, SamplingParams(1, top_k=1))
    assert tokens.tolist() == [2, 2, 2, 2]


def test_without_the_sampling_mask_the_sampled_logprob_is_the_policy_not_the_filtered_distribution():
    logits = torch.tensor([[1.0, 0.5, -0.3, 2.0]])
    temperature = 0.7
    params = SamplingParams(1, temperature=temperature, top_k=2, repetition_penalty=1.5, keep_sampling_mask=False)
    seen = torch.tensor([[False, False, False, True]])
    uniforms = torch.tensor([0.0, 0.99])
    tokens, logprobs, _ = sample_tokens(logits.expand(2, -1), uniforms, params, seen.expand(2, -1))
    # After the penalty token 3's logit is 2/1.5 = 1.333, still one of the top 2 (with token 0): both are drawn.
    assert tokens.tolist() == [0, 3]
    scaled = [v / temperature for v in logits[0].tolist()]
    log_total = math.log(sum(math.exp(v) for v in scaled))
    expected = [scaled[t] - log_total for t in tokens.tolist()]  # unfiltered, unpenalised softmax(logits / T)
    assert torch.allclose(logprobs, torch.tensor(expected), atol=1e-6)


def test_with_the_sampling_mask_the_sampled_logprob_is_the_filtered_distribution():
    # The same draw as above: the kept set is {0, 3} (token 3 penalised to 2 / 1.5), and the log-probs are the
    # softmax over those two of the penalised logits / T, by hand.
    logits = torch.tensor([[1.0, 0.5, -0.3, 2.0]])
    params = SamplingParams(1, temperature=0.7, top_k=2, repetition_penalty=1.5)
    seen = torch.tensor([[False, False, False, True]])
    tokens, logprobs, kept = sample_tokens(logits.expand(2, -1), torch.tensor([0.0, 0.99]), params, seen.expand(2, -1))
    assert tokens.tolist() == [0, 3]
    assert kept.tolist() == [[3, 0], [3, 0]]  # most likely first: 2 / 1.5 / 0.7 = 1.905 > 1 / 0.7 = 1.429
    scaled = {0: 1.0 / 0.7, 3: 2.0 / 1.5 / 0.7}
    log_total = math.log(math.exp(scaled[0]) + math.exp(scaled[3]))
    expected = [scaled[0] - log_total, scaled[3] - log_total]
    assert torch.allclose(logprobs, torch.tensor(expected), atol=1e-6)


def test_the_kept_set_is_bounded_by_sampling_mask_max_tokens():
    # top_p = 0.99 on a flat distribution keeps almost every token; the bound makes it an implicit top-3 (exactly 3
    # even with ties at the third), and only those 3 are ever drawn.
    logits = torch.zeros(1, 10).expand(200, -1)
    params = SamplingParams(1, top_p=0.99, sampling_mask_max_tokens=3)
    tokens, logprobs, kept = sample_tokens(logits, torch.rand(200, generator=seeded(5)), params)
    assert kept.shape == (200, 3) and set(tokens.tolist()) <= set(kept[0].tolist())
    assert (kept == kept[:1]).all()
    torch.testing.assert_close(logprobs, torch.full((200,), -math.log(3)), atol=1e-6, rtol=0)
    # Without the mask the same parameters keep all 10 (TRL's sampling) and report the policy's log-prob.
    tokens, logprobs, kept = sample_tokens(
        logits,
        torch.rand(200, generator=seeded(5)),
        SamplingParams(1, top_p=0.99, sampling_mask_max_tokens=3, keep_sampling_mask=False),
    )
    assert kept is None and len(set(tokens.tolist())) > 3
    torch.testing.assert_close(logprobs, torch.full((200,), -math.log(10)), atol=1e-6, rtol=0)


def softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


@pytest.mark.parametrize("top_k", [None, 2, 3])
def test_empirical_frequencies_match_softmax(top_k):
    logits = [1.0, 0.5, -0.3, 2.0, 0.0, -1.5]
    temperature, draws = 0.7, 20_000
    scaled = [v / temperature for v in logits]
    best = sorted(range(len(logits)), key=lambda i: -logits[i])[: top_k or len(logits)]
    restricted = softmax([scaled[i] for i in best])
    expected = [0.0] * len(logits)
    for i, p in zip(best, restricted):
        expected[i] = p

    uniforms = torch.rand(draws, generator=seeded(1234))
    params = SamplingParams(1, temperature=temperature, top_k=top_k, keep_sampling_mask=False)
    tokens, logprobs, _ = sample_tokens(torch.tensor([logits]).expand(draws, -1), uniforms, params)
    counts = torch.bincount(tokens, minlength=len(logits)).tolist()
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0:
            assert count == 0, f"token {token} is filtered out by top_k={top_k} but was drawn {count} times"
            continue
        sigma = math.sqrt(p * (1 - p) / draws)
        assert abs(count / draws - p) <= 5 * sigma, (token, count / draws, p)
    policy = [math.log(p) for p in softmax(scaled)]
    assert torch.allclose(logprobs, torch.tensor(policy)[tokens], atol=1e-5)


# ------------------------------------------------------------------------------------ a plain nn.Module


class TinyGRULM(torch.nn.Module):
    """Not a transformers model: forward(input_ids) -> logits [B, T, V], no attention mask, no KV cache."""

    def __init__(self, vocab_size: int = 11, hidden: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, hidden)
        self.gru = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab_size)

    def forward(self, input_ids):
        states, _ = self.gru(self.embed(input_ids))
        return self.head(states)


def naive_sample(model, ids, params, generator):
    """The straightforward loop: full forward each step, CTRL penalty on every token so far, inverse CDF on
    softmax(scores / T), no early exit. Log-probs are those of that distribution (keep_sampling_mask), or the
    unpenalised policy's without it."""
    completion, logprobs = [], []
    for _ in range(params.max_new_tokens):
        uniforms = torch.rand(len(ids), generator=generator)
        logits = model(ids)[:, -1]
        seen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)
        penalty = params.repetition_penalty
        scores = torch.where(seen & (logits > 0), logits / penalty, logits)
        scores = torch.where(seen & (logits <= 0), logits * penalty, scores)
        cdf = (scores / params.temperature).softmax(-1).cumsum(-1)
        tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
        completion.append(tokens)
        recorded = scores if params.keep_sampling_mask else logits
        logprobs.append((recorded / params.temperature).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))
        ids = torch.cat([ids, tokens[:, None]], 1)
    return torch.stack(completion, 1), torch.stack(logprobs, 1)


@pytest.mark.parametrize("keep_sampling_mask", [True, False])
@pytest.mark.parametrize("repetition_penalty", [1.0, 3.0])
def test_plain_module_generates_through_the_full_forward_path(repetition_penalty, keep_sampling_mask):
    torch.manual_seed(0)
    model = TinyGRULM().eval()
    assert not supports_kv_cache(model)
    prompt_ids = torch.tensor([[3, 4, 5], [3, 4, 5], [7, 8, 2], [7, 8, 2]])  # 2 prompts x G = 2, equal lengths
    prompt_mask = torch.ones_like(prompt_ids)
    params = SamplingParams(
        max_new_tokens=10,
        temperature=0.9,
        repetition_penalty=repetition_penalty,
        eos_token_ids=(1,),
        pad_token_id=0,
        keep_sampling_mask=keep_sampling_mask,
    )

    rollout = generate(model, prompt_ids, prompt_mask, params, generator=seeded(7), num_generations=2)
    with torch.no_grad():
        naive_ids, naive_logprobs = naive_sample(model, prompt_ids, params, seeded(7))
    lengths = rollout.lengths.tolist()
    assert max(lengths) >= 5  # the comparison below covers several steps
    for row, length in enumerate(lengths):
        expected = naive_ids[row].tolist()
        first_eos = expected.index(1) + 1 if 1 in expected else params.max_new_tokens
        assert length == first_eos, row
        assert rollout.completion_ids[row, :length].tolist() == expected[:length], row
        assert torch.allclose(rollout.sampling_logprobs[row, :length], naive_logprobs[row, :length], atol=LOGPROB_ATOL)
    # The training forward of a plain module gives the same log-probs (the penalty replayed from the sequence).
    assert (rollout.sampling_mask is not None) == (keep_sampling_mask and repetition_penalty != 1.0)
    expected = training_logprobs(model, rollout, params.temperature)
    mask = rollout.attention_mask.bool()
    assert (rollout.sampling_logprobs - expected).abs()[mask].max() <= LOGPROB_ATOL


def test_plain_module_rejects_ragged_prompts():
    model = TinyGRULM().eval()
    prompt_ids = torch.tensor([[0, 4, 5], [3, 4, 5]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="equal"):
        generate(model, prompt_ids, prompt_mask, SamplingParams(max_new_tokens=2), generator=seeded(0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_unfiltered_sampling_matches_the_general_path(temperature):
    # The fast path (one exp pass, unnormalised CDF) against the general one (softmax, then log_softmax) on logits
    # wide enough that some tokens underflow to probability zero, with uniforms at both ends of [0, 1).
    from grpokit.rollout.sampling import _sample_filtered, _sample_unfiltered, is_filtered

    params = SamplingParams(1, temperature=temperature)
    assert not is_filtered(params) and is_filtered(SamplingParams(1, top_p=0.9))
    generator = seeded(3)
    logits = torch.randn(512, 1000, generator=generator) * 40
    uniforms = torch.rand(512, generator=generator)
    uniforms[:2] = torch.tensor([0.0, 1 - 2**-24])
    tokens, logprobs = _sample_unfiltered(logits, uniforms, temperature)
    expected_tokens, expected_logprobs, _ = _sample_filtered(logits, uniforms, params)
    assert tokens.tolist() == expected_tokens.tolist()
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)
    assert (logits / temperature).softmax(-1).gather(-1, tokens[:, None]).min() > 0


def test_unfiltered_sampling_never_draws_an_underflowed_token_at_the_edge():
    # Tokens 2 and 3 have probability exp(-1000) = 0 in float32; u -> 1 must still land on token 1.
    logits = torch.tensor([[0.0, 0.0, -1000.0, -1000.0]]).expand(3, -1)
    uniforms = torch.tensor([0.0, 0.75, 1 - 2**-24])
    tokens, logprobs, _ = sample_tokens(logits, uniforms, SamplingParams(1))
    assert tokens.tolist() == [0, 1, 1]
    torch.testing.assert_close(logprobs, torch.full((3,), -math.log(2)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("drop_finished", [False, True])
def test_all_done_keeps_stepping_until_every_process_is_done(model, tokenizer, drop_finished):
    # Under FSDP2 every forward is a collective: a process whose rows have all finished keeps stepping (one row,
    # masked out) until all_done says every process is done. Here "the other process" finishes at step 11: the
    # model is called exactly 11 times (prefill + 10 steps), and the completions are those of the plain loop.
    ids, mask = grouped(["ab", "ba"], tokenizer, 2)
    # An eighth of the vocabulary ends a completion, so that ours finish within a few steps.
    params = params_for(tokenizer, max_new_tokens=24, eos_token_ids=tuple(range(len(tokenizer) // 8)))
    plain = generate(model, ids, mask, params, generator=seeded(4), num_generations=2)
    assert int(plain.lengths.max()) < 11, plain.lengths.tolist()  # ours finish first
    calls, asked = [], []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))

    def all_done(done: bool) -> bool:  # the collective, with another process still running until step 11
        asked.append(done)
        return done and len(asked) >= 11

    try:
        synced = generate(
            model,
            ids,
            mask,
            params,
            generator=seeded(4),
            num_generations=2,
            all_done=all_done,
            drop_finished=drop_finished,
        )
    finally:
        handle.remove()
    assert len(calls) == 11 and len(asked) == 11
    assert asked[-1] and not asked[0]
    assert torch.equal(synced.completion_ids, plain.completion_ids)
    assert torch.equal(synced.attention_mask, plain.attention_mask)
    assert (synced.sampling_logprobs - plain.sampling_logprobs).abs().max() <= LOGPROB_ATOL


def test_preallocated_cache_layer_holds_what_concatenation_would():
    # The rollout's cache writes into buffers instead of concatenating; through prefill, steps, repeats, row
    # selection and a sequence longer than its capacity, it holds exactly what transformers' DynamicLayer holds.
    from transformers.cache_utils import DynamicLayer

    from grpokit.rollout.fast import preallocated_layer_class

    generator = torch.Generator().manual_seed(0)
    ours, reference = preallocated_layer_class()(capacity=6), DynamicLayer()

    def update(batch, length):
        keys, values = torch.randn(2, batch, 2, length, 4, generator=generator)
        got, want = ours.update(keys, values), reference.update(keys, values)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert ours.get_seq_length() == reference.get_seq_length()

    update(2, 3)  # prefill of 2 prompts
    ours.batch_repeat_interleave(3)
    reference.batch_repeat_interleave(3)
    update(6, 1)
    rows = torch.tensor([0, 2, 5])
    ours.batch_select_indices(rows)
    reference.batch_select_indices(rows)
    for _ in range(5):  # past the capacity of 6 positions: the buffers grow
        update(3, 1)
    assert ours.get_seq_length() == 9 and ours._keys.shape[2] >= 9


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma", "gpt2", "llama", "mistral", "qwen2", "qwen3_moe"])
def test_one_token_attention_samples_what_sdpa_samples(model_type, monkeypatch):
    # Sampling on CPU swaps SDPA for two matmuls on one-token queries (grouped heads packed, masks applied): the
    # same tokens and log-probs (float32), on architectures with GQA, MLA (value size != query size), sliding
    # windows and MoE; and the model's attention setting is back to SDPA afterwards. (The direct decode step,
    # which computes this attention itself, is off: tests/test_rollout_direct.py checks it against this path.)
    from grpokit.rollout import decoders
    from grpokit.rollout import fast as rollout

    monkeypatch.setattr(decoders, "DIRECT_STEP", False)
    from grpokit.testing import build_tiny_model_of_type

    window = {"sliding_window": 4} if model_type == "mistral" else {}
    model = build_tiny_model_of_type(model_type, num_layers=2, vocab_size=64, **window)
    ids = torch.randint(3, 64, (3, 5), generator=seeded(1)).repeat_interleave(2, 0)
    mask = torch.ones_like(ids)
    mask[:2, :2] = 0  # left padding: the mask reaches the one-token path
    params = SamplingParams(max_new_tokens=8, eos_token_ids=(2,), pad_token_id=0)
    calls = []
    original = rollout.one_token_attention_forward
    rollout.one_token_attention_forward = lambda *a, **k: calls.append(a[1].shape[2]) or original(*a, **k)
    try:
        rollout._register_one_token_attention.cache_clear()
        fast = generate(model, ids, mask, params, generator=seeded(2), num_generations=2)
    finally:
        rollout.one_token_attention_forward = original
        rollout._register_one_token_attention.cache_clear()
    assert model.config._attn_implementation == "sdpa"
    assert 1 in calls  # the decode steps went through it
    plain = generate(model, ids, mask, params, generator=seeded(2), num_generations=2, use_cache=False)
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    assert (fast.sampling_logprobs - plain.sampling_logprobs).abs().max() <= LOGPROB_ATOL


@pytest.mark.parametrize("model_type", ["deepseek_v3", "llama", "qwen2", "qwen3_moe"])
def test_packed_linears_sample_what_the_plain_layers_sample(model_type, monkeypatch):
    # Sampling on CPU in float32 runs the model's nn.Linear layers through oneDNN with weights packed per rollout:
    # every plain linear layer takes it, the tokens are the same and the log-probs equal to float rounding; the
    # layers have their own forward back afterwards.
    from grpokit.rollout import fast
    from grpokit.testing import build_tiny_model_of_type

    if not fast._can_pack_linears():
        pytest.skip("this torch has no oneDNN linear packing")
    model = build_tiny_model_of_type(model_type, num_layers=2, vocab_size=64)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    ids = torch.randint(3, 64, (3, 5), generator=seeded(1)).repeat_interleave(2, 0)
    mask = torch.ones_like(ids)
    mask[:2, :2] = 0
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(2,), pad_token_id=0)
    packed_calls = []
    original = fast._packed_linear_forward
    monkeypatch.setattr(fast, "_packed_linear_forward", lambda *a: packed_calls.append(a[0]) or original(*a))
    packed = generate(model, ids, mask, params, generator=seeded(2), num_generations=2)
    assert {id(layer) for layer in packed_calls} == {id(layer) for layer in linears}
    assert not any("forward" in layer.__dict__ for layer in linears)
    monkeypatch.setattr(fast, "PACKED_LINEARS_MAX_BYTES", 0)
    packed_calls.clear()
    plain = generate(model, ids, mask, params, generator=seeded(2), num_generations=2)
    assert packed_calls == []
    assert torch.equal(packed.completion_ids, plain.completion_ids)
    assert not torch.equal(packed.sampling_logprobs, plain.sampling_logprobs)  # another kernel: float rounding
    assert (packed.sampling_logprobs - plain.sampling_logprobs).abs().max() <= LOGPROB_ATOL


def test_packed_linears_pack_only_plain_float32_layers_outside_autocast(monkeypatch):
    from grpokit.rollout import fast

    if not fast._can_pack_linears():
        pytest.skip("this torch has no oneDNN linear packing")

    class Subclass(torch.nn.Linear):  # a quantized or adapter layer computes otherwise
        pass

    cpu = torch.device("cpu")
    plain, sub, half, hooked = (
        torch.nn.Linear(8, 4),
        Subclass(8, 4),
        torch.nn.Linear(8, 4).bfloat16(),
        torch.nn.Linear(8, 4),
    )
    hooked.forward = hooked.forward  # replaced on the instance (accelerate's hooks): left to it
    model = torch.nn.Sequential(plain, torch.nn.ReLU(), sub, half, hooked)
    assert fast.packable_linears(model, cpu) == [plain]
    assert fast.packable_linears(model, torch.device("meta")) == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast.packable_linears(model, cpu) == []
    monkeypatch.setattr(fast, "PACKED_LINEARS_MAX_BYTES", 8 * 4 * 4 - 1)  # the layer's weight is 128 bytes
    assert fast.packable_linears(model, cpu) == []
    monkeypatch.setattr(fast, "PACKED_LINEARS_MAX_BYTES", 8 * 4 * 4)
    x = torch.randn(5, 8, generator=seeded(0))
    expected = torch.nn.functional.linear(x, plain.weight, plain.bias)
    with fast.packed_linears(model, cpu):
        assert "forward" in plain.__dict__ and "forward" not in sub.__dict__
        with torch.no_grad():
            torch.testing.assert_close(plain(x), expected, atol=1e-6, rtol=0)
        with torch.enable_grad():  # a forward that records a graph: the layer's own computation, bitwise
            assert torch.equal(plain(x), expected) and plain(x).requires_grad
    assert "forward" not in plain.__dict__ and hooked.__dict__["forward"] is not None


@pytest.mark.parametrize("one_token", [True, False], ids=["one-token", "sdpa"])
@pytest.mark.parametrize("model_type", ["deepseek_v3", "gemma", "llama", "qwen2"])
def test_sampling_cache_under_autocast_keeps_the_autocast_dtype_and_samples_the_same(
    model_type, one_token, monkeypatch
):
    # float32 weights under bf16 autocast make float32 keys (RoPE's float32 cos/sin promote the projection's bf16),
    # which SDPA (and the one-token path's matmuls) round to bf16 at each decode step. The cache holds them in bf16:
    # bitwise the same tokens and log-probs as float32 buffers, with a third less memory.
    from grpokit.rollout import decoders, fast, hf
    from grpokit.testing import build_tiny_model_of_type

    model = build_tiny_model_of_type(model_type, num_layers=2, vocab_size=64)
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.randint(3, 64, (3, 5), generator=seeded(1)).repeat_interleave(2, 0)
    mask = torch.ones_like(ids)
    mask[:2, :2] = 0
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(2,), pad_token_id=0)
    if not one_token:
        monkeypatch.setattr(hf, "one_token_attention", lambda model, device, static=False: contextlib.nullcontext())
    caches = []
    original = decoders.sampling_cache
    monkeypatch.setattr(decoders, "sampling_cache", lambda *a: caches.append(original(*a)) or caches[-1])

    def sample():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return generate(model, ids, mask, params, generator=seeded(2), num_generations=2)

    def buffers(cache):
        layers = [layer for layer in cache.layers if getattr(layer, "_keys", None) is not None]
        assert layers
        return {(layer._keys.dtype, layer._values.dtype) for layer in layers}, sum(
            layer._keys.nbytes + layer._values.nbytes for layer in layers
        )

    compact = sample()
    monkeypatch.setattr(fast, "CASTING_ATTENTION", frozenset())
    wide = sample()
    (compact_dtypes, compact_bytes), (wide_dtypes, wide_bytes) = buffers(caches[0]), buffers(caches[1])
    assert compact_dtypes == {(torch.bfloat16, torch.bfloat16)}
    assert all(keys == torch.float32 for keys, _ in wide_dtypes)  # float32 keys (values too with MLA's padding)
    assert compact_bytes < wide_bytes
    assert torch.equal(compact.completion_ids, wide.completion_ids)
    assert torch.equal(compact.sampling_logprobs, wide.sampling_logprobs)
    assert torch.equal(compact.lengths, wide.lengths)


def test_sampling_cache_keeps_float32_without_autocast():
    from grpokit.rollout.fast import preallocated_layer_class

    layer = preallocated_layer_class()(capacity=4, store_in_autocast_dtype=True)
    keys, values = torch.randn(2, 1, 2, 3, 4, generator=seeded(0))
    got_keys, got_values = layer.update(keys, values)
    assert layer._keys.dtype == torch.float32 and torch.equal(got_keys, keys) and torch.equal(got_values, values)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        other = preallocated_layer_class()(capacity=4, store_in_autocast_dtype=True)
        other.update(keys.double(), values.double())  # float64: autocast leaves it alone, so does the cache
    assert other._keys.dtype == torch.float64
