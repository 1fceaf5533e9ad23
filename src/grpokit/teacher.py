"""A teacher model for on-policy distillation (`DistillationTrainer`) and for a teacher's signal inside GRPO
(`GRPOTrainer(teacher_model=...)`): loaded as TRL loads it, frozen, and refused when it cannot score the student's
own token ids (another tokenizer or vocabulary)."""

from __future__ import annotations

import torch

from .distillation import check_shared_tokenizer
from .logprobs import causal_lm_of
from .models import load_causal_lm, load_tokenizer, looks_like_local_path
from .multimodal import tokenizer_of


def _dtype_of(value):
    """TRL's reading of teacher_model_init_kwargs' dtype: 'auto' / None as they are, else a torch dtype's name."""
    return value if value in ("auto", None) or isinstance(value, torch.dtype) else getattr(torch, value)


def vocab_size_of(model) -> int:
    """The model's vocabulary size as TRL reads it (its text config's `vocab_size`), else its LM head's rows."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text_config, "vocab_size", None)
    return size if size is not None else model.get_output_embeddings().weight.shape[0]


def load_teacher(
    teacher_model, init_kwargs, revision, trust_remote_code: bool, device, student, processing_class
) -> torch.nn.Module:
    """The teacher (a model, or a path / hub id loaded with `init_kwargs` at `revision`, as TRL's
    teacher_model_init_kwargs / teacher_model_revision), frozen, in eval mode, on `device`. Its tokenizer, where one
    can be found (a path's; a model's `name_or_path` when that is a local folder), must be the student's
    (`processing_class`, `distillation.tokenizer_differences`); its vocab_size must be the student's (TRL's check)."""
    if isinstance(init_kwargs, str):  # a JSON string, as TRL's config accepts
        import json

        init_kwargs = json.loads(init_kwargs)
    tokenizer = None
    if isinstance(teacher_model, str):
        init_kwargs = dict(init_kwargs or {})
        if "dtype" in init_kwargs:
            init_kwargs["dtype"] = _dtype_of(init_kwargs["dtype"])
        if revision is not None:
            init_kwargs.setdefault("revision", revision)
        tokenizer = load_tokenizer(teacher_model, trust_remote_code)
        teacher_model = load_causal_lm(teacher_model, init_kwargs, trust_remote_code)
    else:
        if init_kwargs is not None:
            raise ValueError(
                "You passed teacher_model_init_kwargs to the config, but your teacher_model is already instantiated."
            )
        name = getattr(getattr(teacher_model, "config", None), "_name_or_path", "")
        if name and looks_like_local_path(name):
            try:
                tokenizer = load_tokenizer(name, trust_remote_code)
            except (OSError, ValueError):  # a folder with the weights only: the vocabulary check below remains
                tokenizer = None
    student_vocab, teacher_vocab = vocab_size_of(causal_lm_of(student)), vocab_size_of(teacher_model)
    if student_vocab != teacher_vocab:  # TRL's check and words, first, as TRL users match them
        raise ValueError(
            f"The student model has vocab_size {student_vocab} but the teacher model has vocab_size "
            f"{teacher_vocab}. Distillation compares the teacher's full next-token distribution, which "
            f"requires a shared vocabulary. Use a teacher with the same vocab_size, or GOLD for "
            f"cross-tokenizer distillation. In grpokit: pick a teacher of the student's family (one "
            f"tokenizer, any size or dtype); grpokit has no GOLD trainer, TRL's experimental one "
            f"distills across tokenizers."
        )
    if tokenizer is not None:
        check_shared_tokenizer(tokenizer_of(processing_class), tokenizer)
    return teacher_model.requires_grad_(False).eval().to(device)
