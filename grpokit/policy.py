"""Loading the policy, its tokenizer and its reference; the training forward that gives token log-probs."""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from pathlib import Path

import torch

from .distributed import is_sharded, load_full_state_dict
from .loss import chunked_token_logprobs, entropy_from_logits, selective_log_softmax
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


# The chunked LM head (`loss.chunked_token_logprobs`) replaces `logits = lm_head(hidden_states)` only where that
# line is the whole head. These architectures' transformers implementations apply a plain Linear to the decoder's
# last hidden state and nothing after it (read in transformers 5.23; tests/test_chunked.py compares the two paths
# on a tiny model of each). Others soft-cap (Gemma 2/3), scale (Cohere, Granite) or slice the logits.
CHUNKED_HEAD_MODEL_TYPES = frozenset({
    "deepseek_v3", "ernie4_5", "gemma", "glm", "glm4", "gpt2", "gpt_neox", "llama", "mistral", "mixtral", "olmo",
    "olmo2", "olmo3", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "stablelm",
    "starcoder2",
})  # fmt: skip
# Config fields that, where an architecture has them, change the logits after the LM head: refuse the chunked head
# when any is set, whatever the model type claims.
LOGIT_TRANSFORM_FIELDS = ("final_logit_softcapping", "logit_softcapping", "logits_soft_cap", "logit_scale",
                          "logits_scaling", "output_multiplier", "lm_head_multiplier", "unpadded_vocab_size")  # fmt: skip
# False forces the plain logits path everywhere (tests compare the two; also a switch for debugging).
USE_CHUNKED_HEAD = True


def _is_set(value) -> bool:
    """A logit transform is off when absent, None, False or 1 (a scale of one)."""
    return value is not None and value is not False and not (isinstance(value, (int, float)) and value == 1)


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside a LoRA-style PeftModel (its adapter layers live in it), else the model."""
    if is_peft_model(model) and not model.active_peft_config.is_prompt_learning:
        return model.get_base_model()
    return model


def supports_chunked_head(model: torch.nn.Module) -> bool:
    """Whether `token_logprobs` may run the decoder and `chunked_token_logprobs` instead of the model's forward.

    True for a transformers causal LM of a type in CHUNKED_HEAD_MODEL_TYPES (or a LoRA PeftModel of one) whose
    output embedding is exactly an `nn.Linear` (not a quantised or adapter-wrapped head) and whose config has no
    logit soft-capping or scaling. A wrapper such as DistributedDataParallel gets False: its forward must run for
    gradient synchronisation, and the decoder call would bypass it; so does a sharded model (FSDP2, ZeRO-3), whose
    head weight is a shard outside the model's forward.
    """
    if not USE_CHUNKED_HEAD or is_sharded(model):
        return False
    if is_peft_model(model) and model.active_peft_config.is_prompt_learning:
        return False  # virtual tokens are added by the PeftModel's forward
    lm = causal_lm_of(model)
    config = getattr(lm, "config", None)
    if config is None or getattr(config, "model_type", None) not in CHUNKED_HEAD_MODEL_TYPES:
        return False
    if not type(lm).__module__.startswith("transformers.models."):
        return False  # remote code with a familiar model_type may still change the head
    if any(_is_set(getattr(source, field, None)) for source in (config, lm) for field in LOGIT_TRANSFORM_FIELDS):
        return False  # on the config (Gemma 2, Granite) or on the model itself (Cohere's `logit_scale`)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or not head.weight.is_floating_point():
        return False
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    return isinstance(decoder, torch.nn.Module) and decoder is not lm


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunked: bool | None = None,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, T] (and entropies [N, T]) of the last T tokens of input_ids [N, P + T] under the model.

    Position ids skip left padding exactly as the rollout's do, so the values match the sampling log-probs.

    Two paths give the same numbers. The chunked one (`chunked=None` picks it where `supports_chunked_head`) runs
    the decoder, keeps the T hidden states that predict completion tokens, and computes their log-probs and
    entropies from the LM head's weight in chunks of rows (`loss.chunked_token_logprobs`), so the [N, T, V] logits
    never exist in forward or backward. The plain one takes the model's logits (of the T + 1 last positions when
    the model supports `logits_to_keep`). An entropy that needs a gradient (`entropy_grad`, for an entropy bonus)
    takes the plain path: the chunked entropies are a metric without one.

    On the chunked path the head runs on real completion tokens only (attention_mask 1; log-probs and entropies
    are 0 on padding). When rows repeat prompts (a GRPO batch holds G completions per prompt) and `share_prompts`
    is on, each distinct prompt (the first P tokens, with its padding) runs through the decoder once and its KV
    cache is shared by its rows, whose completions then run against it in groups of similar length
    (`shared_prompt_hidden`): (G - 1) / G of the prompt tokens' forward and backward work is saved, the gradient
    reaches the prompt's activations through the shared cache, and a completion is padded only to the longest in
    its length group. The values are those of the full forward up to float rounding.
    """
    use_chunked = supports_chunked_head(model) if chunked is None else chunked
    if use_chunked and with_entropy and entropy_grad and torch.is_grad_enabled():
        if chunked:
            raise ValueError("token_logprobs: the chunked head gives entropies without a gradient; "
                             "an entropy bonus needs chunked=False.")  # fmt: skip
        use_chunked = False
    position_ids = position_ids_from_mask(attention_mask)
    targets = input_ids[:, -completion_length:]
    if use_chunked:
        lm = causal_lm_of(model)
        head, decoder = lm.get_output_embeddings(), lm.get_decoder()
        shared = None
        if share_prompts and can_share_prompts(lm):
            shared = shared_prompt_hidden(decoder, input_ids, attention_mask, position_ids, completion_length)
        if shared is not None:
            hidden, rows, columns = shared  # [M, H] for the real completion tokens at (rows, columns)
        else:
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False)  # fmt: skip
            hidden = _last_hidden(out)[:, -completion_length - 1 : -1]  # position t predicts token t + 1
            real = attention_mask[:, -completion_length:].bool()
            if bool(real.all()):
                return chunked_token_logprobs(hidden, head.weight, targets, temperature, bias=head.bias,
                                              with_entropy=with_entropy)  # fmt: skip
            rows, columns = real.nonzero(as_tuple=True)
            hidden = hidden[rows, columns]
        logprobs, entropies = chunked_token_logprobs(hidden[None], head.weight, targets[rows, columns][None],
                                                     temperature, bias=head.bias, with_entropy=with_entropy)
        shape = tuple(targets.shape)
        return (_scatter(logprobs[0], rows, columns, shape),
                None if entropies is None else _scatter(entropies[0], rows, columns, shape))  # fmt: skip

    kwargs = {}
    if forward_accepts(model, "attention_mask"):
        kwargs.update(attention_mask=attention_mask, position_ids=position_ids)
    if forward_accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = completion_length + 1
    logits = _logits_of(model(input_ids, **kwargs))
    logits = logits[:, -completion_length - 1 : -1]  # position t predicts token t + 1
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = selective_log_softmax(logits, targets, dtype=torch.float32)  # upcast chunk by chunk
    entropies = None
    if with_entropy:
        # The entropy keeps a graph (another softmax over V per token) only when the loss needs its gradient.
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = entropy_from_logits(logits)
    return logprobs, entropies


