"""Prompts are kept whole by default, as in TRL 1.16 (which dropped max_prompt_length); a limit (max_prompt_length set,
or the model's positions less max_completion_length) keeps a prompt's last tokens and says so once, with the count,
only when a prompt is actually cut."""

import logging
import warnings

import pytest
from datasets import Dataset
from letters import LETTERS

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.data import PromptLimit
from grpokit.models import prompt_length_limit
from grpokit.testing import build_char_tokenizer, build_tiny_model

CUT = "keep only their last"


def tiny(positions: int = 1024):
    tokenizer = build_char_tokenizer(LETTERS + ":")
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=32,
        max_position_embeddings=positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return model, tokenizer


def config(tmp_path, **overrides) -> GRPOConfig:
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to=[],
    )
    return GRPOConfig(**{**values, **overrides})


def prompt(tokens: int) -> str:
    return (LETTERS * tokens)[: tokens - 1] + ":"  # one character a token


def test_the_default_keeps_an_802_token_prompt_whole_and_says_nothing(tmp_path, caplog):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning for a default
        args = config(tmp_path)
    assert args.max_prompt_length is None
    model, tokenizer = tiny()
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(prompts)
        return [0.0] * len(completions)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": prompt(802)}]),
    )
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        encoded = trainer.codec.encode([{"prompt": prompt(802)}], [4])
        trainer.train()
    assert [len(ids) for ids in encoded.ids] == [len(tokenizer(prompt(802))["input_ids"])]
    assert len(encoded.ids[0]) >= 802
    assert seen == [prompt(802)] * 4
    assert CUT not in caplog.text and "Prompts are cut" not in caplog.text


def test_short_prompts_under_the_positions_limit_are_not_warned_about(tmp_path, caplog):
    model, _ = tiny(positions=512)
    limit = prompt_length_limit(model, config(tmp_path))
    assert limit == 504 and "512 positions" in limit.reason  # the cap exists (prompt + completion must fit) ...
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        assert limit.cut([[1] * 10, [2] * 3]) == [[1] * 10, [2] * 3]
    assert caplog.text == ""  # ... and says nothing while no prompt reaches it


def test_a_cut_is_said_once_with_the_count(tmp_path, caplog):
    model, tokenizer = tiny(positions=64)
    with pytest.warns(FutureWarning, match="max_prompt_length is deprecated"):
        args = config(tmp_path, max_prompt_length=20)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": "a:"}]),
    )
    rows = [{"prompt": prompt(30)}, {"prompt": "b:"}, {"prompt": prompt(25)}, {"prompt": "c:"}]
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        first = trainer.codec.encode(rows, [1, 1, 1, 1])
        trainer.codec.encode(rows, [1, 1, 1, 1])  # cut again, not said again
    assert [len(ids) for ids in first.ids] == [
        20,
        len(tokenizer("b:")["input_ids"]),
        20,
        len(tokenizer("c:")["input_ids"]),
    ]
    assert first.ids[0] == tokenizer(prompt(30))["input_ids"][-20:]
    said = [record.getMessage() for record in caplog.records if CUT in record.getMessage()]
    assert said == [
        "2 of 4 prompts in a batch are longer than 20 tokens and keep only their last 20 "
        "(max_prompt_length=20); reward functions still see the whole prompt. Filter long prompts out "
        "of the dataset to train on whole prompts. (Said once per run.)"
    ]


def test_the_positions_limit_names_its_reason_when_it_cuts(tmp_path, caplog):
    model, _ = tiny(positions=32)
    limit = prompt_length_limit(model, config(tmp_path))
    with caplog.at_level(logging.WARNING, logger="grpokit"):
        assert limit.cut([list(range(30))]) == [list(range(6, 30))]
    assert "longer than 24 tokens" in caplog.text
    assert "so that prompt + completion fits the model's 32 positions with max_completion_length=8" in caplog.text
    assert PromptLimit.of(None) is None and PromptLimit.of(limit) is limit
