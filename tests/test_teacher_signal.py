"""A teacher's signal inside GRPO (`GRPOTrainer(teacher_model=...)`): teacher_kl_coef · -(log π_student -
log π_teacher) per token joins the reward advantages, computed from the same batch a plain run makes; a teacher equal
to the student adds nothing; a teacher of another vocabulary is refused."""

import copy

import pytest
import torch
from letters import letter_config, letter_dataset, repeat_letter, tiny_letter_model

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.experience import logprobs_in_chunks
from grpokit.testing import build_tiny_model


def trainer_with(tmp_path, teacher=None, **overrides):
    model, tokenizer = tiny_letter_model()
    values = dict(per_device_train_batch_size=16, num_generations=4, max_steps=1, report_to="none")
    args = letter_config(tmp_path, **{**values, **overrides})
    return GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=args,
        train_dataset=letter_dataset(1),
        processing_class=tokenizer,
        teacher_model=teacher,
    )


def test_the_teachers_signal_joins_the_advantages(tmp_path):
    teacher, _ = tiny_letter_model(seed=7)  # another random model: its log-probs differ from the student's
    plain = trainer_with(tmp_path / "plain").generate_batch()
    taught_trainer = trainer_with(tmp_path / "taught", teacher, teacher_kl_coef=0.5)
    taught = taught_trainer.generate_batch()
    assert torch.equal(plain.completion_ids, taught.completion_ids)  # the same samples, in the same order
    teacher_logprobs = logprobs_in_chunks(
        taught_trainer.experience.teacher, taught, taught_trainer.args, taught_trainer.accelerator.autocast
    )
    mask = taught.loss_mask != 0
    expected = plain.advantages + torch.where(
        mask, 0.5 * (teacher_logprobs - taught.sampling_logprobs), torch.zeros_like(teacher_logprobs)
    )
    torch.testing.assert_close(taught.advantages, expected, rtol=0, atol=1e-6)
    assert (taught.advantages - plain.advantages)[mask].abs().max() > 0.01  # not a no-op
    reverse_kl = ((taught.sampling_logprobs - teacher_logprobs) * mask).sum() / mask.sum()
    assert taught_trainer.window.flush()["teacher/reverse_kl"] == pytest.approx(reverse_kl.item(), abs=1e-5)


def test_a_teacher_equal_to_the_student_adds_nothing_and_trains(tmp_path):
    model, _ = tiny_letter_model()
    plain = trainer_with(tmp_path / "plain").generate_batch()
    taught_trainer = trainer_with(tmp_path / "taught", copy.deepcopy(model))
    taught = taught_trainer.generate_batch()
    # The sampler's float32 log-probs equal the teacher's forward to float rounding.
    torch.testing.assert_close(taught.advantages, plain.advantages, rtol=0, atol=1e-5)
    assert taught_trainer.experience.teacher is not taught_trainer.unwrapped_model
    assert not any(p.requires_grad for p in taught_trainer.experience.teacher.parameters())
    trainer = trainer_with(tmp_path / "run", copy.deepcopy(model), max_steps=2, beta=0.04)
    trainer.train()
    assert "teacher/reverse_kl" in trainer.state.log_history[0] and trainer.state.global_step == 2


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="The student model has vocab_size 16 but the teacher model has vocab_size 40"):
        trainer_with(tmp_path, build_tiny_model(40, hidden_size=32))
    assert GRPOConfig(report_to="none").teacher_kl_coef == 1.0
