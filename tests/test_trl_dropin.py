"""What a TRL 1.16 / HF Trainer script relies on beyond the math: the final summary record, TrainerCallbacks with
TrainerControl, optimizers=, IterableDataset, named eval sets and eval_loss, the reward kwargs trainer_state /
log_metric / log_extra, and optimizer steps that straddle two generation batches."""

import itertools
import json
import logging
import math
import os
import signal
import threading
from importlib.resources import files

import pytest
import torch
from datasets import Dataset, IterableDataset
from letters import tiny_letter_model
from transformers import TrainerCallback, TrainerState

from grpokit import GRPOConfig, GRPOTrainer, TrainBatch

LETTERS = "abcdefgh"


def tiny():
    return tiny_letter_model()


def letters(copies=2):
    return Dataset.from_list([{"prompt": f"{c}:", "letter": c} for c in LETTERS] * copies)


def repeat_letter(completions, letter, **kwargs):
    return [1.0 if c[:1] == target else 0.0 for c, target in zip(completions, letter)]


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=3,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        report_to="none",
    )
    return GRPOConfig(**{**values, **overrides})


def trainer_for(tmp_path, **kwargs):
    model, tokenizer = tiny()
    args = kwargs.pop("args", None) or config(tmp_path)
    reward_funcs = kwargs.pop("reward_funcs", repeat_letter)
    train_dataset = kwargs.pop("train_dataset", None) or letters()
    return GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        **kwargs,
    )


# -------------------------------------------------------------------------------------- the summary record


def test_train_appends_the_hf_summary_record_and_returns_train_output(tmp_path):
    trainer = trainer_for(tmp_path)
    output = trainer.train()
    summary = trainer.state.log_history[-1]
    assert set(summary) == {
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "total_flos",
        "train_loss",
        "epoch",
        "step",
    }
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and summary["train_loss"] == pytest.approx(sum(losses) / 4, rel=1e-6)
    assert summary["step"] == 4 and output.global_step == 4 and output.training_loss == summary["train_loss"]
    assert summary["train_samples_per_second"] == pytest.approx(4 * 8 / summary["train_runtime"], rel=0.01)
    assert json.loads((tmp_path / "out" / "train_results.json").read_text())["train_loss"] == summary["train_loss"]
    assert isinstance(trainer.state, TrainerState)  # transformers' own class: callbacks read its fields


# --------------------------------------------------------------------------------------------- callbacks


class Recorder(TrainerCallback):
    def __init__(self):
        self.events, self.logs = [], []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            self_events = object.__getattribute__(self, "events")

            def record(args, state, control, **kwargs):
                self_events.append((name, state.global_step))
                if name == "on_log":
                    object.__getattribute__(self, "logs").append(dict(kwargs["logs"]))
                assert kwargs["model"] is not None and kwargs["optimizer"] is not None
                return control

            return record
        return object.__getattribute__(self, name)


