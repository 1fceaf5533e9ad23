"""The trainer's public seams: a user's rollout engine, completions with tokens that are attended to but not trained
on (a hole in the loss mask), the typed train batch, and the prompt codec."""

import pytest
import torch
from datasets import Dataset
from letters import tiny_letter_model

from grpokit import GRPOConfig, GRPOTrainer, PromptBatch, ScriptedEngine, TrainBatch, group_advantages
from grpokit.rollout import PromptCodec, ScriptedCompletion, eos_token_ids, group_counts

LETTERS = "abcdefgh"


def tiny():
    return tiny_letter_model()


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return GRPOConfig(**{**values, **overrides})


def letters(n=8):
    return Dataset.from_list([{"prompt": f"{c}:", "letter": c} for c in LETTERS[:n]])


# ------------------------------------------------------------------------------------------ a user's engine


def test_a_user_engine_passed_as_rollout_engine_trains(tmp_path):
    """Sample j of every prompt is always the letter LETTERS[j]; the reward prefers the prompt's own letter when it
    is among them. Training through the user's engine must raise the policy's probability of that completion."""
    model, tokenizer = tiny()
    engine = ScriptedEngine(lambda prompt_ids, index: tokenizer(LETTERS[index])["input_ids"] + [tokenizer.eos_token_id])

    def own_letter(completions, letter, **kwargs):
        return [float(c == target) for c, target in zip(completions, letter)]

    def probability_of(letter: str, prompt: str) -> float:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            logits = trainer.unwrapped_model(torch.tensor([ids])).logits[0, -1]
        return logits.softmax(-1)[tokenizer.convert_tokens_to_ids(letter)].item()

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=own_letter,
        args=config(tmp_path, max_steps=6, learning_rate=5e-2),
        train_dataset=letters(4),
        processing_class=tokenizer,
        rollout_engine=engine,
    )
    before = {c: probability_of(c, f"{c}:") for c in "abcd"}
    trainer.train()
    after = {c: probability_of(c, f"{c}:") for c in "abcd"}
    assert all(after[c] > before[c] for c in "abcd") and sum(after.values()) > 2 * sum(before.values()), (before, after)
    # The engine was asked for each prompt once, with G completions, and synced before every generation.
    assert len(engine.calls) == 6 and all(call.counts == [4, 4] for call in engine.calls)
    assert all(isinstance(p, str) and p.endswith(":") for call in engine.calls for p in call.raw)
    assert engine.syncs == 6
    assert trainer.state.log_history[0]["completions/mean_length"] == 2.0  # letter + EOS


def test_an_object_that_is_not_an_engine_is_refused(tmp_path):
    model, tokenizer = tiny()
    with pytest.raises(TypeError, match=r"not a RolloutEngine.*generate"):
        GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config(tmp_path),
            train_dataset=letters(),
            processing_class=tokenizer,
            rollout_engine=object(),
        )


# -------------------------------------------------------------------------------- a hole in the loss mask


HOLE = [True, True, False, False, True, True]  # tokens 3 and 4 were inserted (a tool's output): no loss


def test_a_hole_in_the_loss_mask_is_attended_to_but_not_trained_on(tmp_path):
    """Completions of 6 tokens whose 3rd and 4th were not sampled by the policy. With AdamW's first step at a huge
    epsilon the update is -lr·g/(|g| + eps) exactly, so the trainer's gradient can be read off the weights and
    compared with autograd of the plain computation: a full forward of the whole transcript, log-probs of every
    token, and the DAPO loss over the trained tokens only."""
    model, tokenizer = tiny()
    samples = ["abcdef", "hgfedc"]  # per prompt, sample 0 and sample 1
    ids_of = {s: tokenizer(s)["input_ids"] for s in samples}
    engine = ScriptedEngine(lambda prompt_ids, index: ScriptedCompletion(ids_of[samples[index]], list(HOLE)))
    seen = []

    def first_sample(completions, **kwargs):
        seen.extend(completions)
        return [float(c == samples[0]) for c in completions]

    lr, eps = 1e6, 1e6
    args = config(
        tmp_path,
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        learning_rate=lr,
        adam_epsilon=eps,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        loss_type="dapo",
    )
    data = Dataset.from_list([{"prompt": "a:"}, {"prompt": "b:"}])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=first_sample,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        rollout_engine=engine,
    )
    initial = {k: v.detach().clone() for k, v in trainer.unwrapped_model.named_parameters()}

    # The plain computation, on a copy of the initial weights.
    reference_model, _ = tiny()
    prompts = [tokenizer(p)["input_ids"] for p in ("a:", "b:")]
    rows = [(p, samples[j]) for p in prompts for j in range(2)]
    input_ids = torch.tensor([p + ids_of[s] for p, s in rows])
    loss_mask = torch.tensor([HOLE] * 4, dtype=torch.float32)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2)

    def plain_loss(mask):
        logits = reference_model(input_ids).logits[:, len(prompts[0]) - 1 : -1]
        logprobs = logits.log_softmax(-1).gather(-1, input_ids[:, len(prompts[0]) :, None]).squeeze(-1)
        ratio = torch.exp(logprobs - logprobs.detach())
        return (-(ratio * advantages[:, None]) * mask).sum() / mask.sum()

    def expected_update(mask):
        reference_model.zero_grad()
        plain_loss(mask).backward()
        return {k: -lr * p.grad / (p.grad.abs() + eps) for k, p in reference_model.named_parameters()}

    expected = expected_update(loss_mask)
    trainer.train()
    update = {k: v.detach() - initial[k] for k, v in trainer.unwrapped_model.named_parameters()}

    def relative_error(a, b):  # per tensor, against the size of the expected update (float32 gradients)
        return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in b)

    assert relative_error(update, expected) < 1e-3
    # The test can fail: training on the inserted tokens too would be a different update.
    everything = expected_update(torch.ones_like(loss_mask))
    assert relative_error(everything, expected) > 0.1
    # The inserted tokens stay in the completion: rewards see the whole text, lengths count them.
    assert sorted(set(seen)) == sorted(samples)
    assert trainer.state.log_history[0]["completions/mean_length"] == 6.0


