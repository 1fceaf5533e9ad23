"""Keep sampling mask (`grpokit.sampling_mask`): the in-process engine records each token's kept set and the
log-prob of the distribution it drew from; the training forward renormalises π_θ and π_old over the same sets."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from letters import LETTERS, letter_config, letter_dataset, long_tail_letter_model, repeat_letter, tiny_letter_model

from grpokit import GRPOTrainer
from grpokit.batch import TrainBatch
from grpokit.logprobs import token_logprobs
from grpokit.rollout import PromptBatch, SamplingParams
from grpokit.rollout.hf import generate
from grpokit.rollout.vllm import rollout_from_completions
from grpokit.sampling_mask import PADDING, SamplingMask, replayed_token_logprobs
from grpokit.testing import build_char_tokenizer, build_tiny_model
from grpokit.truncation_replay import replayed_sampling_mask

ATOL = 1e-5  # float32: the sampler's forward (KV cache) against the training forward
FILTERS = {
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.7},
    "min_p": {"min_p": 0.3},
    "penalty": {"repetition_penalty": 1.8},
    "suppressed": {"suppress_token_ids": (5, 6)},
    "top_k+top_p+penalty": {"top_k": 8, "top_p": 0.8, "repetition_penalty": 1.4},
    "top_p+min_p+penalty": {"top_p": 0.9, "min_p": 0.1, "repetition_penalty": 0.7},
    "bound": {"top_p": 0.95, "sampling_mask_max_tokens": 4},
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(len(tokenizer), hidden_size=32, num_layers=2, seed=0).eval()


def rollout_of(model, tokenizer, temperature=0.8, seed=1, **filters):
    """Two prompts of different lengths (real left padding), three completions each."""
    prompts = PromptBatch(ids=[tokenizer("1+1=")["input_ids"], tokenizer("ab")["input_ids"]], counts=[3, 3], raw=[0, 1])
    params = SamplingParams(
        max_new_tokens=10,
        temperature=temperature,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        **filters,
    )
    ids, mask = prompts.padded(tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(seed)
    return generate(model, ids, mask, params, generator=generator, num_generations=3), params


def batch_of(rollout) -> TrainBatch:
    return TrainBatch.from_rollout(rollout, torch.zeros(len(rollout)))


def naive_logprobs(model, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """The straightforward computation, position by position: the model's full logits / T, the CTRL penalty on the
    tokens before the position, log-softmax over the kept ids (every token but the suppressed ones for a row of
    PADDING)."""
    mask = batch.sampling_mask
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.input_mask).logits.double()
    prompt_length, width = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    out = torch.zeros(len(batch), width, dtype=torch.float64)
    for row in range(len(batch)):
        for t in range(int(batch.lengths[row])):
            position = prompt_length + t
            scores = logits[row, position - 1] / temperature
            before = {int(v) for v, m in zip(batch.input_ids[row, :position], batch.input_mask[row, :position]) if m}
            for v in before:
                if mask.repetition_penalty != 1.0:
                    s = scores[v]
                    scores[v] = s / mask.repetition_penalty if s > 0 else s * mask.repetition_penalty
            kept = [int(v) for v in mask.kept_ids[row, t] if v >= 0]
            if not kept:
                kept = [v for v in range(len(scores)) if v not in mask.suppressed_ids]
            target = int(batch.completion_ids[row, t])
            out[row, t] = scores[target] - torch.logsumexp(scores[kept], 0)
    return out


def test_replayed_logprobs_by_hand():
    # Row 0 keeps {3, 0} of logits / T = [2, 1, 0, 3] with token 3 seen (penalty 1.5: 3 -> 2); row 1 keeps the
    # whole vocabulary but token 2.
    logits = torch.tensor([[2.0, 1.0, 0.0, 3.0], [2.0, 1.0, 0.0, 3.0]], dtype=torch.float64)
    kept = torch.tensor([[3, 0], [PADDING, PADDING]])
    seen = torch.tensor([[False, False, False, True], [False, False, False, False]])
    out = replayed_token_logprobs(logits, torch.tensor([3, 1]), kept, seen, 1.5, (2,))
    expected = [2.0 - math.log(math.exp(2.0) + math.exp(2.0)), 1.0 - math.log(math.exp(2) + math.exp(1) + math.exp(3))]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(FILTERS))
def test_sampling_logprobs_are_the_training_forward_renormalised_over_the_kept_set(model, tokenizer, name):
    rollout, params = rollout_of(model, tokenizer, **FILTERS[name])
    batch = batch_of(rollout)
    assert rollout.sampling_mask is not None and int(rollout.loss_mask.sum()) >= 12
    kept = rollout.sampling_mask.kept_ids
    if name == "bound":
        assert kept.shape[-1] == 4  # top_p = 0.95 over a flat random model keeps ~all; the bound keeps 4
    # Every sampled token is in its kept set (or the set is the whole vocabulary).
    real = rollout.loss_mask.bool()
    targets = rollout.completion_ids[:, :, None].int()
    assert ((kept == targets).any(-1) | (kept[..., 0] == PADDING))[real].all()
    naive = naive_logprobs(model, batch, params.temperature)
    torch.testing.assert_close(rollout.sampling_logprobs[real].double(), naive[real], rtol=0, atol=ATOL)
    for chunked in (True, False):
        with torch.no_grad():
            logprobs, _ = token_logprobs(
                model, batch.input_ids, batch.input_mask, batch.completion_ids.shape[1], params.temperature,
                chunked=chunked, sampling_mask=batch.sampling_mask,
            )  # fmt: skip
        torch.testing.assert_close(logprobs[real], rollout.sampling_logprobs[real], rtol=0, atol=ATOL)
    # The full vocabulary's log-probs differ by the log of the kept mass: what the mask corrects.
    with torch.no_grad():
        full, _ = token_logprobs(model, batch.input_ids, batch.input_mask, batch.completion_ids.shape[1], 0.8)
    assert (rollout.sampling_logprobs - full)[real].abs().max() > 1e-2


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_chunked_and_packed_replays_have_the_plain_paths_values_and_gradients(tokenizer, padding_free):
    model = build_tiny_model(len(tokenizer), hidden_size=32, num_layers=2, seed=3)
    model.config._attn_implementation = "sdpa"
    rollout, params = rollout_of(model, tokenizer, top_p=0.8, top_k=12, repetition_penalty=1.3)
    batch = batch_of(rollout)

    def run(**options):
        model.zero_grad()
        full = []
        logprobs, entropies = token_logprobs(
            model, batch.input_ids, batch.input_mask, batch.completion_ids.shape[1], params.temperature,
            with_entropy=True, sampling_mask=batch.sampling_mask, full_vocabulary=full, **options,
        )  # fmt: skip
        ((logprobs + 0.5 * full[0]) * batch.loss_mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        return logprobs.detach(), full[0].detach(), entropies, grads

    fast = run(padding_free=True) if padding_free else run(chunked=True)
    plain = run(chunked=False)
    mask = batch.loss_mask.bool()
    for fast_value, plain_value in zip(fast[:3], plain[:3]):
        torch.testing.assert_close(fast_value[mask], plain_value[mask], rtol=0, atol=ATOL)
    for fast_grad, plain_grad in zip(fast[3], plain[3]):
        torch.testing.assert_close(fast_grad, plain_grad, rtol=1e-4, atol=1e-6)


def test_without_the_mask_the_engine_records_the_full_vocabulary_logprobs(model, tokenizer):
    # keep_sampling_mask=False: TRL 1.16's numbers, the policy's log-softmax(logits / T) over the whole vocabulary.
    rollout, _ = rollout_of(model, tokenizer, top_p=0.7, repetition_penalty=1.3, keep_sampling_mask=False)
    assert rollout.sampling_mask is None
    batch = batch_of(rollout)
    with torch.no_grad():
        full, _ = token_logprobs(model, batch.input_ids, batch.input_mask, batch.completion_ids.shape[1], 0.8)
    real = rollout.loss_mask.bool()
    torch.testing.assert_close(rollout.sampling_logprobs[real], full[real], rtol=0, atol=ATOL)


def letter_trainer(tmp_path, **overrides):
    model, tokenizer = tiny_letter_model()
    args = letter_config(tmp_path, num_iterations=2, max_completion_length=6, temperature=0.9, **overrides)
    return GRPOTrainer(
        model=model, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset(), processing_class=tokenizer
    )


@pytest.mark.parametrize("keep", [True, False])
def test_with_truncation_at_staleness_zero_the_importance_ratio_is_one(tmp_path, keep):
    # μ = 2: π_old is the engine's log-probs (float32, exact); the first pass's π_θ is the training forward of the
    # same weights, renormalised over the batch's kept sets. The ratio is 1 with the mask; without it both sides
    # are the full vocabulary's (TRL 1.16's numbers), and the sampling log-probs are the policy's.
    trainer = letter_trainer(tmp_path, top_p=0.8, min_p=0.05, repetition_penalty=1.2, beta=0.1, keep_sampling_mask=keep)
    batch = trainer.generate_batch()
    assert (batch.sampling_mask is not None) == keep
    assert torch.equal(batch.old_logprobs, batch.sampling_logprobs)
    model, mask = trainer.unwrapped_model, batch.loss_mask.bool()
    logprobs, _ = token_logprobs(
        model, batch.input_ids, batch.input_mask, batch.completion_ids.shape[1], 0.9, sampling_mask=batch.sampling_mask
    )
    ratio = torch.exp(logprobs - batch.old_logprobs)[mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=ATOL)
    full, _ = token_logprobs(model, batch.input_ids, batch.input_mask, batch.completion_ids.shape[1], 0.9)
    if keep:  # over the full vocabulary the ratio would carry the kept mass, < 1
        assert torch.exp(full - batch.old_logprobs)[mask].mean() < 0.97
    else:
        torch.testing.assert_close(batch.sampling_logprobs[mask], full.detach()[mask], rtol=0, atol=ATOL)
    # The reference's log-probs (beta > 0) are the full vocabulary's either way.
    with torch.no_grad():
        reference, _ = token_logprobs(model, batch.input_ids, batch.input_mask, batch.completion_ids.shape[1], 0.9)
    torch.testing.assert_close(batch.ref_logprobs[mask], reference[mask], rtol=0, atol=ATOL)


def test_a_truncated_run_trains_and_logs_a_ratio_of_one(tmp_path):
    trainer = letter_trainer(tmp_path, top_p=0.8, max_steps=2, beta=0.1, logging_steps=1)
    trainer.train()
    history = [r for r in trainer.state.log_history if "loss" in r]
    assert len(history) == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["kl"]) for r in history)


def test_the_long_tail_letter_task_holds_its_tail_mass_and_top_p_drops_only_junk(tmp_path):
    # benchmarks/truncated_sampling.py --tail: 500 junk tokens after the 16 real ones hold 0.12 of the first
    # completion token's probability (averaged over the 8 prompts); over the real tokens the model is the letter
    # task's. top_p=0.9 then keeps every real token and some of the junk, and the engine and the training forward
    # both apply the LM head's bias (the ratio is 1).
    model, tokenizer = long_tail_letter_model(500, 0.12, seed=1)
    assert len(tokenizer) == 516 and tokenizer.convert_ids_to_tokens([15, 16, 515]) == ["h", "<w0>", "<w499>"]
    prompts = torch.tensor([tokenizer(f"{c}:")["input_ids"] for c in LETTERS])
    with torch.no_grad():
        probs = model(prompts).logits[:, -1].double().softmax(-1)
        original = tiny_letter_model(seed=1)[0](prompts).logits[:, -1].double().softmax(-1)
    assert probs[:, 16:].sum(-1).mean().item() == pytest.approx(0.12, abs=1e-6)
    real = probs[:, :16] / probs[:, :16].sum(-1, keepdim=True)
    torch.testing.assert_close(real, original, rtol=0, atol=1e-6)
    args = letter_config(tmp_path, num_iterations=2, max_completion_length=2, top_p=0.9)
    trainer = GRPOTrainer(
        model=model, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset(), processing_class=tokenizer
    )
    batch = trainer.generate_batch()
    first = batch.sampling_mask.kept_ids[:, 0]  # [N, K] the first completion token's kept sets
    kept = [set(row[row != PADDING].tolist()) for row in first]
    assert all(set(range(16)) <= ids for ids in kept)
    assert min(len(ids) for ids in kept) > 16 and max(len(ids) for ids in kept) < 200
    logprobs, _ = token_logprobs(
        trainer.unwrapped_model,
        batch.input_ids,
        batch.input_mask,
        batch.completion_ids.shape[1],
        1.0,
        sampling_mask=batch.sampling_mask,
    )
    mask = batch.loss_mask.bool()
    ratio = torch.exp(logprobs - batch.old_logprobs)[mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=ATOL)


@pytest.mark.parametrize("filters", [{"top_p": 0.7}, {"top_k": 4, "repetition_penalty": 1.5}, {"min_p": 0.3}])
def test_the_truncation_replayed_on_the_trainers_logits_finds_the_engines_kept_sets(model, tokenizer, filters):
    # What the trainer does for vLLM where it returns no sampling mask: replay the truncation on π_old's logits.
    # On the weights that sampled, the replayed sets are the engine's (as sets; vLLM's order of min-p and top-p is
    # not exercised here, where at most one of them is set).
    rollout, params = rollout_of(model, tokenizer, **filters)
    batch = batch_of(rollout)
    engine_mask, batch.sampling_mask = batch.sampling_mask, None
    replayed = replayed_sampling_mask(model, batch, params, rows=4, autocast=contextlib.nullcontext)
    real = batch.loss_mask.bool()
    for row, t in real.nonzero().tolist():
        expected = {int(v) for v in engine_mask.kept_ids[row, t] if v >= 0}
        assert {int(v) for v in replayed.kept_ids[row, t] if v >= 0} == expected, (row, t)


def test_kept_sets_returned_by_vllm_become_the_rollouts_sampling_mask():
    prompts = PromptBatch(ids=[[3, 4]], counts=[2], raw=[None])
    params = SamplingParams(max_new_tokens=3, top_k=3, repetition_penalty=1.2, eos_token_ids=(1,))
    completions = [
        ([5, 1], [-0.5, -0.1], "stop", [[5, 6, 7], [1, 5]]),
        ([6, 7, 8], [-0.2, -0.3, -0.4], "length", [[6], [7, 8], [8, 5, 9]]),
    ]
    rollout = rollout_from_completions(prompts, completions, params)
    mask = rollout.sampling_mask
    assert isinstance(mask, SamplingMask) and mask.repetition_penalty == 1.2
    assert mask.kept_ids.tolist() == [
        [[5, 6, 7], [1, 5, -1], [-1, -1, -1]],
        [[6, -1, -1], [7, 8, -1], [8, 5, 9]],
    ]
    # Without kept sets (a server that returned none): no mask, the trainer replays the truncation.
    assert rollout_from_completions(prompts, [c[:3] for c in completions], params).sampling_mask is None


def test_multi_turn_transcripts_carry_each_turns_kept_sets(model, tokenizer):
    # Two turns sampled by the engine with a tool's tokens between them (an OpenAI-style harness's calls, stitched
    # into one transcript): the transcript's rollout holds each sampled token's kept set, whole-vocabulary rows for
    # the inserted tokens, and the training forward over it gives the engine's log-probs.
    from grpokit.agents.loop import transcripts_rollout
    from grpokit.integrations.endpoint import Call, stitch
    from grpokit.rollout import HFEngine

    engine, params = HFEngine(model), rollout_of(model, tokenizer, top_k=6, repetition_penalty=1.3)[1]
    prompt = tokenizer("1+1=")["input_ids"]
    calls, context = [], list(prompt)
    for turn in range(2):
        out = engine.generate(PromptBatch(ids=[context], counts=[1], raw=[None]), params, seed=turn)
        ids = out.completion_id_lists()[0]
        mask = out.sampling_mask
        call = Call(list(context), ids, out.sampling_logprobs[0, : len(ids)].tolist(), 0, False)
        call.kept = [[int(v) for v in row if v >= 0] for row in mask.kept_ids[0, : len(ids)].tolist()]
        call.mask_settings = (mask.repetition_penalty, mask.suppressed_ids)
        calls.append(call)
        context = context + ids + tokenizer("ok")["input_ids"]  # the tool's answer, inserted
    transcript, breaks = stitch(prompt, calls, max_completion_length=64)
    assert breaks == 0 and 0 in transcript.trained
    rollout = transcripts_rollout([transcript], tokenizer.pad_token_id, {})
    kept = rollout.sampling_mask.kept_ids[0]
    trained = torch.tensor(transcript.trained).bool()
    assert (kept[trained, 0] >= 0).all() and (kept[~trained] == PADDING).all()
    batch = batch_of(rollout)
    with torch.no_grad():
        logprobs, _ = token_logprobs(
            model, batch.input_ids, batch.input_mask, batch.completion_ids.shape[1], params.temperature,
            sampling_mask=batch.sampling_mask,
        )  # fmt: skip
    torch.testing.assert_close(logprobs[0, trained], rollout.sampling_logprobs[0, trained], rtol=0, atol=ATOL)