class StopAfter(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
            control.should_save = True


def test_callbacks_see_every_event_and_can_stop_and_save(tmp_path):
    recorder = Recorder()
    trainer = trainer_for(tmp_path, callbacks=[recorder, StopAfter(2)], args=config(tmp_path, logging_steps=10))
    trainer.train()
    names = [name for name, _ in recorder.events]
    assert names[0] == "on_init_end" and names[1] == "on_train_begin" and names[-1] == "on_train_end"
    assert names.count("on_step_begin") == 2 and names.count("on_step_end") == 2  # stopped after step 2
    assert ("on_save", 2) in recorder.events and (tmp_path / "out" / "checkpoint-2").is_dir()
    # Step 1 was logged as first step; the stop step's metrics go into the summary (TRL's log() merges them).
    assert [log.get("step") for log in recorder.logs] == [1, 2] and "train_loss" in recorder.logs[-1]
    assert "reward" in recorder.logs[-1]
    assert names.index("on_pre_optimizer_step") < names.index("on_optimizer_step") < names.index("on_step_end")


class LogEveryStepAndEvaluate(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_log = True
        control.should_evaluate = state.global_step == 3
        return control


def test_callback_flags_log_and_evaluate(tmp_path):
    evaluation = letters(1).select(range(2))
    metrics = []

    class Seen(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen_metrics.append(metrics)

    seen_metrics = metrics
    trainer = trainer_for(
        tmp_path,
        callbacks=[LogEveryStepAndEvaluate, Seen()],
        eval_dataset=evaluation,
        args=config(tmp_path, logging_steps=100, logging_first_step=False, per_device_eval_batch_size=8),
    )
    trainer.train()
    steps = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert steps == [1, 2, 3, 4]
    assert len(metrics) == 1 and "eval_loss" in metrics[0] and "eval/reward" in metrics[0]
    with pytest.raises(TypeError, match="TrainerCallback"):
        trainer_for(tmp_path / "b", callbacks=[object()])


# ------------------------------------------------------------------------------------------- optimizers=


def test_optimizers_argument_is_used(tmp_path):
    model, tokenizer = tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.1)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=config(tmp_path, max_steps=2),
        train_dataset=letters(),
        processing_class=tokenizer,
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    assert [h["learning_rate"] for h in trainer.state.log_history if "loss" in h] == pytest.approx([0.05, 0.05])
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert inner is optimizer


# ---------------------------------------------------------------------------------------- iterable data


def stream(rows):
    def generate():
        yield from rows

    return IterableDataset.from_generator(generate)


def test_iterable_train_and_eval_datasets(tmp_path):
    rows = [{"prompt": f"{c}:", "letter": c} for c in LETTERS]
    trainer = trainer_for(
        tmp_path,
        train_dataset=stream(rows),
        eval_dataset=stream(rows[:2]),
        args=config(tmp_path, max_steps=5, eval_strategy="steps", eval_steps=5),
    )
    trainer.train()
    assert trainer.state.global_step == 5
    # 5 generations of 2 prompts from an 8-row stream: a second epoch began, from the first row again.
    assert trainer.sampler.state_dict() == {"epoch": 1, "position": 2}
    evaluation = next(h for h in trainer.state.log_history if "eval_loss" in h)
    assert "eval/reward" in evaluation
    with pytest.raises(ValueError, match="max_steps"):
        trainer_for(tmp_path / "b", train_dataset=stream(rows), args=config(tmp_path / "b", max_steps=-1))


def test_named_eval_datasets_get_prefixed_metrics(tmp_path):
    sets = {"early": letters(1).select(range(2)), "late": letters(1).select(range(6, 8))}
    trainer = trainer_for(tmp_path, eval_dataset=sets, args=config(tmp_path, max_steps=1))
    metrics = trainer.evaluate()
    for name in sets:
        assert f"eval_{name}_loss" in metrics and f"eval_{name}/reward" in metrics
        assert f"eval_{name}/rewards/repeat_letter/pass@1" in metrics


def test_eval_loss_is_the_grpo_loss_of_the_eval_completions(tmp_path):
    """On-policy the ratio is 1: with `grpo` aggregation and no KL the loss is -mean over sequences of A, which
    is 0 up to rounding for group-normalised advantages (each group's advantages sum to zero)."""
    trainer = trainer_for(
        tmp_path, args=config(tmp_path, loss_type="grpo", max_steps=1), eval_dataset=letters(1).select(range(4))
    )
    assert abs(trainer.evaluate()["eval_loss"]) < 1e-6
    with_kl = trainer_for(
        tmp_path / "kl",
        args=config(tmp_path / "kl", loss_type="grpo", beta=0.5, max_steps=1),
        eval_dataset=letters(1).select(range(4)),
    )
    with_kl.train()  # the policy moves away from the reference: a positive KL term
    assert with_kl.evaluate()["eval_loss"] > 1e-6


# --------------------------------------------------------------------------------------- reward kwargs


def test_reward_functions_receive_trainer_state_log_metric_and_log_extra(tmp_path):
    steps_seen = []

    def shaped(completions, letter, trainer_state, log_metric, log_extra, **kwargs):
        steps_seen.append(trainer_state.global_step)
        log_metric("shaped/first_letter", sum(c[:1] == t for c, t in zip(completions, letter)) / len(completions))
        log_extra("first", [c[:1] for c in completions])
        return [float(c[:1] == t) * (1 + trainer_state.global_step) for c, t in zip(completions, letter)]

    trainer = trainer_for(
        tmp_path,
        reward_funcs=shaped,
        args=config(tmp_path, max_steps=3, log_completions=True, num_completions_to_print=2),
    )
    trainer.train()
    assert steps_seen == [0, 1, 2]  # the state as it was when each batch was sampled
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(0.0 <= h["shaped/first_letter"] <= 1.0 for h in logged)
    lines = [json.loads(x) for x in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert all(line["extra"]["first"] == line["completion"][:1] for line in lines)


def test_reward_processing_classes_must_match_the_reward_functions(tmp_path):
    with pytest.raises(ValueError, match=r"reward processing classes \(2\) must match the number of reward"):
        trainer_for(tmp_path, reward_processing_classes=[None, None])
    with pytest.raises(ValueError, match="No reward source"):
        trainer_for(tmp_path, reward_funcs=None)


def test_all_none_rewards_warn_like_trl(tmp_path, caplog):
    def never(completions, **kwargs):
        return [None] * len(completions)

    trainer = trainer_for(tmp_path, reward_funcs=never, args=config(tmp_path, max_steps=1))
    trainer.train()
    # TRL's words, with the first such row's kwargs (a user's log filter or pytest match keeps working)
    assert "All reward functions returned None for the following kwargs:\n{" in caplog.text
    assert "'letter': " in caplog.text and "'completion': " in caplog.text


def test_trls_messages_for_a_missing_dataset_and_a_dispatched_stream(tmp_path):
    model, tokenizer = tiny()
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(model=model, reward_funcs=repeat_letter, args=config(tmp_path), processing_class=tokenizer)
    # A stream with dispatch_batches=True is named first, as TRL checks it (before grpokit's max_steps check).
    stream = letters().to_iterable_dataset()
    args = config(tmp_path, max_steps=-1, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(
            model=model, reward_funcs=repeat_letter, args=args, train_dataset=stream, processing_class=tokenizer
        )


@pytest.mark.parametrize("loss_type", ["bnpo", "cispo", "dapo", "dr_grpo"])
def test_sequence_level_with_a_token_sum_warns_in_trls_words(tmp_path, caplog, loss_type):
    """TRL 1.16's warning, word for word (its f-string, from its GRPOTrainer's source, filled in)."""
    import inspect

    from trl.trainer import grpo_trainer

    trl_message = (
        f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums per-token "
        "contributions, which effectively weights each sequence by its completion length instead of "
        "optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'` "
        "(see https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-policy-optimization)."
    )
    source = inspect.getsource(grpo_trainer)
    link = "(see https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-policy-optimization)."
    assert "which effectively weights each sequence by its completion length instead of " in source and link in source
    trainer_for(tmp_path, args=config(tmp_path, importance_sampling_level="sequence", loss_type=loss_type))
    assert trl_message in caplog.text
    caplog.clear()
    trainer_for(tmp_path, args=config(tmp_path, importance_sampling_level="sequence", loss_type="grpo"))
    assert "weights each sequence" not in caplog.text


def test_a_static_entropy_coef_is_logged_as_in_trl(tmp_path):
    """TRL's test_train_with_static_entropy reads entropy_coef and policy_loss from the last record."""
    trainer = trainer_for(tmp_path, args=config(tmp_path, entropy_coef=0.1, max_steps=3, logging_steps=2))
    trainer.train()
    steps = [record for record in trainer.state.log_history if "loss" in record]
    assert [record["entropy_coef"] for record in steps] == [0.1, 0.1]
    assert trainer.state.log_history[-1]["entropy_coef"] == 0.1  # step 3's, in the summary
    assert trainer.state.log_history[-1]["policy_loss"] is not None
    plain = trainer_for(tmp_path / "plain", args=config(tmp_path / "plain", max_steps=1))
    plain.train()
    assert "entropy_coef" not in plain.state.log_history[0]  # no bonus, nothing logged (TRL's rule)


# ------------------------------------------------------------------------------- TRL's DataLoaders


def test_get_train_dataloader_replays_the_loops_draws_in_trls_layout(tmp_path):
    """A torch DataLoader whose batches are this process's generation batches (each prompt num_generations times in
    a row), each repeated steps_per_generation x num_iterations times, in the order the loop then draws them."""
    drawn = []

    def recording(completions, prompts, **kwargs):  # called once per generation batch, with its rows in order
        drawn.append(list(prompts))
        return [0.0] * len(completions)

    args = config(
        tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_iterations=2, max_steps=8
    )  # 8 prompts, 2 per generation batch: an epoch is 4 of them, 16 micro-batches
    trainer = trainer_for(tmp_path, args=args, reward_funcs=recording, train_dataset=letters(1))
    loader = trainer.get_train_dataloader()
    assert isinstance(loader, torch.utils.data.DataLoader)
    # as accelerate prepares TRL's: the rows per batch in batch_sampler.batch_size, batch_size None
    assert (
        loader.batch_size,
        loader.batch_sampler.batch_size,
        loader.batch_sampler.drop_last,
        loader.num_workers,
        loader.pin_memory,
        loader.persistent_workers,
        loader.prefetch_factor,
    ) == (None, 8, False, 0, True, False, None)
    epoch = [[row["prompt"] for row in batch] for batch in loader]
    assert len(epoch) == len(loader) == 4 * 2 * 2
    assert all(epoch[i] == epoch[i - i % 4] for i in range(len(epoch)))  # each generation batch 4 times
    generation_batches = epoch[::4]
    assert all(batch == [p for p in batch[::4] for _ in range(4)] for batch in generation_batches)
    assert sorted(p for batch in generation_batches for p in batch[::4]) == sorted(letters(1)["prompt"])  # shuffled
    assert generation_batches != sorted(generation_batches)
    trainer.train()  # 8 optimizer steps of 2 micro-batches: the epoch the loader gives
    assert drawn == generation_batches
    assert [[row["prompt"] for row in batch] for batch in trainer.get_train_dataloader()] == epoch  # a fresh copy


def test_dataloaders_take_the_dataloader_fields_and_a_stream_one_worker(tmp_path):
    """TRL's tests: a map-style train set keeps its workers when the eval set is a stream, whose loader alone uses
    one, without changing args; the other dataloader_* fields reach the DataLoader as transformers passes them."""
    args = config(
        tmp_path,
        dataloader_num_workers=4,
        dataloader_persistent_workers=True,
        dataloader_pin_memory=False,
        dataloader_prefetch_factor=3,
        num_generations_eval=2,
        per_device_eval_batch_size=4,
    )
    trainer = trainer_for(tmp_path, args=args, eval_dataset=stream(list(letters(1))))
    train = trainer.get_train_dataloader()
    assert (train.num_workers, train.persistent_workers, train.pin_memory, train.prefetch_factor) == (4, True, False, 3)
    evaluation = trainer.get_eval_dataloader()
    assert evaluation.num_workers == 0 and trainer.args.dataloader_num_workers == 4
    # evaluate()'s rows: every prompt num_generations_eval times, in order, whole groups per batch
    assert [[row["prompt"] for row in batch] for batch in evaluation] == [
        [p for p in pair for _ in range(2)] for pair in zip(*[iter(f"{c}:" for c in LETTERS)] * 2)
    ]
    named = trainer_for(tmp_path, eval_dataset={"few": letters(1).select(range(3))})
    assert [len(batch) for batch in named.get_eval_dataloader("few")] == [8, 4]  # 8 rows: 2 prompts x 4 a batch
    with pytest.raises(ValueError, match="evaluation requires an eval_dataset"):
        trainer_for(tmp_path).get_eval_dataloader()
    # A stream for training: one worker, the stream's rows in the loop's order.
    streamed = trainer_for(
        tmp_path, args=config(tmp_path, dataloader_num_workers=0), train_dataset=stream(list(letters()))
    )
    rows = [[row["prompt"] for row in batch] for batch in streamed.get_train_dataloader()]
    assert streamed.get_train_dataloader().num_workers == 0
    assert [batch[::4] for batch in rows] == [[f"{a}:", f"{b}:"] for a, b in zip(*[iter(LETTERS * 2)] * 2)]


# ------------------------------------------------------------------ steps that straddle generation batches


def test_an_optimizer_step_straddling_two_generation_batches_is_one_big_batch(tmp_path):
    """steps_per_generation=3, gradient_accumulation_steps=2: the second optimizer step takes the last
    micro-batch of generation 1 and the first of generation 2. With plain SGD (lr 1) its update is minus the
    gradient, which must equal the gradient of one optimizer step on those two micro-batches joined (the DAPO
    token count spans both)."""

    def sgd_trainer(directory, model, **values):
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        args = config(directory, loss_type="dapo", beta=0.04, max_grad_norm=0.0, max_completion_length=4, **values)
        return GRPOTrainer(
            model=model,
            reward_funcs=repeat_letter,
            args=args,
            train_dataset=letters(),
            processing_class=tokenizer,
            optimizers=(optimizer, schedule),
        )

    model, tokenizer = tiny()
    trainer = sgd_trainer(
        tmp_path / "a",
        model,
        per_device_train_batch_size=4,
        steps_per_generation=3,
        gradient_accumulation_steps=2,
        max_steps=2,
    )
    windows, before = [], {}
    original = trainer.optimizer_step

    def observe(window):
        windows.append(window)
        before.update({k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()})
        return original(window)

    trainer.optimizer_step = observe
    trainer.train()
    assert trainer.state.rollouts == 2 and [len(w) for w in windows] == [2, 2]
    straddling = windows[1]
    assert straddling[0].old_logprobs is not None  # trained after the policy moved: π_old kept
    update = {k: v.detach() - before[k] for k, v in trainer.unwrapped_model.state_dict().items()}

    joined = TrainBatch(
        **{
            f: None if getattr(straddling[0], f) is None else _cat(straddling, f)
            for f in TrainBatch.__dataclass_fields__
        }
    )
    fresh, _ = tiny()
    fresh.load_state_dict(before)
    single = sgd_trainer(tmp_path / "b", fresh, per_device_train_batch_size=8, max_steps=1)
    single.optimizer_step([joined])
    for name, value in single.unwrapped_model.state_dict().items():
        expected = value - before[name]
        scale = expected.abs().max().clamp(min=1e-12)
        assert ((update[name] - expected).abs().max() / scale).item() < 1e-4, name
    assert max(update[name].abs().max().item() for name in update) > 1e-6  # the step did move the weights


def _cat(parts, field):
    tensors = [getattr(p, field) for p in parts]
    if tensors[0].dim() == 2 and tensors[0].shape[1] != tensors[1].shape[1]:  # completions: pad on the right
        width = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
    return torch.cat(tensors)


# ------------------------------------------------------------------------------------- Hub, remote code


def test_push_to_hub_fails_at_start_when_the_hub_cannot_be_used(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="push_to_hub=True but HF_HUB_OFFLINE is set"):
        trainer_for(tmp_path, args=config(tmp_path, push_to_hub=True))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(RuntimeError, match="Hugging Face Hub cannot be used"):
        trainer_for(tmp_path, args=config(tmp_path, push_to_hub=True, hub_token="hf_not_a_token"))


def test_trust_remote_code_reaches_the_tokenizer_and_reward_models(tmp_path, monkeypatch):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config

    from grpokit.testing import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "policy", chars=LETTERS + ":", hidden_size=32)
    reward_dir = tmp_path / "reward"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    AutoModelForSequenceClassification.from_config(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_labels=1,
            pad_token_id=0,
        )
    ).save_pretrained(reward_dir)
    tokenizer.save_pretrained(reward_dir)
    seen = []
    for cls in (AutoTokenizer, AutoModelForSequenceClassification):
        real = cls.from_pretrained.__func__

        def recording(klass, name, *args, _real=real, **kwargs):
            seen.append((klass.__name__, kwargs.get("trust_remote_code")))
            return _real(klass, name, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(recording))
    GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[repeat_letter, str(reward_dir)],
        train_dataset=letters(),
        args=config(tmp_path, trust_remote_code=True),
    )
    assert ("AutoTokenizer", True) in seen and ("AutoModelForSequenceClassification", True) in seen
    assert all(flag is True for _, flag in seen)


# ------------------------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize("setting", ["stream", "adaptive_entropy"])
def test_resume_is_exact_with_a_stream_and_with_adaptive_entropy(tmp_path, setting):
    """A run interrupted at its step-2 checkpoint and resumed ends with the weights of the run that was not: the
    stream's position and the entropy controller are saved with the checkpoint."""
    rows = [{"prompt": f"{c}:", "letter": c} for c in LETTERS[:6]]  # 6 rows: the stream wraps into a 2nd epoch
    values = dict(max_steps=4, save_strategy="steps", save_steps=2, lr_scheduler_type="constant")
    if setting == "adaptive_entropy":
        values.update(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=5.0, entropy_coef_delta=0.02)

    def run(directory, max_steps, resume=None):
        dataset = stream(rows) if setting == "stream" else letters()
        trainer = trainer_for(
            directory, train_dataset=dataset, args=config(directory, **{**values, "max_steps": max_steps})
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full", 4)
    run(tmp_path / "split", 2)
    resumed = run(tmp_path / "split", 4, resume=str(tmp_path / "split" / "out" / "checkpoint-2"))
    a, b = full.unwrapped_model.state_dict(), resumed.unwrapped_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    if setting == "stream":
        assert resumed.sampler.state_dict() == full.sampler.state_dict() == {"epoch": 1, "position": 2}
    else:
        coefs = [h["entropy_coef"] for h in resumed.state.log_history if "entropy_coef" in h]
        assert coefs == [h["entropy_coef"] for h in full.state.log_history if "entropy_coef" in h] and coefs[-1] > 0.01


# ----------------------------------------------- logging_strategy, eval_on_start / eval_delay, log levels, etc.


def test_logging_strategy_no_and_epoch(tmp_path):
    # 16 prompts of 2 per step: an epoch is 8 optimizer steps.
    none = trainer_for(tmp_path / "no", args=config(tmp_path / "no", max_steps=10, logging_strategy="no"))
    none.train()
    assert [h for h in none.state.log_history if "loss" in h] == []  # nothing per step, not even the first
    assert "train_loss" in none.state.log_history[-1]
    epoch = trainer_for(
        tmp_path / "epoch",
        args=config(tmp_path / "epoch", max_steps=10, logging_strategy="epoch", logging_first_step=False),
    )
    epoch.train()
    records = [h for h in epoch.state.log_history if "loss" in h]
    assert [(h["step"], h["epoch"]) for h in records] == [(8, 1.0)]
    # The record of an epoch averages all its steps (the window is not flushed between logs): the mean of the
    # per-step records of the same run logged every step.
    steps = trainer_for(tmp_path / "steps", args=config(tmp_path / "steps", max_steps=10))
    steps.train()
    per_step = [h for h in steps.state.log_history if "loss" in h][:8]
    assert [h["step"] for h in per_step] == list(range(1, 9))
    for key in ("loss", "reward", "completions/mean_length"):
        assert records[0][key] == pytest.approx(sum(h[key] for h in per_step) / 8, rel=1e-6, abs=1e-9), key
    with pytest.raises(ValueError, match="logging_strategy='sometimes' is not valid"):
        config(tmp_path, logging_strategy="sometimes")


def test_eval_on_start_and_eval_delay(tmp_path):
    evaluation = letters(1).select(range(2))
    trainer = trainer_for(
        tmp_path,
        eval_dataset=evaluation,
        args=config(
            tmp_path,
            max_steps=4,
            eval_on_start=True,
            eval_strategy="steps",
            eval_steps=1,
            eval_delay=3,
            per_device_eval_batch_size=8,
        ),
    )
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [0, 3, 4]
    with pytest.raises(ValueError, match="eval_on_start=True needs an eval_dataset"):
        trainer_for(tmp_path / "b", args=config(tmp_path / "b", eval_on_start=True))
    with pytest.raises(ValueError, match="eval_delay=-1 must be >= 0"):
        config(tmp_path, eval_delay=-1)


def test_log_level_sets_transformers_verbosity(tmp_path):
    from transformers.utils import logging as transformers_logging

    before = transformers_logging.get_verbosity()
    try:
        trainer_for(tmp_path, args=config(tmp_path, log_level="info"))
        assert transformers_logging.get_verbosity() == transformers_logging.INFO
        trainer_for(tmp_path, args=config(tmp_path, log_level="passive"))  # leaves it as it is
        assert transformers_logging.get_verbosity() == transformers_logging.INFO
        trainer_for(tmp_path, args=config(tmp_path, log_level="error"))
        assert transformers_logging.get_verbosity() == transformers_logging.ERROR
        assert logging.getLogger("grpokit").level == logging.ERROR  # grpokit's advisories follow it too
    finally:
        transformers_logging.set_verbosity(before)
        logging.getLogger("grpokit").setLevel(logging.NOTSET)
    with pytest.raises(ValueError, match="log_level_replica='loud' is not valid"):
        config(tmp_path, log_level_replica="loud")


def test_full_determinism_turns_on_deterministic_kernels_and_keeps_the_run(tmp_path, monkeypatch):
    for name in (
        "CUDA_LAUNCH_BLOCKING",
        "CUBLAS_WORKSPACE_CONFIG",
        "ASCEND_LAUNCH_BLOCKING",
        "HCCL_DETERMINISTIC",
        "FLASH_ATTENTION_DETERMINISTIC",
    ):
        monkeypatch.delenv(name, raising=False)  # set by transformers; put back as they were after the test
    plain = trainer_for(tmp_path / "a", args=config(tmp_path / "a", max_steps=2))
    plain.train()
    try:
        strict = trainer_for(tmp_path / "b", args=config(tmp_path / "b", max_steps=2, full_determinism=True))
        assert torch.are_deterministic_algorithms_enabled()
        assert "CUBLAS_WORKSPACE_CONFIG" in os.environ  # cuBLAS' deterministic workspace, as transformers sets it
        strict.train()
    finally:
        torch.use_deterministic_algorithms(False)
    for (name, a), b in zip(plain.model.named_parameters(), strict.model.parameters()):
        assert torch.equal(a, b), name


class SigtermAt(TrainerCallback):
    """Sends this process SIGTERM at the end of one step, as a scheduler preempting the job would."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_with_enable_jit_checkpoint_saves_stops_and_resumes_exactly(tmp_path, capfd):
    before = signal.getsignal(signal.SIGTERM)
    preempted = trainer_for(
        tmp_path / "a",
        callbacks=[SigtermAt(2)],
        args=config(tmp_path / "a", enable_jit_checkpoint=True, logging_steps=10),
    )
    output = preempted.train()
    assert output.global_step == 2 and signal.getsignal(signal.SIGTERM) is before  # the handler is given back
    assert (tmp_path / "a" / "out" / "checkpoint-2").is_dir()
    assert "SIGTERM: saved checkpoint-2" in capfd.readouterr().err
    # Step 2's metrics are not lost: the summary carries them (TRL's log() merges what was not logged yet).
    assert [h["step"] for h in preempted.state.log_history if "loss" in h] == [1]
    assert preempted.state.log_history[-1]["step"] == 2 and "reward" in preempted.state.log_history[-1]
    resumed = trainer_for(tmp_path / "a", args=config(tmp_path / "a"))
    resumed.train(resume_from_checkpoint=True)
    unbroken = trainer_for(tmp_path / "b", args=config(tmp_path / "b"))
    unbroken.train()
    for (name, a), b in zip(unbroken.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    # train() outside the main thread cannot take signals: said at once.
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_train_error(tmp_path / "c")))
    thread.start()
    thread.join()
    assert errors and "needs train() to run in the main thread" in errors[0]


def _train_error(tmp_path) -> str:
    try:
        trainer_for(tmp_path, args=config(tmp_path, max_steps=1, enable_jit_checkpoint=True)).train()
    except RuntimeError as error:
        return str(error)
    return ""


# ------------------------------------------------------------------------------------------ generation_kwargs


def test_generation_kwargs_stop_and_suppress_tokens_and_override_the_sampling_fields(tmp_path):
    model, tokenizer = tiny()
    stop, never = tokenizer.convert_tokens_to_ids("c"), tokenizer.convert_tokens_to_ids("d")
    args = config(
        tmp_path,
        max_completion_length=12,
        per_device_train_batch_size=64,
        num_generations=8,
        generation_kwargs={"eos_token_id": stop, "suppress_tokens": [never], "top_k": 6, "do_sample": True},
    )
    assert args.top_k == 6  # TRL: generation_kwargs override the named fields
    trainer = GRPOTrainer(
        model=model, reward_funcs=repeat_letter, args=args, train_dataset=letters(4), processing_class=tokenizer
    )
    assert stop in trainer.codec.eos_token_ids and tokenizer.eos_token_id in trainer.codec.eos_token_ids
    batch = trainer.generate_batch()
    rows = [ids[:length].tolist() for ids, length in zip(batch.completion_ids, batch.lengths.tolist())]
    assert all(never not in row for row in rows)  # 64 rows of up to 12 tokens: never drawn
    ended_on_stop = [row for row in rows if row and row[-1] == stop]
    assert ended_on_stop and all(stop not in row[:-1] for row in rows)  # "c" ends a completion where it appears
    # Without the options both tokens are sampled (the model is random): the options are what made the difference.
    plain = GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        processing_class=tokenizer,
        train_dataset=letters(4),
        args=config(tmp_path / "plain", max_completion_length=12, per_device_train_batch_size=64, num_generations=8),
    )
    batch = plain.generate_batch()
    rows = [ids[:length].tolist() for ids, length in zip(batch.completion_ids, batch.lengths.tolist())]
    assert any(never in row for row in rows) and any(stop in row[:-1] for row in rows)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_return_sequences": 2}, r"generation_kwargs \['num_return_sequences'\]: num_return_sequences=2"),
        (
            {"no_repeat_ngram_size": 3, "seed": 7},
            r"\['seed'\]: seed=7 .*accepted at seed=None\). Supported: .*; without "
            r"use_vllm, num_beams, .* are sampled with transformers' generate",
        ),
        ({"top_k_typo": 5}, r"\['top_k_typo'\]: not an option of transformers' GenerationConfig or vLLM's"),
        ({"temperature": 0.5}, "Set temperature instead"),
        ({"do_sample": False}, "GRPO needs sampled completions"),
        ({"max_new_tokens": 8}, "set max_completion_length instead"),
        ({"eos_token_id": "</s>"}, "must be a token id or a list of token ids"),
        ("top_k=5", "must be a dict"),
    ],
)
def test_generation_kwargs_that_grpokit_cannot_honour_are_refused_by_name(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, generation_kwargs=options)


def tiny_prompts(tokenizer):
    from grpokit.rollout import PromptBatch

    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("a:", "bcd:")]
    return PromptBatch(ids=ids, counts=[3, 3], raw=[None, None])


def test_beam_search_is_transformers_generate_with_trls_generation_config(tmp_path):
    # TRL passes generation_kwargs to GenerationConfig and samples with model.generate; grpokit's engine for options
    # its own sampler lacks does the same: the rows are generate's, seeded with the generation's seed, cut after the
    # first EOS (truncated where there is none).
    from transformers import GenerationConfig

    from grpokit.rollout import SamplingParams, TransformersGenerateEngine

    model, tokenizer = tiny()
    options = {"num_beams": 2, "length_penalty": -0.1}
    engine = TransformersGenerateEngine(model, options=options)
    prompts, seed = tiny_prompts(tokenizer), 11
    params = SamplingParams(
        max_new_tokens=6,
        temperature=0.9,
        top_k=50,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
    )
    rollout = engine.generate(prompts, params, seed)

    prompt_ids, prompt_mask = prompts.padded(tokenizer.pad_token_id)
    expected_config = GenerationConfig(
        max_new_tokens=6,
        do_sample=True,
        temperature=0.9,
        top_k=50,
        top_p=1.0,
        repetition_penalty=1.0,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        **options,
    )
    torch.manual_seed(seed)
    expected = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=expected_config)
    expected = expected[:, prompt_ids.shape[1] :]
    assert rollout.sampling_logprobs is None and torch.equal(rollout.prompt_ids, prompt_ids)
    for row, ids in enumerate(expected.tolist()):
        end = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
        assert rollout.completion_id_lists()[row] == ids[:end]
        assert rollout.lengths[row] == end and bool(rollout.is_truncated[row]) == (
            end == len(ids) and ids[-1] != tokenizer.eos_token_id
        )
        assert rollout.loss_mask[row].sum() == end
    # The beams are what made these rows: the same seed without them samples others.
    plain = TransformersGenerateEngine(model).generate(prompts, params, seed)
    assert plain.completion_id_lists() != rollout.completion_id_lists()
    assert engine.generate(prompts, params, seed).completion_id_lists() == rollout.completion_id_lists()


def test_generation_kwargs_only_generate_honours_train_through_it_and_the_default_sampler_stays(tmp_path):
    from grpokit.rollout import HFEngine, TransformersGenerateEngine

    # TRL's test_train_with_generation_kwargs, on the tiny model.
    trl_options = {"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}
    trainer = trainer_for(
        tmp_path,
        args=config(tmp_path, max_steps=2, generation_kwargs=trl_options),
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
    )
    assert isinstance(trainer.engine, TransformersGenerateEngine)
    assert trainer.engine.options == {"num_beams": 2, "length_penalty": -0.1}
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    # One of generate's logits processors: no bigram repeats in any completion.
    trainer = trainer_for(
        tmp_path / "ngram",
        args=config(tmp_path / "ngram", max_completion_length=12, generation_kwargs={"no_repeat_ngram_size": 2}),
    )
    batch = trainer.generate_batch()
    rows = [ids[:length].tolist() for ids, length in zip(batch.completion_ids, batch.lengths.tolist())]
    bigrams = [list(itertools.pairwise(row)) for row in rows]
    assert max(map(len, rows)) > 6 and all(len(set(pairs)) == len(pairs) for pairs in bigrams)
    # Neutral values keep grpokit's own sampler (the pinned runs' numbers).
    trainer = trainer_for(tmp_path / "neutral", args=config(tmp_path / "neutral", generation_kwargs={"num_beams": 1}))
    assert isinstance(trainer.engine, HFEngine)


@pytest.mark.parametrize("all_truncated", [False, True])
def test_a_mocked_transformers_generate_samples_as_in_trls_mask_truncated_completions_tests(tmp_path, all_truncated):
    # TRL's test_train_with_mask_truncated_completions patches GenerationMixin.generate (TRL samples with it): one
    # row truncated, one ended early, one ended on the last allowed token. grpokit's in-process engine samples with
    # the patched generate too; the truncated row leaves the loss (mask_truncated_completions), the others train.
    # With every row truncated nothing trains (TRL's ..._all_masked): loss 0, weights unchanged.
    from unittest.mock import patch

    _, tokenizer = tiny()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    a, b, c = (tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    rows = [[a, b, c, a, b, c, a, b], [c, b, a, eos, pad, pad, pad, pad], [a, a, b, b, c, c, a, eos]]
    if all_truncated:
        rows = [[a] * 8, [b] * 8, [c] * 8]

    def fake_generate(input_ids, **kwargs):
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)

    args = config(
        tmp_path,
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        max_steps=1,
        mask_truncated_completions=True,
        loss_type="dapo",
        learning_rate=0.1,
    )
    trainer = trainer_for(
        tmp_path, args=args, reward_funcs=lambda completions, **k: [float(len(c)) for c in completions]
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with patch("transformers.generation.utils.GenerationMixin.generate", side_effect=fake_generate) as generate:
        batch = trainer.generate_batch()
        trainer.train()
    assert generate.call_count == 2  # the batch above, the step's
    expected_tokens = [0, 0, 0] if all_truncated else [0, 4, 8]
    assert sorted(batch.loss_mask.sum(1).tolist()) == expected_tokens  # the batch keeps its own row order
    moved = any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    assert moved == (not all_truncated)
    if all_truncated:
        assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(0.0)


def test_generation_kwargs_suppressed_token_outside_the_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"suppress_tokens \[5000\] are not in the model's vocabulary"):
        trainer_for(tmp_path, args=config(tmp_path, generation_kwargs={"suppress_tokens": [5000]}))


# ----------------------------------------------------------------------------- the best checkpoint at the end


def test_load_best_model_at_end_loads_the_checkpoint_with_the_best_metric_and_keeps_it(tmp_path):
    from safetensors.torch import load_file

    args = config(
        tmp_path,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="completions/mean_length",
        greater_is_better=True,
        per_device_eval_batch_size=8,
    )
    trainer = trainer_for(tmp_path, args=args, eval_dataset=letters(1).select(range(4)))
    trainer.train()
    metric = "eval/completions/mean_length"  # the name given, found under grpokit's eval/ prefix
    evaluations = {h["step"]: h[metric] for h in trainer.state.log_history if metric in h}
    assert sorted(evaluations) == [2, 4, 6] and len(set(evaluations.values())) > 1  # the metric moves
    best_step = min(evaluations, key=lambda step: (-evaluations[step], step))  # the largest; strictly better wins
    state = trainer.state
    assert state.best_metric == evaluations[best_step] and state.best_global_step == best_step
    assert state.best_model_checkpoint == str(tmp_path / "out" / f"checkpoint-{best_step}")
    # save_total_limit=1 keeps the best and the newest.
    kept = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert kept == sorted({f"checkpoint-{best_step}", "checkpoint-6"})
    best = load_file(str(tmp_path / "out" / f"checkpoint-{best_step}" / "model.safetensors"))
    last = load_file(str(tmp_path / "out" / "checkpoint-6" / "model.safetensors"))
    for name, value in trainer.model.state_dict().items():
        if name in best:
            assert torch.equal(value, best[name]), name
    if best_step != 6:
        assert any(not torch.equal(best[k], last[k]) for k in best)


def test_metric_for_best_model_names_are_checked_and_defaults_follow_transformers(tmp_path):
    args = config(
        tmp_path, eval_strategy="steps", save_strategy="steps", save_steps=2, eval_steps=2, load_best_model_at_end=True
    )
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False
    assert config(tmp_path, metric_for_best_model="eval/reward").greater_is_better is True
    with pytest.raises(ValueError, match="needs a checkpoint where there is an evaluation"):
        config(tmp_path, load_best_model_at_end=True, eval_strategy="no")
    with pytest.raises(ValueError, match=r"save_steps \(3\) to be a multiple of eval_steps \(2\)"):
        config(
            tmp_path,
            load_best_model_at_end=True,
            eval_strategy="steps",
            eval_steps=2,
            save_steps=3,
            save_strategy="steps",
        )
    trainer = trainer_for(
        tmp_path,
        eval_dataset=letters(1).select(range(2)),
        args=config(
            tmp_path,
            max_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            save_steps=2,
            save_strategy="steps",
            metric_for_best_model="accuracy",
            per_device_eval_batch_size=8,
        ),
    )
    with pytest.raises(ValueError, match=r"metric_for_best_model='accuracy' is not among the evaluation's metrics"):
        trainer.train()


@pytest.mark.parametrize(
    "keep, best, kept",
    [
        (1, 2, [2, 5]),
        (1, 5, [5]),
        (2, 2, [2, 5]),
        (2, 5, [4, 5]),
        (3, 1, [1, 4, 5]),
        (3, None, [3, 4, 5]),
    ],
)
def test_rotation_keeps_the_best_checkpoint_among_save_total_limit(tmp_path, keep, best, kept):
    from grpokit.checkpoint import list_checkpoints, rotate_checkpoints, write_checkpoint

    for step in range(1, 6):
        write_checkpoint(tmp_path, step, lambda directory: (directory / "weights").write_text("w"))
    rotate_checkpoints(tmp_path, keep, protect=None if best is None else tmp_path / f"checkpoint-{best}")
    assert [int(p.name.split("-")[1]) for p in list_checkpoints(tmp_path)] == kept


def test_suppressed_tokens_reach_the_vllm_engine(tmp_path):
    # vLLM suppresses them with a logit bias of -100 (tests/test_vllm.py samples with it); the config passes them on.
    args = config(tmp_path, use_vllm=True, generation_kwargs={"suppress_tokens": [3, 4]})
    assert args.generation_token_ids()[1] == (3, 4)


# ---------------------------------------------------------------------------------- deepspeed (TRL's field)
ZERO2 = {
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
}
LAUNCHED = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_deepspeed_config_is_read_from_a_dict_a_json_string_or_a_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO2))
    for given in (ZERO2, json.dumps(ZERO2), str(path)):
        args = config(tmp_path, deepspeed=given)
        assert args.deepspeed_config() == ZERO2
    args = config(tmp_path, deepspeed=ZERO2)
    args.deepspeed_config()["zero_optimization"]["stage"] = 3  # a copy: the field keeps what the user gave
    assert args.deepspeed["zero_optimization"]["stage"] == 2 and config(tmp_path).deepspeed_config() is None


@pytest.mark.parametrize(
    "given, message",
    [
        ({**ZERO2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "'optimizer' section"),
        ({**ZERO2, "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}}, "'optimizer' and 'scheduler'"),
        ({"train_micro_batch_size_per_gpu": "auto"}, "no 'zero_optimization' section"),
        ("no/such/ds_config.json", "neither a dict, a JSON object nor the path of a JSON file"),
    ],
)
def test_deepspeed_config_grpokit_cannot_follow_is_refused_at_once(tmp_path, given, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, deepspeed=given)


def test_deepspeed_values_that_disagree_with_the_run_are_named(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from grpokit.distributed import deepspeed_plugin

    args = config(
        tmp_path,
        deepspeed={
            **ZERO2,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 1.0,
            "train_batch_size": 16,
            "bf16": {"enabled": True},
        },
    )
    with pytest.raises(ValueError, match=r"needs a distributed launcher .RANK, LOCAL_RANK, WORLD_SIZE"):
        deepspeed_plugin(args, 1)
    for name, value in LAUNCHED.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as error:
        deepspeed_plugin(args, 2)
    # per device 8 (not 4), accumulation 1, 2 processes: 16 in all (as given); clipping 1.0 (as given); bf16 off.
    assert str(error.value).splitlines()[1:3] == [
        "  train_micro_batch_size_per_gpu: 4 in the DeepSpeed config, 8 from GRPOConfig",
        "  bf16.enabled: True in the DeepSpeed config, False from GRPOConfig",
    ]
    plugin = deepspeed_plugin(config(tmp_path, deepspeed={**ZERO2, "train_batch_size": 16}), 2)
    assert plugin.zero_stage == 2 and plugin.deepspeed_config["train_batch_size"] == 16
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="the launch asks for FSDP"):
        deepspeed_plugin(config(tmp_path, deepspeed=ZERO2), 2)


# ------------------------------------------------------------------------------- fsdp / fsdp_config (TRL's fields)
def test_fsdp_fields_become_accelerates_fsdp2_plugin_arguments_as_transformers_makes_them(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(
        json.dumps(
            {
                "fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer",
                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                "activation_checkpointing": "true",
            }
        )
    )
    base = {
        "fsdp_version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "state_dict_type": "FULL_STATE_DICT",
        "reshard_after_forward": True,
        "cpu_ram_efficient_loading": False,
    }
    assert config(tmp_path).fsdp_plugin_kwargs() is None
    assert config(tmp_path, fsdp="full_shard auto_wrap").fsdp_plugin_kwargs() == base
    assert config(tmp_path, fsdp=True).fsdp_plugin_kwargs() == base
    assert config(tmp_path, fsdp=["shard_grad_op", "offload"]).fsdp_plugin_kwargs() == {
        **base,
        "reshard_after_forward": False,
        "cpu_offload": True,
    }
    # fsdp_config (a file here, keys with and without the prefix) wins over the legacy option string.
    assert config(tmp_path, fsdp="shard_grad_op", fsdp_config=str(path)).fsdp_plugin_kwargs() == {
        **base,
        "reshard_after_forward": False,
        "state_dict_type": "SHARDED_STATE_DICT",
        "activation_checkpointing": True,
        "transformer_cls_names_to_wrap": "Qwen2DecoderLayer",
    }
    assert config(
        tmp_path,
        fsdp=True,
        fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000, "reshard_after_forward": False},
    ).fsdp_plugin_kwargs() == {
        **base,
        "auto_wrap_policy": "SIZE_BASED_WRAP",
        "min_num_params": 1000,
        "reshard_after_forward": False,
    }
    with pytest.warns(UserWarning, match="fsdp_config is set but fsdp is not: FSDP stays off"):
        assert config(tmp_path, fsdp_config={"version": 2}).fsdp_plugin_kwargs() is None


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"fsdp": "hybrid_shard"}, "'hybrid_shard' is an FSDP1 strategy"),
        ({"fsdp": "full_shard sideways"}, "unknown option 'sideways'"),
        ({"fsdp": True, "fsdp_config": {"fsdp_version": 1}}, "version 1 .FSDP1. is not supported"),
        (
            {"fsdp": True, "fsdp_config": {"backward_prefetch": "BACKWARD_PRE", "xla": True}},
            r"\['backward_prefetch', 'xla'\]: not FSDP2 options",
        ),
        ({"fsdp": True, "fsdp_config": {"auto_wrap_policy": "EVERYTHING"}}, "auto_wrap_policy='EVERYTHING'"),
        ({"fsdp": True, "fsdp_config": {"state_dict_type": "LOCAL_STATE_DICT"}}, "state_dict_type='LOCAL_STATE_DICT'"),
        ({"fsdp": True, "deepspeed": ZERO2}, "fsdp and deepspeed are both set"),
    ],
)
def test_fsdp_fields_grpokit_would_not_run_are_refused_at_once(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **fields)


# ------------------------------------------------------------------------------- accelerator_config (TRL's field)
def test_accelerator_config_is_read_from_a_dict_a_json_string_a_file_or_an_accelerator_config(tmp_path):
    from transformers.trainer_pt_utils import AcceleratorConfig

    given = {"even_batches": False, "gradient_accumulation_kwargs": {"sync_each_batch": True}}
    expected = {
        "split_batches": False,
        "dispatch_batches": None,
        "even_batches": False,
        "use_seedable_sampler": True,
        "non_blocking": False,
        "gradient_accumulation_kwargs": {"sync_each_batch": True},
        "use_configured_state": False,
    }
    path = tmp_path / "accelerator.json"
    path.write_text(json.dumps(given))
    for form in (given, json.dumps(given), str(path), AcceleratorConfig(**given)):
        assert config(tmp_path, accelerator_config=form).accelerator_options() == expected
    assert config(tmp_path).accelerator_options() == {
        **expected,
        "even_batches": True,
        "gradient_accumulation_kwargs": {},
    }
    both = {"gradient_accumulation_kwargs": {"num_steps": 2}}  # the same count twice: fine
    assert config(tmp_path, gradient_accumulation_steps=2, accelerator_config=both).accelerator_options()


def test_accelerator_config_is_held_as_transformers_accelerator_config(tmp_path):
    """TRL's code and tests read and set attributes of it (`args.accelerator_config.dispatch_batches`), as
    transformers' TrainingArguments holds an AcceleratorConfig whatever it was given; every form still loads."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    from grpokit.cli import parse_train_args

    path = tmp_path / "accelerator.json"
    path.write_text(json.dumps({"even_batches": False}))
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("accelerator_config:\n  even_batches: false\n")
    from_yaml = parse_train_args([str(yaml_file)])[1]["accelerator_config"]
    from_flag = parse_train_args(["--accelerator_config", '{"even_batches": false}'])[1]["accelerator_config"]
    for form in (
        {"even_batches": False},
        json.dumps({"even_batches": False}),
        str(path),
        AcceleratorConfig(even_batches=False),
        from_yaml,
        from_flag,
    ):
        held = config(tmp_path, accelerator_config=form).accelerator_config
        assert held == AcceleratorConfig(even_batches=False), form
    default = config(tmp_path).accelerator_config
    assert isinstance(default, AcceleratorConfig) and default.dispatch_batches is None
    assert default.gradient_accumulation_kwargs is None and default.even_batches is True  # transformers' defaults
    # The run's saved configuration loads back into the same one.
    args = config(tmp_path, accelerator_config=AcceleratorConfig(even_batches=False))
    args.save(tmp_path / "saved.json")
    assert GRPOConfig.from_dict(json.loads((tmp_path / "saved.json").read_text())) == args
    # TRL's trainer sets dispatch_batches=False on it for a stream; grpokit's does the same, on the object.
    trainer = trainer_for(tmp_path, args=config(tmp_path, max_steps=1), train_dataset=letters().to_iterable_dataset())
    assert trainer.args.accelerator_config.dispatch_batches is False
    assert trainer.args.accelerator_options()["dispatch_batches"] is False


@pytest.mark.parametrize(
    "given, message",
    [
        ({"split_batches": True}, "split_batches=True is not supported: per_device_train_batch_size is each process's"),
        ({"dispatch_batch": True}, r"\['dispatch_batch'\]: not options of transformers' AcceleratorConfig"),
        (
            {"gradient_accumulation_kwargs": {"num_steps": 4}},
            "num_steps=4 disagrees with gradient_accumulation_steps=1",
        ),
        ({"gradient_accumulation_kwargs": {"sync_every": True}}, r"\['sync_every'\]: not options of accelerate's"),
        ("no/such/accelerator.json", "neither a dict, a JSON object nor the path of a JSON file"),
    ],
)
def test_accelerator_config_grpokit_cannot_follow_is_refused_at_once(tmp_path, given, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, accelerator_config=given)


def test_sync_each_batch_synchronises_every_micro_batch(tmp_path):
    """gradient_accumulation_kwargs.sync_each_batch: no micro-batch runs under the backend's `no_sync` (without it,
    all but the window's last do). Two processes: tests/test_distributed.py counts the all-reduces."""
    import contextlib

    model, tokenizer = tiny()
    for sync_each_batch, expected in ((False, [False, False, True]), (True, [True, True, True])):
        options = {"gradient_accumulation_kwargs": {"sync_each_batch": sync_each_batch}}
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=repeat_letter,
            processing_class=tokenizer,
            train_dataset=letters(),
            args=config(tmp_path, accelerator_config=options),
        )
        synced = [
            isinstance(trainer.stepper.micro_batch(is_last), contextlib.nullcontext) for is_last in (False, False, True)
        ]
        assert synced == expected


def test_use_configured_state_takes_the_scripts_accelerate_state_and_needs_one(tmp_path):
    from accelerate import PartialState

    from grpokit.compat import reset_accelerate_state

    model, tokenizer = tiny()

    def build():
        return GRPOTrainer(
            model=model,
            reward_funcs=repeat_letter,
            processing_class=tokenizer,
            train_dataset=letters(),
            args=config(tmp_path, accelerator_config={"use_configured_state": True}),
        )

    reset_accelerate_state()
    with pytest.raises(
        ValueError,
        match=r"use_configured_state=True needs accelerate's state set up before the trainer .* create it first",
    ):
        build()
    state = PartialState(cpu=True)
    assert build().accelerator.state.num_processes == state.num_processes == 1


# ----------------------------------------------------------------------------------------- debug (TRL's field)
def test_debug_underflow_overflow_stops_at_the_first_inf_and_names_the_module(tmp_path, capsys):
    model, tokenizer = tiny()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")  # the second layer's MLP makes infs
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        processing_class=tokenizer,
        train_dataset=letters(),
        args=config(tmp_path, debug="underflow_overflow"),
    )
    with pytest.raises(ValueError, match="DebugUnderflowOverflow: inf/nan detected"):
        trainer.train()
    report = capsys.readouterr().out
    assert "Detected inf/nan during batch_number=0" in report and "model.layers.1.mlp.down_proj" in report
    assert config(tmp_path, debug=["underflow_overflow"]).debug == ["underflow_overflow"]
    with pytest.raises(ValueError, match="'tpu_metrics_debug' is not supported"):
        config(tmp_path, debug="underflow_overflow tpu_metrics_debug")


