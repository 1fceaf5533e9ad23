"""The toy task most trainer tests use: the prompt is a letter and a colon, the reward 1 when the completion
starts with that letter."""

from datasets import Dataset

from grpokit import GRPOConfig

LETTERS = "abcdefgh"


def letter_dataset(copies: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"{c}:", "letter": c} for c in LETTERS] * copies)


def repeat_letter(completions, letter, **kwargs):
    return [1.0 if c[:1] == target else 0.0 for c, target in zip(completions, letter)]


def letter_config(tmp_path, **overrides) -> GRPOConfig:
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=64,
        num_generations=8,
        max_completion_length=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_steps=10,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return GRPOConfig(**{**values, **overrides})


def tiny_letter_model(hidden_size: int = 32, seed: int = 0):
    """A tiny random-weight Qwen2 and its character tokenizer over the letters and ':'."""
    from grpokit.testing import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer(LETTERS + ":")
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=hidden_size,
        seed=seed,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return model, tokenizer
