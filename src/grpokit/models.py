"""Loading the policy, its tokenizer and its reference; LoRA; saving and loading model weights."""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import warnings
from pathlib import Path

import torch

from .compat import is_peft_model, output_embeddings, tied_weight_keys
from .cpu_matmul import is_linear4bit
from .data import PromptLimit
from .distributed import full_state_dict, is_sharded, is_zero3, load_full_state_dict
from .extras import install_command
from .multimodal import freeze_vision, is_vision_language_model, language_only_lora, text_config_of, tokenizer_of
from .quantized import quantize_linears


def looks_like_local_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else (absolute, ./, ~, more slashes) is meant as a path."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def in_hub_cache(name: str, cache_dir: str | None = None) -> bool:
    """Whether the Hugging Face cache (HF_HUB_CACHE, or `cache_dir`) holds `name`'s config.json at refs/main: what
    `from_pretrained` loads offline."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json", cache_dir=cache_dir), str)
    except ValueError:  # not a valid repo id
        return False


def check_model_source(name: str, cache_dir: str | None = None) -> None:
    """Fail early, before any network call, for a path that does not exist (offline: for a Hub id that is not in
    the local Hugging Face cache either)."""
    if Path(name).expanduser().exists():
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    if looks_like_local_path(name) or (offline and not in_hub_cache(name, cache_dir)):
        raise FileNotFoundError(
            f"Model {name!r} not found: no such local directory"
            + (
                " (and HF_HUB_OFFLINE is set, so the Hub is not tried; nor is it in the Hugging Face cache)"
                if offline
                else ""
            )
            + ". Pass the directory that holds config.json and the weights, or a Hugging Face Hub id."
        )


def load_causal_lm(name: str, model_init_kwargs: dict | None = None, trust_remote_code: bool = False):
    """A causal LM, or for a vision-language checkpoint (its config has a `vision_config`) the class its config
    names (e.g. `Qwen2_5_VLForConditionalGeneration`), else `AutoModelForImageTextToText`, as TRL loads them."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = {"trust_remote_code": trust_remote_code, **(model_init_kwargs or {})}
    check_model_source(name, kwargs.get("cache_dir"))
    if "torch_dtype" in kwargs:  # the transformers 4 spelling
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    if is_vision_language_model(config):
        architecture = getattr(transformers, (config.architectures or [""])[0], None)
        return (architecture or AutoModelForImageTextToText).from_pretrained(name, **kwargs)
    return AutoModelForCausalLM.from_pretrained(name, **kwargs)


def load_config(name: str, trust_remote_code: bool = False):
    """A checkpoint's configuration (a small file: read before the weights)."""
    from transformers import AutoConfig

    check_model_source(name)
    return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)