def test_ignore_data_skip_starts_the_current_epoch_over_on_resume(tmp_path):
    def recording(seen):
        def reward(prompts, completions, letter, **kwargs):
            seen.append(sorted(set(prompts)))
            return repeat_letter(completions, letter)

        return reward

    first = []  # 16 prompts, 2 a step: the epoch lasts 8 steps
    trainer_for(
        tmp_path, reward_funcs=recording(first), args=config(tmp_path, save_strategy="steps", save_steps=2)
    ).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    for ignore, expected in ((False, first[2:4]), (True, first[0:2])):
        seen = []
        trainer = trainer_for(
            tmp_path / str(ignore),
            reward_funcs=recording(seen),
            args=config(tmp_path / str(ignore), ignore_data_skip=ignore),
        )
        trainer.train(resume_from_checkpoint=str(checkpoint))
        assert seen == expected and trainer.state.global_step == 4
    assert first[0:2] != first[2:4]


@pytest.mark.parametrize("name, dtype", [("bf16_full_eval", torch.bfloat16), ("fp16_full_eval", torch.float16)])
def test_full_eval_casts_the_model_for_evaluate_outside_train_only(tmp_path, name, dtype):
    trainer = trainer_for(
        tmp_path,
        eval_dataset=letters(1),
        args=config(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, **{name: True}),
    )
    trainer.train()  # evaluates at step 2 in float32, as transformers' Trainer does inside train()
    assert "eval/reward" in trainer.state.log_history[-2]
    assert {p.dtype for p in trainer.unwrapped_model.parameters()} == {torch.float32}
    metrics = trainer.evaluate()
    assert {p.dtype for p in trainer.unwrapped_model.parameters()} == {dtype}
    assert 0.0 <= metrics["eval/reward"] <= 1.0 and math.isfinite(metrics["eval_loss"])


