"""What a newcomer's first runs hit, each with its fix: log lines printed through the progress bar, no "Writing
model shards" bar per checkpoint, a model card that says what the base model was, a model vLLM's CPU attention
cannot run refused before vLLM starts, and a reward function that raises on every row stopping the run."""

import re

import pytest
from letters import letter_dataset, repeat_letter, tiny_letter_model

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.rewards.base import RewardFunctionError
from grpokit.rollout.vllm import VLLM_CPU_HEAD_SIZES, check_cpu_head_size, start_llm
from grpokit.testing import build_char_tokenizer, build_tiny_model, save_tiny_model


def letter_trainer(tmp_path, reward=repeat_letter, **overrides):
    model, tokenizer = tiny_letter_model()
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=2,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**{**values, **overrides}),
        train_dataset=letter_dataset(1),
        processing_class=tokenizer,
    )


def test_log_lines_are_printed_through_the_progress_bar_and_checkpoints_draw_no_bar(tmp_path, capfd):
    letter_trainer(tmp_path, disable_tqdm=False, save_strategy="steps", save_steps=1).train()
    err = capfd.readouterr().err
    assert "GRPO" in err  # the bar was drawn
    assert re.search(r"(^|[\n\r])\[step 1\] loss=", err) and re.search(r"(^|[\n\r])\[step 2\] loss=", err)
    assert "][step" not in err and "s/it][step" not in err  # not glued onto the bar's last frame
    assert "Writing model shards" not in err
    assert (tmp_path / "out" / "checkpoint-2").is_dir()


def test_the_model_card_names_a_model_built_in_code(tmp_path):
    trainer = letter_trainer(tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    card = (tmp_path / "final" / "README.md").read_text()
    assert "from a `Qwen2ForCausalLM` built in code." in card and "a model object" not in card
    model_dir = save_tiny_model(tmp_path / "tiny")
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(1),
        args=GRPOConfig(
            output_dir=str(tmp_path / "out2"),
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=2,
            max_steps=1,
            report_to="none",
        ),
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final2"))
    assert f"from the base model **{model_dir}**." in (tmp_path / "final2" / "README.md").read_text()


def test_a_head_size_vllms_cpu_attention_refuses_is_named_before_vllm_starts(tmp_path):
    tokenizer = build_char_tokenizer("ab")
    sixteen = tmp_path / "sixteen"
    build_tiny_model(len(tokenizer), hidden_size=32, num_heads=2).save_pretrained(sixteen)  # head size 16
    with pytest.raises(ValueError, match=r"this model's is 16 \(hidden_size 32 / 2 heads\).*use_vllm=False"):
        check_cpu_head_size(sixteen)
    with pytest.raises(ValueError, match="head sizes 32, 64"):  # before vLLM is imported (not installed here)
        start_llm(sixteen, dtype=None)
    thirty_two = tmp_path / "thirty_two"
    build_tiny_model(len(tokenizer), hidden_size=64, num_heads=2).save_pretrained(thirty_two)
    check_cpu_head_size(thirty_two)
    assert 32 in VLLM_CPU_HEAD_SIZES and 16 not in VLLM_CPU_HEAD_SIZES


def test_a_reward_function_raising_on_every_row_stops_the_run_after_three_batches(tmp_path, caplog):
    def broken(completions, **kwargs):
        raise KeyError("answer")

    trainer = letter_trainer(tmp_path, reward=broken, reward_fn_errors="none", max_steps=10)
    with pytest.raises(
        RewardFunctionError,
        match="No completion got a reward in 3 generation batches in a row: "
        "the reward functions raised \\(broken on 8 rows of the last 8\\)",
    ):
        trainer.train()
    assert trainer.state.global_step == 2  # two batches trained on nothing, the third stopped the run

    def never(completions, **kwargs):  # returning None is "does not apply": TRL warns and trains on
        return [None] * len(completions)

    trainer = letter_trainer(tmp_path / "none", reward=never, max_steps=4)
    caplog.clear()
    trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text  # logged, as TRL logs it
    assert trainer.state.global_step == 4


def test_one_failing_batch_between_good_ones_does_not_stop(tmp_path):
    calls = {"n": 0}

    def flaky(completions, letter, **kwargs):
        calls["n"] += 1
        if calls["n"] % 3 == 0:  # every third batch raises on every row (the call, then each row alone)
            raise RuntimeError("flaky")
        return repeat_letter(completions, letter)

    trainer = letter_trainer(tmp_path, reward=flaky, reward_fn_errors="none", max_steps=6)
    trainer.train()
    assert trainer.state.global_step == 6