def test_hole_tokens_change_the_logprobs_of_the_tokens_after_them():
    """The inserted tokens are context: the trained tokens after them are scored with them attended to, as in a
    plain forward of the whole transcript, not as if they were absent."""
    from grpokit import token_logprobs

    model, tokenizer = tiny()
    prompt = tokenizer("a:")["input_ids"]
    completion = tokenizer("abcdef")["input_ids"]
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        ours, _ = token_logprobs(model, ids, torch.ones_like(ids), len(completion))
        plain = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        without = torch.tensor([prompt + completion[:2] + completion[4:]])
        skipped, _ = token_logprobs(model, without, torch.ones_like(without), 4)
    torch.testing.assert_close(ours[0], plain, rtol=0, atol=1e-5)
    assert (ours[0, 4:] - skipped[0, 2:]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------- the typed batch


def hand_batch(n=5, width=4):
    lengths = torch.tensor([4, 1, 3, 2, 4])[:n]
    mask = (torch.arange(width) < lengths[:, None]).long()
    return TrainBatch(
        prompt_ids=torch.arange(n * 2).view(n, 2),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        completion_ids=torch.arange(n * width).view(n, width) * mask,
        attention_mask=mask,
        loss_mask=mask.clone(),
        lengths=lengths,
        advantages=torch.arange(n, dtype=torch.float32)[:, None].expand(-1, width).contiguous(),
        old_logprobs=-torch.rand(n, width),
    )


def test_train_batch_splits_permutes_and_trims():
    batch = hand_batch()
    parts = batch.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert torch.equal(parts[1].prompt_ids, batch.prompt_ids[2:4]) and parts[1].ref_logprobs is None
    order = torch.tensor([4, 3, 2, 1, 0])
    assert torch.equal(batch.select(order).old_logprobs, batch.old_logprobs.flip(0))
    trimmed = parts[1].trimmed()  # rows of lengths 3 and 2: one padding column dropped, the prompts untouched
    assert trimmed.completion_ids.shape == (2, 3) and trimmed.old_logprobs.shape == (2, 3)
    assert trimmed.prompt_ids.shape == (2, 2)
    assert torch.equal(trimmed.input_ids, torch.cat([batch.prompt_ids[2:4], batch.completion_ids[2:4, :3]], 1))
    restored = TrainBatch.from_state_dict(batch.state_dict())
    assert all(torch.equal(getattr(restored, k), getattr(batch, k)) for k in ("advantages", "old_logprobs"))


def test_trimming_uses_lengths_not_the_loss_mask():
    batch = hand_batch()
    batch.loss_mask[:, 1:] = 0  # only the first token of each row is trained on
    assert batch.trimmed().completion_ids.shape[1] == 4


# ------------------------------------------------------------------------------------------- prompt codec


def test_prompt_codec_encodes_once_per_prompt_and_decodes(tmp_path):
    model, tokenizer = tiny()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 5]
    codec = PromptCodec(tokenizer, model, max_prompt_length=2)
    assert codec.eos_token_ids == (tokenizer.eos_token_id, 5)  # the union, tokenizer's first
    batch = codec.encode([{"prompt": "ab:"}, {"prompt": "c:"}], [3, 1])
    assert batch.ids == [tokenizer("b:")["input_ids"], tokenizer("c:")["input_ids"]]  # last 2 tokens kept
    ids, mask = batch.padded(codec.pad_token_id)
    assert ids.shape == (4, 2) and mask.all() and batch.rows() == [0, 0, 0, 1]
    assert group_counts(6, 4, 0) == [4, 2] and group_counts(6, 4, 6) == [2, 4] and group_counts(8, 4, 0) == [4, 4]
    with pytest.raises(ValueError, match="empty"):
        PromptBatch(ids=[[]], counts=[1], raw=[""])


def test_eos_ids_are_the_union_of_tokenizer_and_generation_config():
    class Tok:
        eos_token_id = 1

    class Model:
        class generation_config:
            eos_token_id = [7, 1]

    assert eos_token_ids(Tok(), Model()) == (1, 7)
    assert eos_token_ids(None, Model()) == (7, 1)


def test_fields_an_engine_reports_reach_the_reward_functions(tmp_path):
    model, tokenizer = tiny()

    class TaggingEngine(ScriptedEngine):
        def generate(self, prompts, params, seed):
            rollout = super().generate(prompts, params, seed)
            rollout.extra["sample_index"] = [i for count in prompts.counts for i in range(count)]
            return rollout

    engine = TaggingEngine(lambda prompt_ids, index: tokenizer(LETTERS[index])["input_ids"])
    seen = []

    def by_index(completions, **kwargs):  # an engine's fields are not dataset columns: read them from kwargs
        seen.extend(zip(completions, kwargs["sample_index"]))
        return [float(i == 0) for i in kwargs["sample_index"]]

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=by_index,
        args=config(tmp_path, max_steps=1),
        train_dataset=letters(4),
        processing_class=tokenizer,
        rollout_engine=engine,
    )
    trainer.train()
    assert len(seen) == 8 and all(completion == LETTERS[index] for completion, index in seen)