# ----------------------------------------------------------------------------------- torch_compile (TRL's field)
def test_torch_compile_compiles_the_decoder_layers_and_keeps_the_run(tmp_path):
    # aot_eager: torch.compile's tracing and autograd without inductor's code generation (minutes on this CPU; the
    # slow test below runs inductor). The run must be the eager one: same losses, same weights.
    eager = trainer_for(tmp_path / "eager", args=config(tmp_path / "eager", max_steps=2))
    eager.train()
    compiled = trainer_for(
        tmp_path / "compiled", args=config(tmp_path / "compiled", max_steps=2, torch_compile_backend="aot_eager")
    )
    assert compiled.args.torch_compile and compiled.args.torch_compile_backend == "aot_eager"
    layers = compiled.unwrapped_model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert compiled.unwrapped_model.model.embed_tokens._compiled_call_impl is None  # the rest stays eager
    compiled.train()
    assert [e["loss"] for e in compiled.state.log_history[:-1]] == pytest.approx(
        [e["loss"] for e in eager.state.log_history[:-1]], abs=1e-6
    )
    for (name, a), b in zip(eager.unwrapped_model.state_dict().items(), compiled.unwrapped_model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert config(tmp_path, torch_compile=True).torch_compile_backend == "inductor"


@pytest.mark.slow
def test_torch_compile_with_inductor_keeps_the_run(tmp_path):
    eager = trainer_for(tmp_path / "eager", args=config(tmp_path / "eager", max_steps=3))
    eager.train()
    compiled = trainer_for(tmp_path / "compiled", args=config(tmp_path / "compiled", max_steps=3, torch_compile=True))
    compiled.train()
    assert [e["loss"] for e in compiled.state.log_history[:-1]] == pytest.approx(
        [e["loss"] for e in eager.state.log_history[:-1]], abs=1e-5
    )
    for (name, a), b in zip(eager.unwrapped_model.state_dict().items(), compiled.unwrapped_model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-4), name


# ------------------------------------------------------------ the last record and the trainer's surface (TRL)


def test_the_summary_record_carries_the_metrics_of_the_steps_after_the_last_record(tmp_path):
    """TRL's log() merges the metrics not yet logged into the record it writes: with logging_steps=2 and 3 steps,
    step 3 has no record of its own and its metrics are in the summary (as transformers' DefaultFlowCallback logs
    only every logging_steps)."""
    trainer = trainer_for(tmp_path, args=config(tmp_path, max_steps=3, logging_steps=2, logging_first_step=False))
    output = trainer.train()
    steps = [r["step"] for r in trainer.state.log_history]
    assert steps == [2, 3]
    summary = trainer.state.log_history[-1]
    assert {
        "train_runtime",
        "train_loss",
        "reward",
        "reward_std",
        "rewards/repeat_letter/mean",
        "rewards/repeat_letter/std",
        "policy_loss",
        "step_time",
        "num_tokens",
        "entropy",
    } <= set(summary)
    assert not {"loss", "learning_rate", "grad_norm"} & set(summary)  # transformers reports train_loss instead
    assert output.metrics["reward"] == summary["reward"] and summary["num_tokens"] == trainer.state.num_tokens
    # The steps' own records: the window of steps 1-2 in the first, step 3's alone in the summary.
    per_step = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in per_step] == [2, 3] and per_step[-1]["reward"] == summary["reward"]


