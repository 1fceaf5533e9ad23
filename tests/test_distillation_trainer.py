"""DistillationTrainer (grpokit.distill_trainer) on tiny random-weight models: a TRL 1.16 distillation script with
only the import changed, the trainer's loss against `loss.distillation_loss` on the models' full logits, the
tokenizer check, and checkpoints / resume on the GRPO loop."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from letters import LETTERS, letter_config, letter_dataset, repeat_letter, tiny_letter_model
from transformers import TrainerCallback

from grpokit import DistillationConfig, DistillationTrainer, GRPOTrainer, TrainBatch
from grpokit.distillation_config import DistillationLoopConfig
from grpokit.loss import distillation_loss
from grpokit.testing import build_char_tokenizer, build_tiny_model, save_tiny_model

CHARS = LETTERS + ":"


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("student") / "tiny", chars=CHARS, hidden_size=32, seed=0))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    # Another size and depth than the student: only the tokenizer must be shared.
    return str(
        save_tiny_model(tmp_path_factory.mktemp("teacher") / "tiny", chars=CHARS, hidden_size=48, num_layers=3, seed=1)
    )


def config(tmp_path, **overrides) -> DistillationConfig:
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        max_completion_length=3,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
        gradient_checkpointing=False,
        optim="adamw_torch",
        seed=0,
    )
    return DistillationConfig(**{**values, **overrides})


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}


# ------------------------------------------------------------------------------------------ the TRL script

TRL_SCRIPT = """
from datasets import Dataset

from grpokit import DistillationConfig, DistillationTrainer  # was: from trl import DistillationConfig, ...

dataset = Dataset.from_list([{{"prompt": c + ":"}} for c in "abcdefgh"] * 2)
training_args = DistillationConfig(
    output_dir={output_dir!r},
    teacher_model_name_or_path={teacher!r},
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_completion_length=3,
    max_steps=2,
    logging_steps=1,
    save_steps=2,
    beta=0.5,
    use_cpu=True,  # TRL's bf16 default on a CPU needs it
)
training_args.model_init_kwargs = dict(revision=None, trust_remote_code=False, attn_implementation=None, dtype=None)
training_args.teacher_model_init_kwargs = dict(revision=None, trust_remote_code=False, attn_implementation=None,
                                               dtype="bfloat16")
trainer = DistillationTrainer(
    model={student!r},
    teacher_model=training_args.teacher_model_name_or_path,
    args=training_args,
    train_dataset=dataset,
    eval_dataset=None,
    quantization_config=None,
    peft_config=None,
)
trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
trainer.accelerator.print("Training completed.")
trainer.save_model(training_args.output_dir)
"""


def run_script(student_dir, teacher_dir, output_dir, library: str = "grpokit"):
    script = TRL_SCRIPT.format(output_dir=str(output_dir), teacher=teacher_dir, student=student_dir)
    namespace = {}
    exec(compile(script.replace("from grpokit import", f"from {library} import"), "distillation.py", "exec"), namespace)
    return namespace["trainer"]


def test_a_trl_distillation_script_runs_with_only_the_import_changed(student_dir, teacher_dir, tmp_path):
    # TRL's defaults otherwise (bf16 autocast, gradient checkpointing, fused AdamW), as in trl/scripts/distillation.py,
    # with a bfloat16 teacher of another size beside the float32 student.
    trainer = run_script(student_dir, teacher_dir, tmp_path / "out")
    assert trainer.teacher_model.dtype == torch.bfloat16 and not trainer.teacher_model.training
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    records = trainer.state.log_history[:-1]
    assert len(records) == 2
    for record in records:  # TRL's names
        assert {
            "loss",
            "grad_norm",
            "learning_rate",
            "entropy",
            "num_tokens",
            "step_time",
            "completions/mean_length",
            "completions/clipped_ratio",
            "completions/min_terminated_length",
        } <= set(record), record
        assert record["loss"] > 0 and torch.isfinite(torch.tensor(record["loss"]))
        assert not any(key.startswith("reward") for key in record)  # nothing scores the completions
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    assert (tmp_path / "out" / "model.safetensors").is_file()
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"on-policy distillation against the teacher **{teacher_dir}**" in card and "| `beta` | 0.5 |" in card
    assert "Reward functions" not in card and "## Final training metrics (step 2)" in card

    # The same script under TRL 1.16: every metric name it logs, grpokit logs.
    trl_trainer = run_script(student_dir, teacher_dir, tmp_path / "trl", library="trl")
    for ours, theirs in zip(records, trl_trainer.state.log_history[:-1]):
        assert set(theirs) <= set(ours), set(theirs) - set(ours)


READ_THE_DATALOADER = """dataloader = trainer.get_train_dataloader()
first = next(iter(dataloader))
batching = {"rows per batch": dataloader.batch_sampler.batch_size, "batch_size": dataloader.batch_size,
            "num_workers": dataloader.num_workers, "persistent_workers": dataloader.persistent_workers,
            "batches per epoch": len(dataloader), "first batch": [row["prompt"] for row in first]}