def _scatter(values: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, shape) -> torch.Tensor:
    """values [M] placed at (rows, columns) of a zero tensor of `shape` (differentiable)."""
    return values.new_zeros(shape).index_put((rows, columns), values)


def _last_hidden(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def can_share_prompts(lm: torch.nn.Module) -> bool:
    """Whether the decoder can run prompts and completions in two calls through a KV cache with the same result:
    full attention in every layer (no sliding window, whose mask the cache would change) and no gradient
    checkpointing (under which transformers turns the cache off)."""
    config = getattr(lm, "config", None)
    checkpointing = "is_activation_checkpointing" if hasattr(type(lm), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # transformers 5 renamed it  # fmt: skip
    if getattr(lm, checkpointing, False):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return False
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


# Share a prompt when at most this fraction of the rows have distinct prompts (a second decoder call costs more
# than it saves when few rows share one).
SHARE_PROMPTS_MAX_DISTINCT = 0.5
# Completions run in at most this many groups of similar length; a row joins the current group while its length
# is at least this fraction of the group's longest.
LENGTH_GROUPS, LENGTH_GROUP_RATIO = 4, 0.75


def length_groups(lengths: torch.Tensor) -> list[torch.Tensor]:
    """Row indices in groups of similar length, longest first (the padding each group needs is to its longest)."""
    order = torch.argsort(lengths, descending=True, stable=True)
    groups, start = [], 0
    values = lengths[order].tolist()
    for i in range(1, len(values) + 1):
        ends_group = i == len(values) or (values[i] < LENGTH_GROUP_RATIO * values[start]
                                          and len(groups) < LENGTH_GROUPS - 1)  # fmt: skip
        if ends_group:
            groups.append(order[start:i])
            start = i
    return groups


def shared_prompt_hidden(decoder, input_ids, attention_mask, position_ids, completion_length: int):
    """Hidden states of the real completion tokens of input_ids [N, P + T], each distinct prompt (first P tokens
    and mask) run once: (hidden [M, H], rows [M], columns [M]), where hidden[m] predicts token columns[m] of the
    completion of row rows[m]; None when too few rows share a prompt to gain from it.

    Each distinct prompt's KV cache is indexed out to its rows (an index: the gradient flows back through it), and
    the completions run against it in groups of similar length (`length_groups`), each padded to its longest; the
    completion's last token predicts nothing and is not run."""
    from transformers import DynamicCache

    n, prompt_length = input_ids.shape[0], input_ids.shape[1] - completion_length
    if prompt_length < 1 or completion_length < 1:
        return None
    prompts = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length].long()], 1)
    distinct, row_of = torch.unique(prompts, dim=0, return_inverse=True)
    if len(distinct) > SHARE_PROMPTS_MAX_DISTINCT * n:
        return None
    device = input_ids.device
    first = torch.full((len(distinct),), n, dtype=torch.long, device=device)
    first = first.scatter_reduce(0, row_of, torch.arange(n, device=device), reduce="amin")
    out = decoder(input_ids=input_ids[first, :prompt_length], attention_mask=attention_mask[first, :prompt_length],
                  position_ids=position_ids[first, :prompt_length], past_key_values=DynamicCache(), use_cache=True)
    prompt_cache = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    prompt_end = _last_hidden(out)[:, -1]  # [U, H]: a prompt's last position predicts its first completion token

    real = attention_mask[:, prompt_length:].bool()
    positions = torch.arange(1, completion_length + 1, device=device)
    lengths = torch.where(real, positions, 0).amax(-1)  # up to the last real completion token
    hidden, rows, columns = [], [], []
    for group in length_groups(lengths):
        longest = int(lengths[group].max())
        if longest == 0:
            continue
        prompt_rows = row_of[group]
        states = prompt_end[prompt_rows][:, None]
        if longest > 1:
            cache = DynamicCache(ddp_cache_data=[(keys[prompt_rows], values[prompt_rows]) for keys, values in
                                                 prompt_cache])  # fmt: skip
            end = prompt_length + longest - 1
            rest = decoder(input_ids=input_ids[group, prompt_length:end], attention_mask=attention_mask[group, :end],
                           position_ids=position_ids[group, prompt_length:end], past_key_values=cache, use_cache=True)
            states = torch.cat([states, _last_hidden(rest)], 1)  # [rows, longest, H]
        group_rows, group_columns = real[group, :longest].nonzero(as_tuple=True)
        hidden.append(states[group_rows, group_columns])
        rows.append(group[group_rows])
        columns.append(group_columns)
    if not hidden:  # no real completion token anywhere: the plain forward handles that edge
        return None
    return torch.cat(hidden), torch.cat(rows), torch.cat(columns)


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
    missing, unexpected = load_full_state_dict(model, weights, strict=False)  # sharded where the model is
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not any(k.endswith(t) for t in tied)]
    if unexpected or missing:
        raise RuntimeError(f"Checkpoint {directory} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}.")  # fmt: skip


def check_context_length(model, args) -> None:
    """Prompt + completion must fit the model's positions; say which knob to turn before anything runs."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is None:
        return
    if args.max_completion_length >= limit:
        raise ValueError(f"max_completion_length={args.max_completion_length} does not fit the model's context "
                         f"({limit} positions); lower max_completion_length.")  # fmt: skip
    if args.max_prompt_length is None or args.max_prompt_length + args.max_completion_length > limit:
        args.max_prompt_length = limit - args.max_completion_length
        warnings.warn(f"Prompts are cut to their last {args.max_prompt_length} tokens so that prompt + completion "
                      f"fits the model's {limit} positions (max_completion_length={args.max_completion_length}).",
                      UserWarning, stacklevel=3)  # fmt: skip


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """TRL's reference sync: ref <- alpha * policy + (1 - alpha) * ref (alpha = 1 copies the policy)."""
    # named_parameters, not state_dict: tied weights (embeddings = LM head) must be mixed once, not twice.
    policy_parameters = dict(policy.named_parameters())
    for name, value in reference.named_parameters():
        value.mul_(1 - alpha).add_(policy_parameters[name].detach().to(value.dtype), alpha=alpha)