def test_no_window_left_means_the_plain_summary(tmp_path):
    trainer = trainer_for(tmp_path, args=config(tmp_path, max_steps=2, logging_steps=1))
    trainer.train()
    assert "reward" not in trainer.state.log_history[-1]


def test_trls_public_attributes(tmp_path):
    from grpokit.rewards.model import RewardModel

    trainer = trainer_for(
        tmp_path, args=config(tmp_path, beta=0.04, use_adaptive_entropy=True, entropy_coef=0.01, max_steps=2)
    )
    assert trainer.ref_model is not None and trainer.ref_model is trainer.reference
    assert trainer.reward_funcs == [repeat_letter] and trainer.reward_func_names == ["repeat_letter"]
    assert trainer.reward_processing_classes == [None]
    assert torch.equal(trainer.reward_weights, torch.tensor([1.0]))
    assert trainer.aux_loss_enabled is False and trainer.num_generations == 4
    assert trainer.model is not None and trainer.processing_class is not None and trainer.accelerator is not None
    first = trainer.entropy_coef
    assert first == 0.01
    trainer.train()
    assert trainer.entropy_coef == trainer.entropy_controller.coef != first  # the adaptive coefficient moved
    plain = trainer_for(tmp_path / "plain")
    assert plain.ref_model is None and plain.entropy_coef == plain.args.entropy_coef  # beta = 0: no reference
    assert RewardModel  # a reward model's processing class is its tokenizer: tests/test_rewards.py builds one