trainer.train("""


def test_a_trl_distillation_script_reading_the_train_dataloader_runs_with_only_the_import_changed(
    student_dir, teacher_dir, tmp_path
):
    """TRL's script, reading `trainer.get_train_dataloader()` before training: under grpokit it trains, and the
    batching is TRL 1.16's (one process; the epoch's seeded order too)."""
    pytest.importorskip("trl")
    runs = {}
    for library in ("trl", "grpokit"):
        script = TRL_SCRIPT.format(output_dir=str(tmp_path / library), teacher=teacher_dir, student=student_dir)
        script = script.replace("trainer.train(", READ_THE_DATALOADER).replace(
            "from grpokit import", f"from {library} import"
        )
        runs[library] = {}
        exec(compile(script, "distillation.py", "exec"), runs[library])
    assert runs["grpokit"]["trainer"].state.global_step == 2
    batching = runs["grpokit"]["batching"]
    assert batching == runs["trl"]["batching"]
    # 4 prompts x gradient_accumulation_steps 2 a batch, no repeats (num_generations 1); 16 prompts: 2 generation
    # batches, each twice (once per micro-batch of the window)
    assert (batching["rows per batch"], batching["batch_size"], batching["batches per epoch"]) == (8, None, 4)


def test_the_loop_config_is_trls_distillation_batching():
    args = loop_config_of(
        DistillationConfig(output_dir="x", per_device_train_batch_size=4, gradient_accumulation_steps=3, beta=0.5)
    )
    assert isinstance(args, DistillationLoopConfig)
    assert (
        args.num_generations,
        args.num_iterations,
        args.steps_per_generation,
        args.generation_batch_size,
        args.beta,
    ) == (1, 1, 3, 12, 0.0)


def loop_config_of(distillation_config):
    from grpokit.distillation_config import loop_config

    return loop_config(distillation_config)


def test_a_teacher_is_required(student_dir, tmp_path):
    with pytest.raises(ValueError, match="needs a teacher"):
        DistillationTrainer(student_dir, args=config(tmp_path), train_dataset=letter_dataset(1))


# ------------------------------------------------------------------------------------------------- the loss


def fixed_batch(tokenizer, generator) -> TrainBatch:
    """Four rows: left-padded prompts, completions of 5, 3, 5 and 1 real tokens, and in row 0 a 2-token tool span
    (loss_mask 0 where attention_mask is 1)."""
    vocab = len(tokenizer)
    prompt_ids = torch.randint(7, vocab, (4, 3), generator=generator)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    prompt_ids[prompt_mask == 0] = tokenizer.pad_token_id
    lengths = torch.tensor([5, 3, 5, 1])
    attention_mask = (torch.arange(5)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(7, vocab, (4, 5), generator=generator)
    completion_ids[attention_mask == 0] = tokenizer.pad_token_id
    loss_mask = attention_mask.clone()
    loss_mask[0, 1:3] = 0  # a tool's output, inserted into the completion
    return TrainBatch(
        prompt_ids, prompt_mask, completion_ids, attention_mask, loss_mask.float(), lengths, torch.zeros(4, 5)
    )


def full_logits(model, batch: TrainBatch) -> torch.Tensor:
    """The model's own logits at the positions that predict the completion tokens [N, T, V]."""
    from grpokit.forward import position_ids_from_mask

    mask = batch.input_mask
    logits = model(batch.input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    return logits[:, batch.prompt_ids.shape[1] - 1 : -1]


def test_compute_loss_takes_trls_dict_and_its_num_items_in_batch(tmp_path):
    # TRL's test_loss_normalizes_by_num_items_in_batch calls compute_loss with a dict in GRPO's key layout and a
    # token count (HF Trainer's num_items_in_batch): the divergence summed over that many tokens, None: a mean.
    tokenizer = build_char_tokenizer(CHARS)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    student = build_tiny_model(len(tokenizer), hidden_size=32, seed=0, **ids)
    teacher = build_tiny_model(len(tokenizer), hidden_size=48, num_layers=3, seed=1, **ids)
    trainer = DistillationTrainer(
        student, teacher, args=config(tmp_path), train_dataset=letter_dataset(1), processing_class=tokenizer
    )
    batch = fixed_batch(tokenizer, torch.Generator().manual_seed(0))
    batch.loss_mask = batch.attention_mask.float()  # TRL's dict has one mask for both
    trl_inputs = dict(
        prompt_ids=batch.prompt_ids,
        prompt_mask=batch.prompt_mask,
        completion_ids=batch.completion_ids,
        completion_mask=batch.attention_mask,
    )
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, batch, num_items_in_batch=(4, 14.0, 1))  # 14 real tokens
        mean = trainer.compute_loss(trainer.model, trl_inputs)
        over_28 = trainer.compute_loss(trainer.model, trl_inputs, num_items_in_batch=torch.tensor(28))
    assert expected.item() > 1e-3
    assert mean.item() == pytest.approx(expected.item(), rel=1e-6)
    assert over_28.item() == pytest.approx(expected.item() / 2, rel=1e-6)
    with pytest.raises(ValueError, match="completion_mask"):
        trainer.compute_loss(trainer.model, {"prompt_ids": batch.prompt_ids})


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_trainers_loss_is_distillation_loss_on_full_logits(tmp_path, beta, temperature):
    tokenizer = build_char_tokenizer(CHARS)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    student = build_tiny_model(len(tokenizer), hidden_size=32, seed=0, **ids)
    teacher = build_tiny_model(len(tokenizer), hidden_size=48, num_layers=3, seed=1, **ids)
    trainer = DistillationTrainer(
        student,
        teacher,
        args=config(tmp_path, beta=beta, temperature=temperature),
        train_dataset=letter_dataset(1),
        processing_class=tokenizer,
    )
    batch = fixed_batch(tokenizer, torch.Generator().manual_seed(0))
    window_tokens = 25.0  # this micro-batch's 12 loss tokens are part of a larger window
    loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=(8, window_tokens, 2))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()

    with torch.no_grad():
        teacher_logits = full_logits(trainer.teacher_model, batch)
    expected, stats = distillation_loss(
        full_logits(trainer.model, batch),
        teacher_logits,
        batch.loss_mask,
        beta=beta,
        temperature=temperature,
        num_tokens=window_tokens,
    )
    expected.backward()
    assert expected.item() > 1e-3  # two different models: a loss to compare
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5, rel=0)
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    trainer.optimizer_step([batch])  # the public seam: the step logs the micro-batch's entropy (a token mean)
    assert trainer.window.flush()["entropy"] == pytest.approx(stats.as_dict()["entropy"], abs=1e-5)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