def load_tokenizer(name: str, trust_remote_code: bool = False, vision: bool = False):
    """The tokenizer of a checkpoint, or (vision) its processor (AutoProcessor), padding on the left."""
    from transformers import AutoProcessor, AutoTokenizer

    check_model_source(name)
    auto = AutoProcessor if vision else AutoTokenizer
    return auto.from_pretrained(name, padding_side="left", trust_remote_code=trust_remote_code)


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A reference policy: a copy of the weights that never trains, its floating-point parameters in `dtype`
    (None: as they are). Each parameter is converted as it is copied, so no second full-precision copy ever exists;
    buffers (e.g. rotary frequencies) keep their dtype, as `from_pretrained(dtype=...)` leaves them."""
    memo = {}
    if dtype is not None:
        for parameter in model.parameters():  # deepcopy takes these instead of copying (tied weights stay tied)
            if parameter.is_floating_point() and id(parameter) not in memo:
                memo[id(parameter)] = torch.nn.Parameter(parameter.detach().to(dtype, copy=True), requires_grad=False)
    reference = copy.deepcopy(model, memo)
    reference.requires_grad_(False)
    if dtype is not None and hasattr(getattr(reference, "config", None), "dtype"):
        reference.config.dtype = dtype
    return reference.eval()


# Whether the frozen float32 reference of a bf16-autocast run keeps its plain linear layers in bf16
# (`linears_in_autocast_dtype`): the same log-probs bitwise for half those layers' bytes. A switch for tests and
# measurements (False: the float32 copy, as before).
AUTOCAST_REFERENCE_LINEARS = True


def linears_in_autocast_dtype(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Cast, in place, the float32 weights and biases of `model`'s plain `nn.Linear` layers (not the LM head, not
    a parameter that another kind of module shares) to `dtype`, the dtype the model's forwards autocast to. Under
    autocast F.linear casts a float32 weight and bias to that dtype at every call (round to nearest, `Tensor.to`),
    uncached for tensors without gradients: casting them once gives the same operands, so the same matmuls bitwise,
    for half the bytes (683 of 1,366 MiB of linear weights at the Qwen2.5-0.5B shape). Only for a frozen model whose
    every forward runs under that autocast (the reference). The embeddings, whose lookups autocast leaves in float32,
    the norms and the LM head (tied to the embeddings in small models) stay as they are. Returns how many tensors
    were cast."""
    head = output_embeddings(model)
    plain = {}  # id(parameter) -> whether every module holding it is a plain Linear other than the head
    for module in model.modules():
        is_plain = type(module) is torch.nn.Linear and module is not head
        for parameter in module.parameters(recurse=False):
            plain[id(parameter)] = plain.get(id(parameter), True) and is_plain
    cast = {}  # id(old parameter) -> its cast (a weight shared by two linear layers stays shared)
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module is head:
            continue
        for name, parameter in list(module.named_parameters(recurse=False)):
            if plain[id(parameter)] and parameter.dtype == torch.float32:
                if id(parameter) not in cast:
                    cast[id(parameter)] = torch.nn.Parameter(parameter.detach().to(dtype), requires_grad=False)
                setattr(module, name, cast[id(parameter)])
    return len(cast)


def full_precision(model: torch.nn.Module) -> bool:
    """Whether every floating-point parameter is float32 (or float64): only then do the sampler's log-probs equal
    the training forward's to float rounding (half-precision weights round differently in each kernel)."""
    return all(p.dtype in (torch.float32, torch.float64) for p in model.parameters() if p.is_floating_point())


def default_output_dir(model, trainer_name: str) -> str:
    """The output directory of a trainer given no config, as TRL names it: '<model name>-<trainer_name>', the model's
    name being the last part of its hub id or path (a trailing slash ignored: 'org/model/' gives 'model-...'), of
    its config's `_name_or_path` for a model object, or 'model' when that is empty."""
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "") or "model"
    return f"{str(name).rstrip('/').split('/')[-1]}-{trainer_name}"


# ------------------------------------------------------------------------------------------------- LoRA


def apply_peft(model, peft_config):
    try:
        from peft import get_peft_model
    except ImportError as error:
        raise ImportError(f"peft_config needs peft: {install_command('peft', 'peft')}") from error
    if is_peft_model(model):
        raise ValueError("The model already has a LoRA adapter (a PeftModel): do not pass peft_config as well.")
    return get_peft_model(model, peft_config)