def test_the_static_helpers_equal_trls(tmp_path):
    import trl

    torch.manual_seed(0)
    entropies, mask = torch.rand(4, 6) * 3, (torch.rand(4, 6) > 0.3).long()
    trainer = trainer_for(tmp_path)
    for threshold in (0.0, 0.2, 0.5, 0.9):
        ours = trainer.get_high_entropy_mask(entropies, mask, threshold)
        theirs = trl.GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold)  # reads .accelerator
        assert torch.equal(ours, theirs) and ours.dtype == torch.bool
    advantages = torch.tensor([[1.0], [-1.0], [-0.5], [0.0]])
    logps, sampling = -torch.rand(4, 6), -torch.rand(4, 6)
    sampling[2, 1] = float("nan")
    for threshold in (0.0, 0.1, 1.0):
        assert torch.equal(
            GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask.float(), threshold),
            trl.GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask.float(), threshold),
        )


def test_compute_loss_training_step_and_log_are_hooks_the_loop_calls(tmp_path):
    calls = {"training_step": 0, "log": []}

    class Frozen(GRPOTrainer):  # a subclass whose loss carries no gradient: the weights must not move
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 0.0 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def training_step(self, model, inputs, num_items_in_batch=None):
            calls["training_step"] += 1
            return super().training_step(model, inputs, num_items_in_batch)

        def log(self, logs, start_time=None):
            calls["log"].append(sorted(logs))
            super().log({**logs, "seen_by_subclass": 1.0}, start_time)

    model, tokenizer = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Frozen(
        model=model,
        reward_funcs=repeat_letter,
        processing_class=tokenizer,
        train_dataset=letters(),
        args=config(tmp_path, max_steps=2, gradient_accumulation_steps=2, steps_per_generation=2, weight_decay=0.0),
    )
    trainer.train()
    assert calls["training_step"] == 4  # 2 steps x 2 micro-batches
    assert all(torch.equal(before[k], v) for k, v in trainer.unwrapped_model.state_dict().items())
    assert len(calls["log"]) == 3 and "train_runtime" in calls["log"][-1]  # two step records and the summary
    assert all(r.get("seen_by_subclass") == 1.0 for r in trainer.state.log_history)
    with pytest.raises(ValueError, match="does not support returning outputs"):
        trainer.compute_loss(trainer.model, trainer.generate_batch(), return_outputs=True)


