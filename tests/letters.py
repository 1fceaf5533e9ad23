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


def long_tail_letter_model(tail: int, tail_mass: float, hidden_size: int = 32, seed: int = 0):
    """The letter task's model and tokenizer with `tail` junk tokens (`<w0>`, `<w1>`, ... after the 16 real ids)
    that together hold `tail_mass` of the first completion token's initial probability, as the long tail of a
    trained language model's vocabulary does.

    The real part is `tiny_letter_model(seed=seed)` unchanged: the junk tokens' embedding rows (tied, so also the LM
    head's) are drawn N(0, initializer_range) from a generator seeded with `seed`, and the LM head gets a bias,
    0 on the real tokens and −b on every junk token, b solved by bisection so that the junk tokens' probability at
    the first completion position, averaged over the 8 prompts at temperature 1, is `tail_mass`. The bias is a
    parameter like the others (trained). Over the real tokens the model's distribution is the original's."""
    import torch

    from grpokit.testing import build_char_tokenizer

    model, real_tokenizer = tiny_letter_model(hidden_size=hidden_size, seed=seed)
    real = len(real_tokenizer)
    tokenizer = build_char_tokenizer(LETTERS + ":", extra_words=tail)
    with torch.random.fork_rng(devices=[]):  # the resize's initialisation of the new rows (overwritten below)
        model.resize_token_embeddings(real + tail, mean_resizing=False)
    embedding = model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    head = model.get_output_embeddings()
    with torch.no_grad():
        embedding[real:] = torch.randn(tail, hidden_size, generator=generator) * model.config.initializer_range
        head.bias = torch.nn.Parameter(torch.zeros(real + tail))
        prompts = torch.tensor([tokenizer(f"{c}:")["input_ids"] for c in LETTERS])
        logits = model(prompts).logits[:, -1].double()  # [8, V], the bias still 0
    low, high = 0.0, 100.0
    for _ in range(100):  # the junk mass falls as b grows
        b = (low + high) / 2
        offset = torch.zeros(real + tail, dtype=torch.float64)
        offset[real:] = -b
        mass = (logits + offset).softmax(-1)[:, real:].sum(-1).mean().item()
        low, high = (b, high) if mass > tail_mass else (low, b)
    with torch.no_grad():
        head.bias[real:] = -(low + high) / 2
    return model, tokenizer


def letter_trainer(tmp_path, hidden_size: int = 32, **overrides):
    """A GRPOTrainer on the letter task: `tiny_letter_model(hidden_size)`, `letter_config(tmp_path, **overrides)`."""
    from grpokit import GRPOTrainer

    model, tokenizer = tiny_letter_model(hidden_size=hidden_size)
    return GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=letter_config(tmp_path, **overrides),
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
    )
