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
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=64, num_generations=8,
                  max_completion_length=2, learning_rate=1e-2, lr_scheduler_type="constant", max_steps=10,
                  logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0)  # fmt: skip
    return GRPOConfig(**{**values, **overrides})