# ------------------------------------------------------------------------------- issue 38, items 3 to 9


def test_defaults_are_trls_but_the_listed_ones(tmp_path):
    """Item 3. Every GRPOConfig default is TRL 1.16's (grpokit/trl_fields.json) except those listed with their reason
    in TRL_DEFAULT_DIFFERENCES and in the guide; `scripts/trl_fields.py --check` says so. TRL trains a VLM's vision
    tower, accepts top_entropy_quantile=0 (only the highest-entropy token) and divides bnpo's micro-batch token mean
    by the accumulation steps (grpo_trainer.py: `loss / self.current_gradient_accumulation_steps`)."""
    import importlib.util
    from pathlib import Path

    from grpokit.config import TRL_DEFAULT_DIFFERENCES
    from grpokit.loss import high_entropy_mask, policy_loss

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("trl_fields", root / "scripts" / "trl_fields.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    committed = json.loads(files("grpokit").joinpath("trl_fields.json").read_text())
    assert script.grpokit_default_differences(committed) == []
    changed = {**committed, "fields": {**committed["fields"], "beta": 0.5}}  # a default that would drift silently
    assert script.grpokit_default_differences(changed) == [
        "grpokit default differs: beta: TRL 0.5, grpokit 0.0 (make it TRL's, or list it with its reason in "
        "grpokit.config.TRL_DEFAULT_DIFFERENCES)"
    ]
    guide = (root / "docs" / "guides" / "from-trl.md").read_text()
    assert all(f"| `{name}` |" in guide for name in TRL_DEFAULT_DIFFERENCES)
    assert GRPOConfig(output_dir=str(tmp_path)).freeze_vision_tower is False
    entropies, mask = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.2, 0.0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert config(tmp_path, top_entropy_quantile=0.0).top_entropy_quantile == 0.0
    assert high_entropy_mask(entropies, mask, 0.0).tolist() == [[0, 1, 0], [0, 0, 0]]
    # bnpo as TRL computes it for one of 2 accumulated micro-batches (on-policy, beta=0: per-token loss = -A)
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    advantages = torch.tensor([1.0, -0.5])
    loss, _ = policy_loss(logprobs, None, None, advantages, mask, loss_type="bnpo", num_micro_batches=2)
    per_token = -advantages[:, None].expand(2, 3)
    trl_loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0) / 2
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-7)


