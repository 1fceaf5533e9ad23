"""Reward models: a sequence-classification model (one label) used as a reward function.

Each (prompt, completion) is rendered as the reward model expects — through its own chat template for
conversational prompts, as plain concatenated text otherwise — tokenized with the reward model's tokenizer, and
scored in batches under inference mode; the reward is the single logit.
"""

from __future__ import annotations

from typing import Any

import torch

from ..data import is_conversational
from ..models import check_model_source


class RewardModel:
    def __init__(
        self,
        model,
        tokenizer=None,
        batch_size: int = 16,
        max_length: int | None = None,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(model, str):
            check_model_source(model)
            name = model
            model = AutoModelForSequenceClassification.from_pretrained(
                model, num_labels=1, trust_remote_code=trust_remote_code
            )
        else:
            name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        if getattr(model.config, "num_labels", 1) != 1:
            raise ValueError(
                f"Reward model {name!r} has {model.config.num_labels} labels; a reward model must output one score "
                f"(a sequence-classification model with num_labels=1)."
            )
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path, trust_remote_code=trust_remote_code)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id  # the classifier reads the last non-pad token
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        self.__name__ = str(name).rstrip("/").split("/")[-1]

    def to(self, device) -> RewardModel:
        self.model.to(device)
        return self

    def render(self, prompt: Any, completion: Any) -> str:
        if is_conversational(prompt):
            messages = prompt + (
                completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            )
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise ValueError(f"Reward model {self.__name__!r} has no chat template for conversational prompts.")
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        completion_text = completion[-1]["content"] if isinstance(completion, list) else completion
        return prompt + completion_text

    @torch.inference_mode()
    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        texts = [self.render(p, c) for p, c in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                truncation=self.max_length is not None,
                max_length=self.max_length,
                add_special_tokens=False,
            ).to(device)
            scores.extend(self.model(**batch).logits[:, 0].float().tolist())
        return scores