def test_a_teacher_of_another_architecture_and_dtype(tmp_path, dtype, tolerance):
    # A Llama teacher (other architecture, its own hidden size) for a Qwen2 student, in float32 or bfloat16; the
    # reference takes the bfloat16 teacher's own logits, in float32 from there on.
    from grpokit.testing import build_tiny_model_of_type

    tokenizer = build_char_tokenizer(CHARS)
    student = build_tiny_model(
        len(tokenizer), hidden_size=32, seed=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    teacher = build_tiny_model_of_type("llama", num_layers=2, vocab_size=len(tokenizer), seed=3).to(dtype)
    trainer = DistillationTrainer(
        student, teacher, args=config(tmp_path, beta=0.5), train_dataset=letter_dataset(1), processing_class=tokenizer
    )
    batch = fixed_batch(tokenizer, torch.Generator().manual_seed(2))
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        teacher_logits = full_logits(trainer.teacher_model, batch).float()
        expected, _ = distillation_loss(full_logits(trainer.model, batch), teacher_logits, batch.loss_mask, beta=0.5)
    assert type(trainer.teacher_model).__name__ == "LlamaForCausalLM" and trainer.teacher_model.dtype == dtype
    assert expected.item() > 1e-3
    assert loss.item() == pytest.approx(expected.item(), abs=tolerance, rel=0)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_teacher_equal_to_student_gives_zero_loss_and_gradient(tmp_path, beta):
    tokenizer = build_char_tokenizer(CHARS)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    student = build_tiny_model(len(tokenizer), hidden_size=32, seed=0, **ids)
    teacher = build_tiny_model(len(tokenizer), hidden_size=32, seed=0, **ids)
    trainer = DistillationTrainer(
        student, teacher, args=config(tmp_path, beta=beta), train_dataset=letter_dataset(1), processing_class=tokenizer
    )
    loss = trainer.compute_loss(trainer.model, fixed_batch(tokenizer, torch.Generator().manual_seed(1)))
    loss.backward()
    assert abs(loss.item()) < 1e-6
    assert max(p.grad.abs().max().item() for p in trainer.model.parameters() if p.grad is not None) < 1e-6


def test_gradient_accumulation_does_not_change_the_update(student_dir, teacher_dir, tmp_path):
    # One generation batch of 8 completions (the same seed, so the same completions), trained as one micro-batch
    # of 8 or two of 4: each is normalised by the window's tokens, so the update is the same. With adam_epsilon >>
    # |g| the first AdamW step is lr * g / adam_epsilon = g: the update is the gradient.
    common = dict(max_steps=1, max_grad_norm=0.0, learning_rate=1e6, adam_epsilon=1e6)
    runs = []
    for name, batch_size, accumulation in (("one", 8, 1), ("two", 4, 2)):
        args = config(
            tmp_path / name, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation, **common
        )
        runs.append(DistillationTrainer(student_dir, teacher_dir, args=args, train_dataset=letter_dataset(1)))
    before = weights(runs[0])
    for run in runs:
        run.train()
    w1, w2 = weights(runs[0]), weights(runs[1])
    assert runs[0].state.log_history[0]["loss"] == pytest.approx(runs[1].state.log_history[0]["loss"], abs=1e-7)
    moved = max((w1[k] - before[k]).abs().max().item() for k in w1)
    assert moved > 1e-3
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5 * moved


def test_a_lora_student_trains_its_adapter_only(student_dir, teacher_dir, tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = DistillationTrainer(
        student_dir, teacher_dir, args=config(tmp_path, max_steps=2), train_dataset=letter_dataset(1), peft_config=lora
    )
    before = weights(trainer)
    trainer.train()
    after = weights(trainer)
    changed = {key for key in before if not torch.equal(before[key], after[key])}
    assert changed and all("lora_" in key for key in changed), sorted(changed)


# ---------------------------------------------------------------------------------------------- the teacher


def test_a_teacher_of_another_vocab_size_is_refused_in_trls_words(student_dir, tmp_path):
    other = save_tiny_model(tmp_path / "other", chars="abcdefghijk:", hidden_size=32, seed=1)
    with pytest.raises(
        ValueError,
        match=r"The student model has vocab_size 16 but the teacher model has vocab_size "
        "19. Distillation compares the teacher's full next-token distribution, "
        "which requires a shared vocabulary.*In grpokit: pick a teacher of the "
        "student's family",
    ):
        DistillationTrainer(student_dir, str(other), args=config(tmp_path), train_dataset=letter_dataset(1))


def test_a_teacher_with_another_tokenizer_of_the_same_size_is_refused(student_dir, tmp_path):
    other = save_tiny_model(tmp_path / "other", chars="abcdefgi:", hidden_size=32, seed=1)  # 'i' in place of 'h'
    with pytest.raises(
        ValueError, match="teacher's tokenizer differs from the student's: 1 token only in the student's: 'h'"
    ):
        DistillationTrainer(student_dir, str(other), args=config(tmp_path), train_dataset=letter_dataset(1))


def test_a_teacher_folder_whose_tokenizer_reloads_with_a_class_default_trains_as_the_student_tokenizer(tmp_path):
    # The teacher's folder holds the student's tokenizer saved without an unk token under Qwen2's tokenizer class:
    # AutoTokenizer reloads it with the class's default unk '<|endoftext|>' added after the last id. Scoring needs
    # none of that token (TRL accepts this teacher); the run is the one with the teacher's folder left as saved.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = build_char_tokenizer(CHARS)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    teacher = build_tiny_model(len(tokenizer), hidden_size=48, num_layers=2, seed=1, **ids)
    as_saved, reloads_otherwise = tmp_path / "as_saved", tmp_path / "reloads_otherwise"
    for folder in (as_saved, reloads_otherwise):
        teacher.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    tokenizer_config = json.loads((reloads_otherwise / "tokenizer_config.json").read_text())
    del tokenizer_config["unk_token"]
    tokenizer_config["tokenizer_class"] = "Qwen2Tokenizer"
    (reloads_otherwise / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    reloaded = AutoTokenizer.from_pretrained(reloads_otherwise)
    assert len(reloaded) == len(tokenizer) + 1 and reloaded.unk_token == "<|endoftext|>"  # the case at hand

    runs = []
    for folder in (as_saved, reloads_otherwise):
        student = build_tiny_model(len(tokenizer), hidden_size=32, seed=0, **ids)
        trainer = DistillationTrainer(
            student,
            AutoModelForCausalLM.from_pretrained(folder),
            args=config(tmp_path / folder.name, max_steps=2),
            train_dataset=letter_dataset(1),
            processing_class=tokenizer,
        )
        trainer.train()
        runs.append(trainer)
    losses = [[record["loss"] for record in run.state.log_history[:-1]] for run in runs]
    assert len(losses[0]) == 2 and losses[0][0] > 0
    assert losses[0] == losses[1]
    first, second = weights(runs[0]), weights(runs[1])
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_teacher_init_kwargs_with_a_teacher_object_are_refused_as_in_trl(student_dir, teacher_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    args = config(tmp_path, teacher_model_init_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="already instantiated"):
        DistillationTrainer(student_dir, teacher, args=args, train_dataset=letter_dataset(1))


# ------------------------------------------------------------------------------------ checkpoints, resume


def test_resume_continues_to_the_same_weights(student_dir, teacher_dir, tmp_path):
    # Unbroken run of 4 steps vs a run stopped at 2 (checkpoint) and resumed to 4: bitwise the same on CPU. Two
    # micro-batches per step, so the window's token count normalises the loss.
    args = dict(
        max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2
    )
    dataset = letter_dataset(2)
    full = DistillationTrainer(student_dir, teacher_dir, args=config(tmp_path / "full", **args), train_dataset=dataset)
    full.train()
    first = DistillationTrainer(
        student_dir, teacher_dir, args=config(tmp_path / "split", **{**args, "max_steps": 2}), train_dataset=dataset
    )
    first.train()
    assert (tmp_path / "split" / "out" / "checkpoint-2").is_dir()
    resumed = DistillationTrainer(
        student_dir, teacher_dir, args=config(tmp_path / "split", **args), train_dataset=dataset
    )
    resumed.train(resume_from_checkpoint=True)
    a, b = weights(full), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [e["loss"] for e in full.state.log_history[:-1]] == [e["loss"] for e in resumed.state.log_history[:-1]]
    saved = json.loads((tmp_path / "split" / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["global_step"] == 4
    # the run's configuration and progress bar are the distillation's, not GRPO's; the report and eval find it
    from grpokit.cli import run_config_of
    from grpokit.report import load_run

    out = tmp_path / "split" / "out"
    assert (out / "distillation_config.json").is_file() and not (out / "grpo_config.json").exists()
    assert resumed.progress_label == "Distillation" and run_config_of(str(out)) == out / "distillation_config.json"
    assert load_run(out).config["max_steps"] == 4


def test_logged_completions_have_no_reward_columns(student_dir, teacher_dir, tmp_path):
    args = config(tmp_path, max_steps=1, log_completions=True, num_completions_to_print=2)
    DistillationTrainer(student_dir, teacher_dir, args=args, train_dataset=letter_dataset(1)).train()
    rows = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and set(rows[0]) == {"step", "prompt", "completion"}


def test_a_prompt_only_dataset_needs_no_reward_columns(student_dir, teacher_dir, tmp_path):
    dataset = Dataset.from_list([{"prompt": f"{c}:"} for c in LETTERS])
    trainer = DistillationTrainer(student_dir, teacher_dir, args=config(tmp_path, max_steps=1), train_dataset=dataset)
    trainer.train()
    assert trainer.reward_funcs == [] and trainer.ref_model is None


# ---------------------------------------------------------------------------------------------- evaluation


def test_evaluation_logs_trls_eval_loss_and_is_repeatable(student_dir, teacher_dir, tmp_path):
    args = config(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    trainer = DistillationTrainer(
        student_dir, teacher_dir, args=args, train_dataset=letter_dataset(1), eval_dataset=letter_dataset(1)
    )
    trainer.train()
    logged = next(record for record in trainer.state.log_history if "eval_loss" in record)
    assert logged["step"] == 2 and logged["eval_loss"] > 0
    assert {"eval_entropy", "eval_completions/mean_length", "eval_completions/clipped_ratio"} <= set(logged)
    again = trainer.evaluate()
    assert again["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-6)  # the same completions
    assert trainer.model.training


def test_evaluation_against_itself_is_zero(student_dir, tmp_path):
    trainer = DistillationTrainer(
        student_dir,
        student_dir,
        args=config(tmp_path),
        train_dataset=letter_dataset(1),
        eval_dataset={"letters": letter_dataset(1)},
    )
    metrics = trainer.evaluate()
    assert abs(metrics["eval_letters_loss"]) < 1e-6 and metrics["eval_letters_entropy"] > 0


# ------------------------------------------------------------------------------------------------ learning


def expected_accuracy(model, tokenizer) -> float:
    """The letter task's expected reward at temperature 1, exactly: the mean over the prompts of the probability
    that the first completion token is the prompt's letter (no sampling noise)."""
    with torch.no_grad():
        ids = torch.tensor([tokenizer(f"{c}:")["input_ids"] for c in LETTERS])
        probs = model(ids).logits[:, -1].float().softmax(-1)
    letters = torch.tensor([tokenizer.convert_tokens_to_ids(c) for c in LETTERS])
    return probs[torch.arange(len(LETTERS)), letters].mean().item()


class StopAtAccuracy(TrainerCallback):
    """Records the accuracy after every optimizer step and stops training at the first step that reaches target."""

    def __init__(self, model, tokenizer, target: float):
        self.model, self.tokenizer, self.target = model, tokenizer, target
        self.reached_at, self.curve = None, []

    def on_step_end(self, args, state, control, **kwargs):
        self.curve.append(expected_accuracy(self.model, self.tokenizer))
        if self.curve[-1] >= self.target:
            self.reached_at, control.should_training_stop = state.global_step, True
        return control


@pytest.mark.slow
def test_a_distilled_student_reaches_the_teachers_accuracy_in_fewer_samples_than_grpo(tmp_path):
    # The teacher: 120 GRPO steps on the letter task (accuracy ~0.74). Then the same student initialisation twice,
    # 64 completions per optimizer step in both runs (distillation: 64 prompts x 1; GRPO: 8 prompts x 8), until
    # it reaches 90% of the teacher's accuracy. Seen on CPU: distillation at step 25 (1,600 completions), GRPO
    # from the rewards at step 53 (3,392).
    teacher, tokenizer = tiny_letter_model(seed=1)
    GRPOTrainer(
        teacher,
        repeat_letter,
        letter_config(tmp_path / "teacher", max_steps=120),
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
    ).train()
    target = 0.9 * expected_accuracy(teacher, tokenizer)
    assert target > 0.5

    student, _ = tiny_letter_model(seed=0)
    distilled = StopAtAccuracy(student, tokenizer, target)
    args = config(
        tmp_path / "distill", per_device_train_batch_size=64, max_completion_length=2, max_steps=120, logging_steps=100
    )
    DistillationTrainer(
        student, teacher, args=args, train_dataset=letter_dataset(), processing_class=tokenizer, callbacks=[distilled]
    ).train()

    student, _ = tiny_letter_model(seed=0)
    rewarded = StopAtAccuracy(student, tokenizer, target)
    GRPOTrainer(
        student,
        repeat_letter,
        letter_config(tmp_path / "grpo", max_steps=120, logging_steps=100),
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
        callbacks=[rewarded],
    ).train()

    assert distilled.curve[0] < 0.15 and rewarded.curve[0] < 0.15  # both start from the random policy
    assert distilled.reached_at is not None, distilled.curve
    # The same completions per step, so fewer steps is fewer samples; GRPO may not get there at all in 120.
    assert distilled.reached_at < (rewarded.reached_at or 121) / 1.5, (distilled.curve, rewarded.curve)


# ------------------------------------------------------------------------------------------ two processes

DDP_SCRIPT = """
import json, os, sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from grpokit import DistillationConfig, DistillationTrainer, TrainBatch

RANK = int(os.environ.get("RANK", 0))


def fixed_batch(model):
    # 16 rows, the same in every process: ragged completions, a 2-token tool span in every fourth row.
    tokenizer = AutoTokenizer.from_pretrained(model)
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.tensor(tokenizer(["ab:", "cd:", "ef:", "gh:"] * 4)["input_ids"])
    completion_ids = torch.randint(7, len(tokenizer), (16, 5), generator=generator)
    mask = (torch.arange(5) < torch.randint(1, 6, (16, 1), generator=generator)).long()
    loss_mask = mask.clone()
    loss_mask[::4, 1:3] = 0
    return TrainBatch(prompt_ids, torch.ones_like(prompt_ids), completion_ids, mask, loss_mask.float(),
                      mask.sum(-1), torch.zeros(16, 5))


def main(spec_path):
    for spec in json.loads(Path(spec_path).read_text()):
        out, batch = Path(spec["out"]), fixed_batch(spec["student"])
        args = DistillationConfig(output_dir=str(out), per_device_train_batch_size=spec["batch_size"],
                                  gradient_accumulation_steps=spec["accumulation"], max_steps=1, max_grad_norm=0.0,
                                  learning_rate=1e6, adam_epsilon=1e6, beta=0.5, bf16=False,
                                  gradient_checkpointing=False, optim="adamw_torch", logging_steps=1,
                                  save_strategy="no", disable_tqdm=True, max_completion_length=5)
        trainer = DistillationTrainer(spec["student"], spec["teacher"], args=args,
                                      train_dataset=Dataset.from_list([{"prompt": "ab:"}] * 16))
        rows = args.per_device_train_batch_size * args.gradient_accumulation_steps  # this process's share
        trainer.generate_batch = lambda: batch.select(slice(RANK * rows, (RANK + 1) * rows))
        trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}
        torch.save({"weights": weights, "loss": trainer.state.log_history[0]["loss"]}, out / f"rank{RANK}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_under_ddp_make_the_update_of_one(student_dir, teacher_dir, tmp_path):
    # The same 16 completions: 1 process x 16 rows against 2 processes x 8 (as 2 micro-batches of 4). With
    # adam_epsilon = learning_rate >> |g| the update is the gradient: any error in the normalisation over the
    # window's tokens of both processes, or a gradient DDP did not reduce, shows.
    from test_distributed import launch, load, max_difference, run_in_this_process

    job = dict(student=student_dir, teacher=teacher_dir)
    run_in_this_process(
        tmp_path, {**job, "out": str(tmp_path / "one"), "batch_size": 16, "accumulation": 1}, script=DDP_SCRIPT
    )
    launch(tmp_path, {**job, "out": str(tmp_path / "two"), "batch_size": 4, "accumulation": 2}, script=DDP_SCRIPT)
    one, rank0, rank1 = (load(tmp_path / name) for name in ("one/rank0.pt", "two/rank0.pt", "two/rank1.pt"))
    initial = weights_of(student_dir)
    moved = max_difference(one["weights"], initial)
    assert moved > 1e-3
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert max_difference(rank0["weights"], one["weights"]) < 1e-5 * moved
    assert rank0["loss"] == pytest.approx(one["loss"], abs=1e-6)


def weights_of(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def test_the_default_output_dir_is_the_models_last_name_whatever_the_trainer():
    """One helper names the output directory of every trainer given no config (Distillation, RLOO, AsyncGRPO): the
    last part of the model's id or path, a trailing slash ignored -- 'org/model/' gives 'model-Distillation', not
    '-Distillation'."""
    from grpokit.models import default_output_dir

    assert default_output_dir("org/model/", "Distillation") == "model-Distillation"
    assert default_output_dir("org/model", "RLOO") == "model-RLOO"
    assert default_output_dir("/checkpoints/run-3/", "AsyncGRPO") == "run-3-AsyncGRPO"
    model = build_tiny_model(40, hidden_size=32)
    model.config._name_or_path = "org/tiny/"
    assert default_output_dir(model, "Distillation") == "tiny-Distillation"
    model.config._name_or_path = ""
    assert default_output_dir(model, "Distillation") == "model-Distillation"