def test_advisories_go_through_the_logger_and_errors_carry_trls_phrases(tmp_path, caplog):
    """Item 4. TRL warns through its logger (`logger.warning`, grpo_trainer.py), so caplog and log handlers see it,
    and raises ValueError with phrases users match on; grpokit does both, TRL's words first, then its advice."""
    caplog.set_level("WARNING")
    logging.getLogger("grpokit").setLevel(logging.NOTSET)
    model, tokenizer = tiny()
    GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        train_dataset=letters(),
        processing_class=tokenizer,
        args=config(
            tmp_path, model_init_kwargs={"dtype": "float32"}, importance_sampling_level="sequence", loss_type="bnpo"
        ),
    )
    logged = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert (
        "grpokit.build",
        "WARNING",
        "You passed `model_init_kwargs` to the `GRPOConfig`, but your model is "
        "already instantiated. The `model_init_kwargs` will be ignored.",
    ) in logged  # TRL's sentence
    assert any(
        name == "grpokit.build"
        and "When using `importance_sampling_level='sequence'`, the `'bnpo'` loss sums per-token contributions"
        in message
        for name, _, message in logged
    )
    with pytest.raises(ValueError, match=r"generation_batch_size \(8\) must be divisible by num_generations \(3\)"):
        trainer_for(tmp_path, args=config(tmp_path, num_generations=3))
    for values, phrase in [
        ({"num_generations": 1}, "GRPO requires at least 2 generations per prompt"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size is not supported by GRPO"),
    ]:
        with pytest.raises(ValueError, match=phrase):
            config(tmp_path, **values)
    caplog.clear()
    try:  # log_level reaches grpokit's logger as it sets transformers' verbosity
        trainer_for(
            tmp_path, args=config(tmp_path, log_level="error", importance_sampling_level="sequence", loss_type="dapo")
        )
    finally:
        logging.getLogger("grpokit").setLevel(logging.NOTSET)
    assert "loss sums per-token" not in caplog.text


def test_iterable_datasets_are_configured_as_trl_does(tmp_path, caplog):
    """Item 7. TRL sets accelerate's dispatch_batches=False for any iterable train or eval set (True refused), and
    forces dataloader_num_workers=0 for an iterable train set with its logged warning; map-style keeps its workers."""
    rows = [{"prompt": f"{c}:", "letter": c} for c in LETTERS]
    args = config(tmp_path, dataloader_num_workers=2)
    trainer = trainer_for(tmp_path, train_dataset=stream(rows), args=args)
    assert trainer.args.dataloader_num_workers == 0
    assert trainer.args.accelerator_options()["dispatch_batches"] is False
    assert (
        "Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding the "
        "provided value (2)."
    ) in caplog.text
    trainer.train()
    assert trainer.state.global_step == 4
    kept = trainer_for(
        tmp_path / "eval", eval_dataset=stream(rows[:2]), args=config(tmp_path / "eval", dataloader_num_workers=2)
    )
    assert kept.args.dataloader_num_workers == 2 and kept.args.accelerator_options()["dispatch_batches"] is False
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        trainer_for(
            tmp_path / "d",
            train_dataset=stream(rows),
            args=config(tmp_path / "d", accelerator_config={"dispatch_batches": True}),
        )


def test_generation_kwargs_that_leave_sampling_as_it_is_pass(tmp_path):
    """Item 5. TRL hands generation_kwargs to transformers' GenerationConfig or vLLM's SamplingParams; the keys that do
    not change what is sampled pass (beam options without beams, output options, neutral penalties), the rest is
    refused by name (test above)."""
    options = {
        "num_beams": 1,
        "length_penalty": 2.0,
        "early_stopping": True,
        "num_return_sequences": 1,
        "use_cache": True,
        "output_scores": True,
        "return_dict_in_generate": True,
        "typical_p": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0,
        "min_new_tokens": 0,
        "bad_words_ids": None,
        "skip_special_tokens": False,
        "n": 1,
        "seed": None,
        "top_k": 5,
    }
    args = config(tmp_path, generation_kwargs=options, max_steps=1)
    assert args.top_k == 5
    trainer = trainer_for(tmp_path, args=args)
    trainer.train()
    assert trainer.state.global_step == 1
    with pytest.raises(ValueError, match="num_beams=True"):
        config(tmp_path, generation_kwargs={"num_beams": True})  # a bool is not the count 1


def test_use_liger_kernel_is_validated_as_trl_does(tmp_path, monkeypatch):
    """Item 8. With use_liger_kernel=True TRL refuses a PEFT adapter on lm_head and
    liger_kernel_config={"fused_linear_cross_entropy": True} (ValueError), and transformers' Trainer raises
    ImportError when liger-kernel is missing; grpokit refuses prompt learning too. It runs no Liger kernel (warned)."""
    import transformers.utils
    from peft import LoraConfig, PromptTuningConfig

    def build(peft_config=None, **values):
        model, tokenizer = tiny()
        return GRPOTrainer(
            model=model,
            reward_funcs=repeat_letter,
            train_dataset=letters(),
            processing_class=tokenizer,
            args=config(tmp_path, use_liger_kernel=True, **values),
            peft_config=peft_config,
        )

    with pytest.warns(UserWarning, match="use_liger_kernel"):  # not implemented: warned by name at config time
        config(tmp_path, use_liger_kernel=True)
    with pytest.raises(ValueError, match="Applying a PEFT adapter to `lm_head` is not supported"):
        build(LoraConfig(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="not supported with prompt-learning"):  # TRL's test matches "prompt-learning"
        build(PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    with pytest.raises(ValueError, match='liger_kernel_config=\\{"fused_linear_cross_entropy": True\\}` is not'):
        build(liger_kernel_config={"fused_linear_cross_entropy": True})
    monkeypatch.setattr(transformers.utils, "is_liger_kernel_available", lambda: False)
    with pytest.raises(ImportError, match="You have set `use_liger_kernel` to `True` but liger-kernel"):
        build(LoraConfig(target_modules=["q_proj"]))
    trainer_for(tmp_path / "off", peft_config=LoraConfig(target_modules=["q_proj", "lm_head"]))  # off: no check


def _trl_compute_loss(
    loss_type, logprobs, entropies, ref_logprobs, advantages, mask, *, beta, entropy_coef, accumulation_steps=1
):
    """TRL 1.16's own `GRPOTrainer._compute_loss` on given log-probs and entropies (a stub `self` supplies what it
    reads: the config values, a one-process accelerator, the forward's output)."""
    from collections import defaultdict
    from types import SimpleNamespace

    import trl

    n, t = mask.shape
    one_process = SimpleNamespace(
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction: x,
        num_processes=1,
        sync_gradients=True,
    )
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, entropies, None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        use_vllm=False,
        aux_loss_enabled=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation_steps,
        max_completion_length=t,
        _entropy_bonus_enabled=entropy_coef != 0,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
        accelerator=one_process,
        _metrics=defaultdict(lambda: defaultdict(list)),
        get_gamma_weights=trl.GRPOTrainer.get_gamma_weights,
        args=SimpleNamespace(
            use_bias_correction_kl=True,
            delta=None,
            steps_per_generation=accumulation_steps,
            sapo_temperature_pos=1.0,
            sapo_temperature_neg=1.05,
            vespo_k_pos=2.0,
            vespo_lambda_pos=3.0,
            vespo_k_neg=3.0,
            vespo_lambda_neg=2.0,
        ),
    )
    inputs = {
        "prompt_ids": torch.zeros(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.zeros(n, t, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "ref_per_token_logps": ref_logprobs,
        "num_items_in_batch": mask.sum(),
    }
    return trl.GRPOTrainer._compute_loss(stub, None, inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_a_batch_whose_completions_are_all_truncated_is_a_zero_gradient_step_as_in_trl(tmp_path, loss_type):
    """Item 9. With mask_truncated_completions, TRL zeroes the completion mask of truncated completions; when all
    are, its loss (policy term, beta·KL added before the mask, and the entropy bonus over the same mask) is 0 with a
    zero gradient — no term still pushes — and transformers' Trainer still takes the optimizer step (the schedule
    advances, Adam's momentum from earlier steps still moves the weights). grpokit matches both."""
    from grpokit.loss import policy_loss

    torch.manual_seed(0)
    mask = torch.zeros(4, 5)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    ref_logprobs = -torch.rand(4, 5)
    grads = []
    for ours in (False, True):
        logprobs = (-torch.rand(4, 5, generator=torch.Generator().manual_seed(1))).requires_grad_()
        entropies = (torch.rand(4, 5, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_()
        if ours:
            loss, _ = policy_loss(
                logprobs,
                None,
                ref_logprobs,
                advantages,
                mask,
                loss_type=loss_type,
                beta=0.04,
                epsilon=0.2,
                epsilon_high=0.28,
                use_bias_correction_kl=True,
                entropies=entropies,
                entropy_coef=0.1,
                entropy_normalization="token_mean",
                importance_sampling_level="token",
            )
        else:
            loss = _trl_compute_loss(
                loss_type, logprobs, entropies, ref_logprobs, advantages, mask, beta=0.04, entropy_coef=0.1
            )
        loss.backward()
        assert loss.item() == 0.0
        grads.append((logprobs.grad, entropies.grad))
    for trl_grad, our_grad in zip(*grads):
        assert torch.equal(trl_grad, our_grad) and not trl_grad.any()
    if loss_type != "grpo":
        return
    # The run: at max_completion_length=1 the steps whose completions are all cut are zero-gradient steps that still
    # count, as transformers' Trainer takes them.
    trainer = trainer_for(
        tmp_path,
        args=config(
            tmp_path, max_completion_length=1, mask_truncated_completions=True, max_steps=3, beta=0.1, entropy_coef=0.1
        ),
    )
    trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert trainer.state.global_step == 3 and [r["step"] for r in records] == [1, 2, 3]
    truncated = [r for r in records if r["completions/clipped_ratio"] == 1.0]
    assert truncated and all(r["loss"] == 0.0 and r["grad_norm"] == 0.0 for r in truncated)
    assert len({r["learning_rate"] for r in records}) == 3  # the schedule advanced on every step


def test_bnpo_equals_trls_compute_loss_under_accumulation():
    """Item 3, against TRL's own code: one of 2 accumulated micro-batches, with beta and an entropy bonus."""
    from grpokit.loss import policy_loss

    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    advantages, ref_logprobs = torch.randn(4, generator=gen), -torch.rand(4, 6, generator=gen)
    results = []
    for ours in (False, True):
        logprobs = (-torch.rand(4, 6, generator=torch.Generator().manual_seed(1))).requires_grad_()
        entropies = (torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_()
        if ours:
            loss, _ = policy_loss(
                logprobs,
                None,
                ref_logprobs,
                advantages,
                mask,
                loss_type="bnpo",
                beta=0.04,
                epsilon=0.2,
                epsilon_high=0.28,
                use_bias_correction_kl=True,
                entropies=entropies,
                entropy_coef=0.1,
                entropy_normalization="token_mean",
                num_micro_batches=2,
            )
        else:
            loss = _trl_compute_loss(
                "bnpo",
                logprobs,
                entropies,
                ref_logprobs,
                advantages,
                mask,
                beta=0.04,
                entropy_coef=0.1,
                accumulation_steps=2,
            )
        loss.backward()
        results.append((loss.detach(), logprobs.grad, entropies.grad))
    for theirs, ours in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_a_dataset_of_environment_names_only_and_tool_metrics_without_calls(tmp_path):
    """Item 6, as TRL 1.16 does: a routing dataset with only an `environment` column works (the prompt
    defaults to an empty user message that reset()'s observation fills; reset gets no routing column), the
    environment-owned reward is in reward_func_names under its class name, and tools/call_frequency and
    tools/failure_frequency are logged at every logging step, 0 when the model made no call."""
    from agents_helpers import tiny_agent_model, tool_call_script

    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(tokenizer, lambda user, results, index: "done<|im_end|>")  # never calls a tool

    from test_environments import Counter

    class Riddles(Counter):
        def reset(self, **row):
            super().reset(**row)
            return "key k7"

        def get_reward(self) -> float:
            return 0.5

    rows = [{"environment": "riddles"}, {"environment": "counter"}]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=config(
            tmp_path,
            per_device_train_batch_size=4,
            num_generations=2,
            max_steps=2,
            max_completion_length=64,
            learning_rate=1e-3,
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        environment_factory={"riddles": Riddles, "counter": Counter},
        rollout_engine=engine,
    )
    assert trainer.reward_func_names == ["<lambda>", "Riddles"]  # TRL: the environment's class name, after reward_funcs
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(c.row == {} for pool in trainer.agents.environments.pool.values() for c in pool)
    prompts = [tokenizer.decode(ids) for ids in engine.calls[0].ids]
    assert any(p.endswith("<|im_start|>user\nkey k7<|im_end|>\n<|im_start|>assistant\n") for p in prompts)
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(records) == 2
    for record in records:
        assert record["tools/call_frequency"] == 0.0 and record["tools/failure_frequency"] == 0.0
        assert record["rewards/Riddles/mean"] == 0.5


# ---------------------------------------------------------------------------- compute_loss on TRL's dict


def trl_inputs(batch: TrainBatch, num_items_in_batch: torch.Tensor) -> dict:
    """A micro-batch in the layout of TRL 1.16's `_generate_and_score_completions` output."""
    return {
        "prompt_ids": batch.prompt_ids,
        "prompt_mask": batch.prompt_mask,
        "completion_ids": batch.completion_ids,
        "completion_mask": batch.attention_mask,
        "advantages": batch.advantages[:, 0],
        "num_items_in_batch": num_items_in_batch,
        "old_per_token_logps": batch.old_logprobs,
        "ref_per_token_logps": batch.ref_logprobs,
    }


@pytest.mark.parametrize("training", [True, False])
def test_compute_loss_takes_trls_dict_and_gives_trls_loss(tmp_path, training):
    """TRL's tests and subclasses call compute_loss(model, inputs) with TRL's dict: grpokit's gives the loss of TRL
    1.16's own compute_loss on the same dict and weights (π_old and π_ref away from the policy, μ = 2, 2 accumulation
    steps, 4 micro-batches per generation batch), and the loss of the same rows as a TrainBatch with those counts."""
    trl = pytest.importorskip("trl")
    from grpokit.batch import trl_loss_counts
    from grpokit.testing import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "tiny", chars=LETTERS + ":", hidden_size=32))
    values = dict(
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=3,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_iterations=2,
        beta=0.04,
        bf16=False,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        epsilon_high=0.28,
    )
    ours = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letters(),
        args=GRPOConfig(output_dir=str(tmp_path / "ours"), **values),
    )
    theirs = trl.GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letters(),
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, **values),
    )
    generation = ours.generate_batch()
    assert generation.old_logprobs is not None and generation.ref_logprobs is not None
    with torch.no_grad():  # the same step away from π_old on both policies: ratios other than 1, some clipped
        for model in (ours.unwrapped_model, theirs.model):
            generator = torch.Generator().manual_seed(1)
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    for model in (ours.model, theirs.model):
        model.train(training)
    theirs.current_gradient_accumulation_steps = values["gradient_accumulation_steps"]  # set by TRL's loop
    micro_batch = generation.split(4)[1]
    inputs = trl_inputs(micro_batch, generation.loss_mask.sum())
    losses = []
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo"):
        ours.args.loss_type = theirs.loss_type = loss_type
        expected = theirs.compute_loss(theirs.model, dict(inputs))
        losses.append(expected.item())
        loss = ours.compute_loss(ours.model, dict(inputs))
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7, msg=loss_type)
        accumulation, steps = (2, 4) if training else (1, 1)
        counts = trl_loss_counts(micro_batch, inputs["num_items_in_batch"], accumulation, steps, 1)
        as_batch = ours.compute_loss(ours.model, micro_batch, num_items_in_batch=counts)
        torch.testing.assert_close(as_batch, loss, rtol=1e-6, atol=1e-8, msg=loss_type)
    # four normalisations, told apart (cispo's value is dapo's while no weight reaches its cap; its gradient is not)
    assert len({round(value, 6) for value in losses[:4]}) == 4, losses
    with pytest.raises(ValueError, match=r"without \['advantages'\]"):
        ours.compute_loss(ours.model, {k: v for k, v in inputs.items() if k != "advantages"})


def test_a_hub_id_in_the_local_cache_loads_offline(tmp_path, monkeypatch):
    # TRL's tests (and offline clusters) load "org/name" from a pre-filled Hugging Face cache with HF_HUB_OFFLINE=1,
    # as from_pretrained does; grpokit refused every such id before looking in the cache.
    import huggingface_hub.constants

    from grpokit.models import check_model_source

    model, tokenizer = tiny()
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    model.save_pretrained(repo / "snapshots" / "abc123")
    tokenizer.save_pretrained(repo / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    trainer = GRPOTrainer(model="org/tiny", reward_funcs=repeat_letter, args=config(tmp_path), train_dataset=letters())
    assert trainer.model.config.vocab_size == model.config.vocab_size
    assert trainer.processing_class.get_vocab() == tokenizer.get_vocab()
    with pytest.raises(FileNotFoundError, match="nor is it in the Hugging Face cache"):
        check_model_source("org/missing")


def test_with_neither_data_nor_reward_the_reward_is_named_first_as_in_trl(tmp_path):
    # TRL builds the reward functions before it looks at the data: with both missing its message is the reward's.
    model, tokenizer = tiny()
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=model, processing_class=tokenizer, args=config(tmp_path))
    with pytest.raises(ValueError, match="`train_dataset` is required unless an `environment_factory` is provided"):
        GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=repeat_letter, args=config(tmp_path))
    with pytest.raises(ValueError, match="needs column"):  # the columns are still checked, after the data
        GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=repeat_letter,
            args=config(tmp_path),
            train_dataset=Dataset.from_list([{"prompt": "a:"}] * 8),
        )
