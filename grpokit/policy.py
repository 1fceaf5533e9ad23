"""Loading the policy, its tokenizer and its reference; the training forward that gives token log-probs."""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import torch

from .loss import entropy_from_logits, selective_log_softmax
from .rollout import _logits_of, forward_accepts, position_ids_from_mask


def looks_like_local_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else (absolute, ./, ~, more slashes) is meant as a path."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def check_model_source(name: str) -> None:
    """Fail early, before any network call, for a path that does not exist."""
    if Path(name).expanduser().exists():
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    if looks_like_local_path(name) or offline:
        raise FileNotFoundError(
            f"Model {name!r} not found: no such local directory"
            + (" (and HF_HUB_OFFLINE is set, so the Hub is not tried)" if offline else "")
            + ". Pass the directory that holds config.json and the weights, or a Hugging Face Hub id."
        )


def load_causal_lm(name: str, model_init_kwargs: dict | None = None):
    from transformers import AutoModelForCausalLM

    check_model_source(name)
    kwargs = dict(model_init_kwargs or {})
    if "torch_dtype" in kwargs:  # the transformers 4 spelling
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    return AutoModelForCausalLM.from_pretrained(name, **kwargs)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    check_model_source(name)
    tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
    return tokenizer


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A reference policy: a copy of the weights that never trains."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, T] (and entropies [N, T]) of the last T tokens of input_ids [N, P + T] under the model.

    Position ids skip left padding exactly as the rollout's do, so the values match the sampling log-probs.
    Only the T + 1 last positions' logits are computed when the model supports `logits_to_keep`.
    """
    kwargs = {}
    if forward_accepts(model, "attention_mask"):
        kwargs.update(attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask))
    if forward_accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = completion_length + 1
    logits = _logits_of(model(input_ids, **kwargs))
    logits = logits[:, -completion_length - 1 : -1]  # position t predicts token t + 1
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -completion_length:]
    logprobs = selective_log_softmax(logits.float() if logits.dtype != torch.float32 else logits, targets)
    entropies = None
    if with_entropy:
        # The entropy keeps a graph (another softmax over V per token) only when the loss needs its gradient.
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = entropy_from_logits(logits)
    return logprobs, entropies


# ------------------------------------------------------------------------------------------------- LoRA


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def apply_peft(model, peft_config):
    try:
        from peft import get_peft_model
    except ImportError as error:
        raise ImportError("peft_config needs peft: pip install 'grpokit[peft]'") from error
    if is_peft_model(model):
        raise ValueError("The model already has a LoRA adapter (a PeftModel): do not pass peft_config as well.")
    return get_peft_model(model, peft_config)


@contextlib.contextmanager
def reference_policy(policy, frozen_reference=None):
    """The reference policy: a frozen copy when there is one, else (LoRA) the policy with its adapter disabled."""
    if frozen_reference is not None:
        yield frozen_reference
    elif is_peft_model(policy):
        with policy.disable_adapter():
            yield policy
    else:
        raise ValueError("beta > 0 needs a reference policy: a frozen copy or a LoRA model.")


def save_merged(model, directory: Path, tokenizer=None) -> None:
    """The adapter merged into a copy of the base weights, saved as a plain model (the live model is untouched)."""
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)


def load_model_weights(model, directory: Path) -> None:
    """Load what save_model wrote into `directory` back into `model` (adapter only for LoRA models)."""
    from safetensors.torch import load_file

    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(directory / "adapter_model.safetensors")))
        return
    weights = {}
    for file in sorted(directory.glob("model*.safetensors")):
        weights.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not any(k.endswith(t) for t in tied)]
    if unexpected or missing:
        raise RuntimeError(f"Checkpoint {directory} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}.")  # fmt: skip