def check_liger_kernel(model, args) -> None:
    """TRL 1.16's checks for `use_liger_kernel=True`, in its words: a PEFT adapter on the LM head (the log-probs are
    computed from the head's weight directly, so it would never train), prompt learning (its virtual tokens shift
    the positions Liger's fused head reads) and `fused_linear_cross_entropy` (it replaces the forward) are refused,
    and a missing liger-kernel raises transformers' ImportError. grpokit runs no Liger kernel itself (the field is
    "not implemented" and warns so): its chunked LM head already avoids full-vocabulary logits."""
    if not args.use_liger_kernel:
        return
    if is_peft_model(model):
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(model.get_output_embeddings(), BaseTunerLayer):
            raise ValueError(
                "Applying a PEFT adapter to `lm_head` is not supported: the log-probabilities are "
                "computed from `lm_head.weight` directly, so the adapter would never be trained. Remove "
                "`'lm_head'` from your `target_modules`."
            )
        if model.active_peft_config.is_prompt_learning:
            raise ValueError(
                "use_liger_kernel=True is not supported with prompt-learning PEFT methods (PromptTuning, "
                "PrefixTuning, P-Tuning): their virtual tokens are not inputs of the fused LM head. Use a "
                "weight-based adapter such as LoRA, or use_liger_kernel=False."
            )
    if (args.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
        raise ValueError(
            '`liger_kernel_config={"fused_linear_cross_entropy": True}` is not supported: it replaces '
            "the model's forward, which this trainer patches with a fused LM head."
        )
    from transformers.utils import is_liger_kernel_available

    if not is_liger_kernel_available():
        raise ImportError(
            "You have set `use_liger_kernel` to `True` but liger-kernel >= 0.3.0 is not available. "
            "Please install it with `pip install liger-kernel`"
        )


@contextlib.contextmanager
def reference_policy(policy, frozen_reference=None):
    """The reference policy: a frozen copy when there is one, else (LoRA) the policy with its adapter disabled.
    A frozen FSDP2 reference is resharded after use: FSDP2 leaves a root module's parameters whole after a forward
    that no backward follows, and the reference's next forward is a generation away (the adapter-off policy's next
    forward comes at once, so it stays as it is)."""
    if frozen_reference is not None:
        try:
            yield frozen_reference
        finally:
            reshard(frozen_reference)
    elif is_peft_model(policy):
        with policy.disable_adapter():
            yield policy
    else:
        raise ValueError("beta > 0 needs a reference policy: a frozen copy or a LoRA model.")


def save_merged(model, directory: Path, tokenizer=None, weights: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter merged into a copy of the base weights, saved as a plain model (the live model is untouched).
    A sharded model (FSDP2, ZeRO-3) cannot be copied: pass its gathered full state dict as `weights` (on the
    process that writes), and the copy is rebuilt from those (`unsharded_copy`)."""
    plain = copy.deepcopy(model) if weights is None else unsharded_copy(model, weights)
    merged = plain.merge_and_unload()
    merged.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)


def unsharded_copy(model, weights: dict[str, torch.Tensor]):
    """A plain PeftModel like the sharded `model` (same architecture, config and adapter), holding `weights` (its
    gathered full state dict). Built on the meta device and given the tensors in place, so it costs no memory beyond
    `weights`. Its non-persistent buffers (e.g. rotary frequencies) stay on the meta device: it is for merging and
    saving, not for forwards."""
    from peft import get_peft_model
    from torch.distributed.fsdp import FSDPModule

    base = model.get_base_model()
    # fully_shard turns a module's class into a subclass of FSDPModule and that class: take the model's own.
    architecture = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))
    adapter = model.active_adapter
    with torch.device("meta"):
        plain = get_peft_model(
            architecture(copy.deepcopy(base.config)), copy.deepcopy(model.peft_config[adapter]), adapter_name=adapter
        )
    missing, _ = plain.load_state_dict(weights, strict=False, assign=True)
    tied = tied_weight_keys(plain.get_base_model())
    missing = [k for k in missing if not any(k.endswith(t) for t in tied)]
    if missing:
        raise RuntimeError(f"The gathered weights do not cover the model: missing {missing[:5]}.")
    plain.get_base_model().tie_weights()  # a tied head given no tensor of its own takes the embeddings'
    return plain


def whole_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the policy with whole parameters of its own and no wrapper's hooks (the asynchronous producer's,
    taken before accelerate wraps the policy). A model that ZeRO-3 loaded partitioned (accelerate's zero.Init) holds
    empty partitions: the copy is built on the meta device and given the gathered weights (a collective: every
    process calls it), and the buffers and tensor attributes, which ZeRO-3 does not partition, of the model."""
    if not is_zero3(model):
        return copy.deepcopy(model)
    weights = full_state_dict(model)
    base = model.get_base_model() if is_peft_model(model) else model
    with torch.device("meta"):
        plain = type(base)(copy.deepcopy(base.config))
        if is_peft_model(model):
            from peft import get_peft_model  # optional (grpokit[peft]): only a LoRA policy needs it

            adapter = model.active_adapter
            plain = get_peft_model(plain, copy.deepcopy(model.peft_config[adapter]), adapter_name=adapter)
    missing, _ = plain.load_state_dict(weights, strict=False, assign=True)
    plain_base = plain.get_base_model() if is_peft_model(plain) else plain
    plain_base.generation_config = copy.deepcopy(base.generation_config)
    tied = tied_weight_keys(plain_base)
    missing = [k for k in missing if not any(k.endswith(t) for t in tied)]
    if missing:
        raise RuntimeError(f"The gathered weights do not cover the model: missing {missing[:5]}.")
    plain_base.tie_weights()
    # Non-persistent buffers (rotary frequencies) and plain tensor attributes were made on the meta device.
    for mine, theirs in zip(plain.modules(), model.modules()):
        for name, value in vars(mine).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(mine, name, getattr(theirs, name).detach().clone())
        for name, buffer in list(mine.named_buffers(recurse=False)):
            if buffer.is_meta:
                mine.register_buffer(name, theirs.get_buffer(name).detach().clone(), persistent=False)
    for mine, theirs in zip(plain.parameters(), model.parameters()):
        mine.requires_grad_(theirs.requires_grad)
    return plain.train(model.training)


def adapter_parameter_names(model) -> dict[str, str]:
    """{name in peft's saved adapter file: name of the model's parameter} for every trainable parameter. peft's own
    `get_peft_model_state_dict` renames them (it drops the adapter name and wrappers' prefixes), so it is asked with
    one small marker tensor per trainable parameter, holding the parameter's index, and each saved name is matched
    to its parameter by the marker it comes back with. Not the parameters themselves: from peft 0.22 it gathers
    sharded (DTensor) values into new full tensors, a collective, and they no longer are the parameters."""
    from peft import get_peft_model_state_dict

    names = [name for name, p in model.named_parameters() if p.requires_grad]
    markers = {name: torch.tensor([index], dtype=torch.int64) for index, name in enumerate(names)}
    saved = get_peft_model_state_dict(
        model, state_dict=markers, adapter_name=model.active_adapter, save_embedding_layers=False
    )
    return {key: names[int(value.reshape(-1)[0])] for key, value in saved.items()}


def load_model_weights(model, directory: Path) -> None:
    """Load what save_model wrote into `directory` back into `model` (adapter only for LoRA models)."""
    from safetensors.torch import load_file

    if is_peft_model(model) and not is_sharded(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(directory / "adapter_model.safetensors")))
        return
    if is_peft_model(model):  # full tensors into sharded parameters: under the parameters' own names
        saved, names = load_file(str(directory / "adapter_model.safetensors")), adapter_parameter_names(model)
        unknown, absent = sorted(set(saved) - set(names)), sorted(set(names) - set(saved))
        if unknown or absent:
            raise RuntimeError(
                f"The adapter in {directory} does not match the model's: unexpected {unknown[:5]}, "
                f"missing {absent[:5]}."
            )
        load_full_state_dict(model, {names[key]: value for key, value in saved.items()}, strict=False)
        return
    weights = {}
    for file in sorted(directory.glob("model*.safetensors")):
        weights.update(load_file(str(file)))
    missing, unexpected = load_full_state_dict(model, weights, strict=False)  # sharded where the model is
    tied = tied_weight_keys(model)
    missing = [k for k in missing if k not in tied and not any(k.endswith(t) for t in tied)]
    if unexpected or missing:
        raise RuntimeError(
            f"Checkpoint {directory} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}."
        )


def prompt_length_limit(model, args) -> PromptLimit | None:
    """The prompt tokens kept (the last ones): max_prompt_length (None by default: all, as in TRL 1.16), lowered so
    that prompt + completion fits the model's positions; fails before anything runs if a completion alone does not
    fit. Nothing is said here: the limit warns once, when a prompt is actually cut (`PromptLimit.cut`)."""
    config = getattr(model, "config", None)
    if config is not None:  # a VLM's positions are its language model's
        config = text_config_of(config)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return PromptLimit.of(args.max_prompt_length)
    if args.max_completion_length >= limit:
        raise ValueError(
            f"max_completion_length={args.max_completion_length} does not fit the model's context "
            f"({limit} positions); lower max_completion_length."
        )
    if args.max_prompt_length is not None and args.max_prompt_length + args.max_completion_length <= limit:
        return PromptLimit.of(args.max_prompt_length)
    return PromptLimit(
        limit - args.max_completion_length,
        f"so that prompt + completion fits the model's {limit} "
        f"positions with max_completion_length="
        f"{args.max_completion_length}",
    )


def reshard(model: torch.nn.Module) -> None:
    """Free the whole parameters FSDP2 holds for a model's modules after a forward (nothing to do elsewhere)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """TRL's reference sync: ref <- alpha * policy + (1 - alpha) * ref (alpha = 1 copies the policy)."""
    # Under FSDP2 a root module stays unsharded after a forward that no backward follows (an in-step generation's,
    # the reference's): its parameters are then whole tensors where the other's are shards. Reshard both, so that
    # shard meets shard.
    reshard(reference)
    reshard(policy)
    # named_parameters, not state_dict: tied weights (embeddings = LM head) must be mixed once, not twice.
    policy_parameters = dict(policy.named_parameters())
    for name, value in reference.named_parameters():
        value.mul_(1 - alpha).add_(policy_parameters[name].detach().to(value.dtype), alpha=alpha)


def sync_reference(args, reference: torch.nn.Module | None, policy: torch.nn.Module, step: int) -> None:
    """TRL's SyncRefModelCallback: with sync_ref_model, every ref_model_sync_steps optimizer steps (`step`: the steps
    taken) the policy is mixed into the moving reference (`mix_into_reference`, ref_model_mixup_alpha)."""
    if args.sync_ref_model and reference is not None and step % args.ref_model_sync_steps == 0:
        mix_into_reference(reference, policy, args.ref_model_mixup_alpha)


def build_policy(model, processing_class, peft_config, args, quantization_config=None, check_tokenizer=None):
    """The policy and its processing class from GRPOTrainer's arguments: a path / hub id is loaded, its tokenizer
    first, so that `check_tokenizer(processing_class, model_or_config)` refuses a tokenizer the run cannot use
    before the weights load; a model object is taken as it is (its tokenizer loaded from its config's name when
    none is given). Dropout is turned off when asked, LoRA applied when a peft_config is given."""
    trust_remote_code = args.trust_remote_code
    if isinstance(model, str):
        name, config = model, None
        if processing_class is None:
            config = load_config(name, trust_remote_code)
            processing_class = load_tokenizer(name, trust_remote_code, is_vision_language_model(config))
        if check_tokenizer is not None:
            check_tokenizer(processing_class, config or load_config(name, trust_remote_code))
        init_kwargs = {
            **(args.model_init_kwargs or {}),
            **({"quantization_config": quantization_config} if quantization_config is not None else {}),
        }
        model = load_causal_lm(name, init_kwargs, trust_remote_code)
    else:
        if processing_class is None and hasattr(model, "config"):
            name = getattr(model.config, "_name_or_path", "")
            vision = is_vision_language_model(model)
            processing_class = load_tokenizer(name, trust_remote_code, vision) if name else None
        if check_tokenizer is not None:
            check_tokenizer(processing_class, model)
    if processing_class is not None:
        tokenizer = tokenizer_of(processing_class)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
            warnings.warn("The tokenizer has no pad token: using its EOS token for padding.", stacklevel=3)
    if args.disable_dropout:
        disable_dropout(model)
    vision = is_vision_language_model(model)
    if vision and args.freeze_vision_tower:  # LoRA adapts the language model only; full training freezes the rest
        if peft_config is not None:
            peft_config = language_only_lora(peft_config, model)
        else:
            freeze_vision(model)
    keep_4bit_layers_trainable(model)
    if peft_config is not None:
        model = apply_peft(model, peft_config)
    check_liger_kernel(model, args)
    if args.cast_lm_head_to_fp32:
        keep_head_in_float32(model)
    contiguous_head_input(model)
    return model, processing_class


def keep_head_in_float32(model: torch.nn.Module) -> None:
    """TRL's cast_lm_head_to_fp32 (ScaleRL): the LM head's weight is held, trained and saved in float32, and its
    input cast to float32, so the logits are float32. A tied input embedding shares the weight: its output is cast
    back to the model's dtype, so that the rest of the model computes as before."""
    head = output_embeddings(model)
    if not isinstance(head, torch.nn.Linear) or not head.weight.is_floating_point():
        raise ValueError("cast_lm_head_to_fp32 needs a model whose output embedding is an nn.Linear.")
    dtype = head.weight.dtype
    if dtype == torch.float32:
        return
    head.float()  # in place: a tied embedding holds the same Parameter, which becomes float32 too
    head.register_forward_pre_hook(lambda module, args: (args[0].to(torch.float32), *args[1:]))
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and embeddings.weight is head.weight:
        embeddings.register_forward_hook(lambda module, args, output: output.to(dtype))


def _contiguous_input(module, args):
    """`contiguous_head_input`'s pre-hook: the first positional input made contiguous, the rest as they are."""
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def contiguous_head_input(model) -> bool:
    """Give the LM head a contiguous input (a forward pre-hook on the output embeddings, once per model). With
    `logits_to_keep` transformers hands the head a slice of the hidden states, [n, t, H] out of [n, T, H], whose
    rows torch's matmul does not fold into one [n·t, H] matrix when the head's weight needs no gradient (LoRA, a
    frozen reference, any frozen head): it broadcasts the weight to [n, H, V] for a bmm, which the CPU's bfloat16
    kernel makes contiguous, n copies of the head: +519 MiB for the 2 prompts of a QLoRA rollout's prefill at the
    Qwen2.5-0.5B shape, +4.2 GiB for 16. The slice's own copy is n·t·H values. Returns whether a hook was added."""
    head = output_embeddings(model)
    if not isinstance(head, torch.nn.Module) or getattr(head, "_grpokit_contiguous_input", False):
        return False
    head.register_forward_pre_hook(_contiguous_input)
    head._grpokit_contiguous_input = True
    return True


def keep_4bit_layers_trainable(model) -> int:
    """Stop bitsandbytes (0.50) from repacking a 4-bit layer's weight for its AVX512-BF16 CPU kernel: it does so in
    place on the first forward in eval mode without gradients (the sampler's), never unpacks it, and the training
    forward and backward do not expect that layout (Unsloth's CPU backend turns it off for the same reason). On
    that CPU the sampler then runs bitsandbytes' unpacked kernel. Returns how many layers were set."""
    layers = [m for m in model.modules() if is_linear4bit(m) and getattr(m, "support_avx512bf16_for_cpu", False)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def compile_blocks(module: torch.nn.Module, **compile_kwargs) -> None:
    """torch_compile as regional compilation (accelerate's `compile_regions`, in place): every block of a ModuleList
    of same-class blocks (the decoder layers; a vision tower's too) is compiled with `Module.compile`, so one
    compilation serves all the blocks of a class; blocks are not searched inside. The rest stays eager."""
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) > 1 and len({type(block) for block in child}) == 1:
            for block in child:
                block.compile(**compile_kwargs)
        else:
            compile_blocks(child, **compile_kwargs)


LAYER_CHECKPOINTING_OPTIONS = ("every_n_layers", "offload")  # transformers' own keys, not torch.utils.checkpoint's


def enable_gradient_checkpointing(model, args, device: torch.device) -> None:
    """After the reference is copied (a copy would inherit it, and a checkpointed model cannot share prompts).
    `gradient_checkpointing_kwargs` are read as transformers' Trainer reads them (transformers >= 5.19):
    `every_n_layers` checkpoints only every n-th decoder layer (the others keep their activations: memory given back
    for speed), `offload` keeps the checkpointed layers' inputs in pinned host memory; every other key goes to
    `torch.utils.checkpoint.checkpoint`."""
    if not args.gradient_checkpointing:
        return
    checkpoint_kwargs = dict(args.gradient_checkpointing_kwargs or {})
    layer_options = {key: checkpoint_kwargs.pop(key) for key in LAYER_CHECKPOINTING_OPTIONS if key in checkpoint_kwargs}
    if layer_options.get("offload") and torch.device(device).type == "cpu":  # transformers' pinning would fail
        warnings.warn(
            "gradient_checkpointing_kwargs offload=True has no effect on a CPU: the activations are in host "
            "memory already. It is left off; set it on GPU runs.",
            UserWarning,
            stacklevel=3,
        )
        del layer_options["offload"]
    checkpoint_kwargs = checkpoint_kwargs or {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 (gradient_* is a deprecated alias)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs, **layer_options)
    else:
        import transformers

        known = inspect.signature(model.gradient_checkpointing_enable).parameters
        unknown = [key for key in layer_options if key not in known]
        if unknown:
            raise ValueError(
                f"gradient_checkpointing_kwargs {unknown}: transformers {transformers.__version__} "
                "checkpoints every layer and has no such option (it came with transformers 5.19). "
                "Upgrade transformers, or remove the key."
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs, **layer_options)
    if is_peft_model(model):  # frozen embeddings would cut the graph through checkpointed blocks
        model.enable_input_require_grads()


def build_reference(model_argument, policy, args):
    """The frozen reference policy, or None: none when beta = 0, and none with LoRA, whose reference is the same
    model with its adapter disabled (no second copy of the weights; see `reference_policy`). Its weights are in
    `ref_model_dtype` when set (e.g. bfloat16: inference only, half a float32 copy; int8: its linear layers in int8,
    the rest in bfloat16), else in the policy's dtype.
    Under ZeRO-3 with the model loaded partitioned (accelerate's zero.Init), a second load of it, partitioned the
    same way (a partitioned model cannot be copied)."""
    if args.ref_model_dtype and is_peft_model(policy):
        raise ValueError(
            f"ref_model_dtype={args.ref_model_dtype!r} with LoRA: the reference is the base model with "
            f"the adapter off, not a copy, so it has no dtype of its own. Load the base in that dtype "
            f"(model_init_kwargs={{'dtype': {args.ref_model_dtype!r}}}), or unset ref_model_dtype."
        )
    if args.ref_model_dtype and args.beta == 0:
        warnings.warn(
            f"ref_model_dtype={args.ref_model_dtype!r} has no effect with beta=0: there is no reference model.",
            UserWarning,
            stacklevel=3,
        )
    if args.beta == 0 or is_peft_model(policy):
        return None
    int8 = args.ref_model_dtype == "int8"  # bfloat16, then int8 linear layers (grpokit/quantized.py)
    dtype = torch.bfloat16 if int8 else getattr(torch, args.ref_model_dtype) if args.ref_model_dtype else None
    if int8 and is_zero3(policy):
        raise NotImplementedError(
            "ref_model_dtype='int8' under ZeRO-3 is not supported (the reference is loaded "
            "partitioned there); use ref_model_dtype='bfloat16'."
        )
    if not is_zero3(policy):
        reference = frozen_copy(policy, dtype)
        if int8:
            quantize_linears(reference)
        elif dtype is None and args.bf16 and not args.sync_ref_model and AUTOCAST_REFERENCE_LINEARS:
            linears_in_autocast_dtype(reference, torch.bfloat16)  # its forwards run under bf16 autocast
        contiguous_head_input(reference)
        return reference
    if not isinstance(model_argument, str):
        raise NotImplementedError(
            "Under ZeRO-3 the model was loaded already partitioned, so its reference cannot be "
            "copied from it: pass the model as a path or hub id (GRPOTrainer(model=...)), or "
            "set beta=0."
        )
    init_kwargs = {**(args.model_init_kwargs or {}), **({"dtype": dtype} if dtype is not None else {})}
    reference = load_causal_lm(model_argument, init_kwargs, args.trust_remote_code)
    if args.disable_dropout:
        disable_dropout(reference)
    contiguous_head_input(reference)
    return reference.requires_grad_(False).eval()
