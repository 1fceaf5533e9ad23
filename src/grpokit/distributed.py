"""Setting up accelerate for one process or many (torchrun / accelerate launch): DDP, FSDP2 or DeepSpeed ZeRO-1/2/3.

Three things change for grpokit when parameters are sharded (`is_sharded`: FSDP2 or ZeRO-3): every forward is a
collective, so the processes' sampling loops run in step until all of them are done (`all_processes_done`); the
log-probs take the model's own forward (the chunked LM head reads the head's weight outside it); and checkpoints
either gather full, unsharded state dicts (`full_state_dict`, resumable under DDP, FSDP2 or in one process) or
hold each process's shards (`save_sharded`; DeepSpeed's own format under DeepSpeed).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from datetime import timedelta

import torch

from .compat import deepspeed_config_of, is_peft_model, reset_accelerate_state
from .config import GRPOConfig


def build_accelerator(args: GRPOConfig):
    """An Accelerator with the run's precision. In a single process (a notebook, a test session) accelerate's
    process-wide state may hold an earlier trainer's precision; it is reset rather than refusing the new run."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    mixed_precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    # Under torchrun on a machine without an accelerator device, accelerate only forms a (gloo) process group when
    # told `cpu=True`; otherwise every process silently trains alone on the whole run.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = args.use_cpu or (world_size > 1 and not _has_accelerator_device())
    backend = args.ddp_backend
    kwargs = {"cpu": cpu, "mixed_precision": mixed_precision}
    plugin = deepspeed_plugin(args, world_size)
    if plugin is not None:
        kwargs["deepspeed_plugin"] = plugin
    fsdp = fsdp_plugin(args)
    if fsdp is not None:
        kwargs["fsdp_plugin"] = fsdp
    use_deepspeed = args.deepspeed is not None or _launch_uses("DEEPSPEED")
    if cpu and world_size > 1 and use_deepspeed:
        # DeepSpeed on CPU processes: accelerate forms no process group for it unless told gloo, and would count one
        # process while DeepSpeed's world has all of them.
        kwargs, backend = {"mixed_precision": mixed_precision, "deepspeed_plugin": plugin}, backend or "gloo"
    # The process group and DDP as TrainingArguments' ddp_* fields set them in transformers' Trainer.
    ddp = {
        "find_unused_parameters": args.ddp_find_unused_parameters,
        "bucket_cap_mb": args.ddp_bucket_cap_mb,
        "broadcast_buffers": args.ddp_broadcast_buffers,
        "static_graph": args.ddp_static_graph,
    }
    kwargs["kwargs_handlers"] = [
        InitProcessGroupKwargs(backend=backend, timeout=timedelta(seconds=args.ddp_timeout)),
        DistributedDataParallelKwargs(**{name: value for name, value in ddp.items() if value is not None}),
    ]
    if args.accelerator_options().get("use_configured_state"):
        # transformers' meaning: the script set accelerate's state up, and the trainer takes it as it is.
        if not PartialState._shared_state:
            raise ValueError(
                "accelerator_config use_configured_state=True needs accelerate's state set up before "
                "the trainer (e.g. `PartialState()` or `Accelerator()` in the script), and there is "
                "none: create it first, or drop use_configured_state."
            )
        return Accelerator(**kwargs)
    try:
        accelerator = Accelerator(**kwargs)
    except ValueError:
        if PartialState().num_processes > 1:
            raise
        reset_accelerate_state()
        accelerator = Accelerator(**kwargs)
    if world_size > 1 and accelerator.num_processes == 1:
        # The script created accelerate's state earlier without a process group (e.g. `PartialState()` on a CPU-only
        # machine, where it needs cpu=True): none was formed, so nothing is torn down by creating it again.
        reset_accelerate_state()
        accelerator = Accelerator(**kwargs)
    _fsdp_on_cpu(accelerator, fsdp)
    # Fail at once rather than hang or train wrongly later (README.md, "Scaling out").
    unsupported = {
        "FSDP": None
        if accelerator.is_fsdp2
        else "FSDP1 (FullyShardedDataParallel) is not supported; set `fsdp_version: 2` in the accelerate config "
        "(or FSDP_VERSION=2) to use FSDP2",
        "DEEPSPEED": None
        if deepspeed_stage(accelerator) in (1, 2, 3)
        else f"ZeRO stage {deepspeed_stage(accelerator)} is not one of 1, 2, 3",
    }.get(accelerator.distributed_type.value)
    if unsupported:
        raise NotImplementedError(
            f"grpokit does not support {accelerator.distributed_type.value} yet: {unsupported}. "
            f"Use DDP (plain torchrun, or examples/accelerate/ddp.yaml) or FSDP2 "
            f"(examples/accelerate/fsdp2.yaml)."
        )
    return accelerator


def _launch_uses(kind: str) -> bool:
    """Whether the launch asks for DeepSpeed / FSDP: `accelerate launch` sets ACCELERATE_USE_<kind> from its config."""
    return os.environ.get(f"ACCELERATE_USE_{kind}", "false").lower() == "true"


def deepspeed_plugin(args: GRPOConfig, world_size: int):
    """accelerate's DeepSpeedPlugin for the `deepspeed` field (None when unset), as transformers' Trainer makes it:
    the config as accelerate's deepspeed_config_file, its explicit values checked against the run's."""
    config = args.deepspeed_config()
    if config is None:
        return None
    if _launch_uses("FSDP"):
        raise ValueError(
            "GRPOConfig.deepspeed is set, but the launch asks for FSDP (ACCELERATE_USE_FSDP, from an "
            "accelerate config with FSDP): use one of them."
        )
    missing = [
        name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ
    ]
    if missing:  # DeepSpeed would look for MPI instead and fail on an import
        raise ValueError(
            f"GRPOConfig.deepspeed needs a distributed launcher ({', '.join(missing)} not set): run the "
            f"script with `torchrun --nproc_per_node N` (N may be 1) or `accelerate launch`, or drop "
            f"`deepspeed` to train in this process."
        )
    if _launch_uses("DEEPSPEED"):
        warnings.warn(
            "GRPOConfig.deepspeed is set and `accelerate launch` configured DeepSpeed too: the run uses "
            "GRPOConfig.deepspeed (as transformers' Trainer does).",
            UserWarning,
            stacklevel=3,
        )
    expected = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size,
        "gradient_clipping": args.max_grad_norm if args.max_grad_norm > 0 else 0.0,
        "bf16.enabled": bool(args.bf16),
        "fp16.enabled": bool(args.fp16),
    }
    mismatches = []
    for key, value in expected.items():
        section, _, name = key.rpartition(".")
        given = (config.get(section, {}) if section else config).get(name, "auto")
        if given != "auto" and given != value:
            mismatches.append(f"{key}: {given!r} in the DeepSpeed config, {value!r} from GRPOConfig")
    if mismatches:
        raise ValueError(
            "GRPOConfig.deepspeed disagrees with the run's settings:\n  "
            + "\n  ".join(mismatches)
            + "\nSet these to 'auto' in the DeepSpeed config (grpokit fills them), or change GRPOConfig "
            "(per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm, bf16, fp16)."
        )
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    if AcceleratorState._shared_state and AcceleratorState().distributed_type.value == "DEEPSPEED":
        # An earlier trainer in this process set DeepSpeed up, and accelerate takes one DeepSpeed plugin per process
        # (the process group stays): the same config runs on it; another one cannot.
        if getattr(AcceleratorState().deepspeed_plugin, "grpokit_config", None) != config:
            raise ValueError(
                "GRPOConfig.deepspeed differs from the DeepSpeed config an earlier trainer in this "
                "process used, and accelerate sets DeepSpeed up once per process: run this config in "
                "a process of its own."
            )
        return None
    plugin = DeepSpeedPlugin(hf_ds_config=json.loads(json.dumps(config)))
    plugin.grpokit_config = config  # as given (accelerate and configure_deepspeed fill the plugin's copy)
    return plugin


def deepspeed_stage(accelerator) -> int | None:
    """The ZeRO stage under DeepSpeed, else None."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if accelerator.distributed_type.value != "DEEPSPEED" or plugin is None:
        return None
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", plugin.zero_stage))


def configure_deepspeed(accelerator, args: GRPOConfig) -> None:
    """The DeepSpeed config values grpokit's step depends on (before `prepare`): micro-batch and accumulation as
    configured, and clipping by DeepSpeed, which takes the optimizer step inside backward()."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    config["train_batch_size"] = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    )
    config["gradient_clipping"] = args.max_grad_norm if args.max_grad_norm > 0 else 0.0
    if deepspeed_stage(accelerator) == 3:  # save_model gathers the partitioned weights into a full state dict
        config.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    accelerator.gradient_accumulation_steps = args.gradient_accumulation_steps


def zero3_inference_engine(model: torch.nn.Module, engine) -> torch.nn.Module:
    """A frozen ZeRO-3-partitioned model (the reference) wrapped by DeepSpeed for forwards only, with the
    training engine's resolved ZeRO configuration (and no optimizer)."""
    import copy

    import deepspeed

    config = copy.deepcopy(deepspeed_config_of(engine))
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    reference, *_ = deepspeed.initialize(model=model, config=config)
    reference.eval()  # (DeepSpeedEngine.eval returns None)
    return reference


def fsdp_plugin(args: GRPOConfig):
    """accelerate's FSDP2 plugin for the `fsdp` / `fsdp_config` fields (None when FSDP is off there), as
    transformers' Trainer makes it."""
    kwargs = args.fsdp_plugin_kwargs()
    if kwargs is None:
        return None
    if _launch_uses("DEEPSPEED"):
        raise ValueError(
            "GRPOConfig.fsdp is set, but the launch asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED, from "
            "an accelerate config with DeepSpeed): use one of them."
        )
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state and getattr(AcceleratorState(), "fsdp_plugin", None) is not None:
        # An earlier trainer in this process set FSDP up; accelerate keeps the first plugin.
        if getattr(AcceleratorState().fsdp_plugin, "grpokit_kwargs", None) != kwargs:
            raise ValueError(
                "GRPOConfig.fsdp / fsdp_config differ from the FSDP setup an earlier trainer in this "
                "process used, and accelerate sets FSDP up once per process: run this config in a "
                "process of its own."
            )
        return None
    if _launch_uses("FSDP"):
        warnings.warn(
            "GRPOConfig.fsdp is set and `accelerate launch` configured FSDP too: the run uses "
            "GRPOConfig.fsdp / fsdp_config (as transformers' Trainer does).",
            UserWarning,
            stacklevel=3,
        )
    plugin = FullyShardedDataParallelPlugin(**kwargs)
    plugin.grpokit_kwargs = kwargs
    return plugin


def _fsdp_on_cpu(accelerator, plugin=None) -> None:
    """accelerate turns an FSDP config into FSDP only on accelerator devices; on CPU processes (gloo) it silently
    trains with DDP instead. torch's FSDP2 runs on CPU, so an FSDP2 request (`accelerate launch` with an FSDP config
    on a machine without a GPU, ACCELERATE_USE_FSDP=true FSDP_VERSION=2 under torchrun, or GRPOConfig.fsdp: `plugin`)
    is honoured there too."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    if plugin is None:
        if not _launch_uses("FSDP"):
            return
        if os.environ.get("FSDP_VERSION", "1") != "2":
            raise NotImplementedError(
                "FSDP1 (FullyShardedDataParallel) is not supported; set `fsdp_version: 2` in "
                "the accelerate config (or FSDP_VERSION=2) to use FSDP2."
            )
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables
    from accelerate.state import PartialState

    accelerator.state.fsdp_plugin = plugin
    # Both shared states: every AcceleratorState() copies PartialState's distributed type over its own.
    PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are sharded, by FSDP2 or DeepSpeed ZeRO-3 (each process holds a slice)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or is_zero3(model)


def is_zero3(model: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the model's parameters (they carry a `ds_id`)."""
    first = next(model.parameters(), None)
    return first is not None and hasattr(first, "ds_id")


def local_shard(parameter: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter: an FSDP2 DTensor's local shard, a ZeRO-3 partition, else the tensor."""
    if hasattr(parameter, "to_local"):
        return parameter.to_local()
    return getattr(parameter, "ds_tensor", parameter)


def all_processes_done(done: bool) -> bool:
    """True once `done` holds on every process (a collective: every process must call it, equally often)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return done
    flag = torch.tensor([0 if done else 1], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(flag)
    return int(flag.item()) == 0


class ProducerCollectives:
    """The accelerator as the generation producer's thread sees it when several processes train (asynchronous
    generation, grpokit.producer): the same device, process index and autocast, but `gather`, `reduce` and
    `gather_objects` run on a gloo process group of the producers' own. The producers' gathers (scores for the
    advantages, metrics) so never interleave with the collectives of the trainer's thread (DDP's gradient
    all-reduces, the step's metrics): each group sees its own calls in one order on every process (the producers
    make the same batches one after another). Tensors travel through the CPU: the producers' are small (one score
    or count per completion), and gloo on the CPU never competes with the training's NCCL streams."""

    def __init__(self, accelerator, group):
        self.accelerator, self.group = accelerator, group

    def __getattr__(self, name):
        return getattr(self.accelerator, name)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's `tensor` (the same shape on each) concatenated along dim 0, as accelerate's gather."""
        import torch.distributed as dist

        local = (tensor.reshape(1) if tensor.ndim == 0 else tensor).detach().cpu().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.accelerator.num_processes)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts).to(tensor.device)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        """The sum (or mean) of `tensor` over the processes, as accelerate's reduce."""
        import torch.distributed as dist

        total = tensor.detach().cpu().clone()
        dist.all_reduce(total, group=self.group)
        if reduction == "mean":
            total = total / self.accelerator.num_processes
        return (total * scale if scale != 1.0 else total).to(tensor.device)


def gathered_parameters(parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whole copies of parameters: ZeRO-3 partitions gathered together, FSDP2 DTensors one by one (collectives
    either way: every process calls it with the same parameters), others cloned."""
    if parameters and hasattr(parameters[0], "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
            return [p.detach().clone() for p in parameters]
    return [(p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone() for p in parameters]


def new_producer_group():
    """A gloo process group for the generation producers (`ProducerCollectives`); a collective: every process calls
    it at the same point (the trainer's thread, when the producers start)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def gather_objects(accelerator, values: list) -> list:
    """accelerate's gather_object (every process's list, concatenated) over `accelerator`'s processes: on the
    producers' own group for a `ProducerCollectives`."""
    if accelerator.num_processes == 1:
        return values
    group = getattr(accelerator, "group", None)
    if group is None:
        from accelerate.utils import gather_object

        return gather_object(values)
    import torch.distributed as dist

    parts = [None] * accelerator.num_processes
    dist.all_gather_object(parts, values, group=group)
    return [value for part in parts for value in part]


_thread_group = threading.local()


@contextlib.contextmanager
def collectives_on(group):
    """In this thread, the collectives grpokit makes outside the accelerator (the vLLM server client's barrier)
    run on `group` (the producers' own) instead of the default group."""
    _thread_group.group = group
    try:
        yield
    finally:
        _thread_group.group = None


def barrier() -> None:
    """dist.barrier on this thread's group (`collectives_on`), else the default one."""
    import torch.distributed as dist

    dist.barrier(group=getattr(_thread_group, "group", None))


def at_least_global_quantile(accelerator, values: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """True where a masked entry of `values` (>= 0, e.g. entropies) is at least the `quantile` of the masked entries
    of every process (TRL's `get_high_entropy_mask`); all False where no process has any."""
    pad = -1e9  # the values are >= 0: the padding cannot be a value
    gathered = accelerator.gather(accelerator.pad_across_processes(values[mask.bool()].float(), dim=0, pad_index=pad))
    gathered = gathered[gathered != pad]
    if gathered.numel() == 0:
        return torch.zeros_like(values, dtype=torch.bool)
    return (values * mask.float() >= torch.quantile(gathered, quantile)) & mask.bool()


def _collective_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with full (unsharded) tensors on the CPU. Under FSDP2 it is a collective (every
    process must call it) and only the main process gets the tensors; the others get an empty dict. Under ZeRO-3
    (a collective too) every process gets them. For the trainable parameters alone: `trainable_parameters`."""
    if is_zero3(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if not is_sharded(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters as full tensors on the CPU, on every process: under FSDP2 / ZeRO-3 a collective,
    gathered one parameter at a time. (torch's `ignore_frozen_params` would still gather a frozen LM head tied to
    the embeddings: it drops a frozen tensor under one of its names only.)"""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if is_zero3(model):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {name: p.detach().cpu().clone() for name, p in named}
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for name, p in named}


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], strict: bool = True):
    """Load full tensors into a model, sharding them where the model is sharded. Returns (missing, unexpected)."""
    if not is_sharded(model):
        return model.load_state_dict(state, strict=strict)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    return set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def full_optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """The optimizer state as a portable dict: under FSDP2 gathered and keyed by parameter name (a collective; the
    main process gets it), otherwise the optimizer's own state dict."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load what `full_optimizer_state` wrote, whichever way the run that wrote it was laid out."""
    keyed_by_name = any(isinstance(p, str) for group in state["param_groups"] for p in group["params"])
    if not keyed_by_name and not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    if not keyed_by_name:  # positions in the optimizer's parameter list -> parameter names
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        state = {
            "state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _has_accelerator_device() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 knows CUDA, XPU, MPS, ...
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def check_backend(accelerator, model: torch.nn.Module, args: GRPOConfig) -> None:
    """What this backend (or LoRA on it) cannot run, refused before anything is prepared, with the way out."""
    lora = is_peft_model(model)  # a frozen base with an adapter
    prompt_learning = lora and model.active_peft_config.is_prompt_learning  # prompt / prefix tuning
    if args.sync_ref_model and lora:
        raise ValueError(
            "sync_ref_model with LoRA is not supported: the reference is the base model with the adapter "
            "off, and the base weights never change. Train without LoRA to refresh the reference, or "
            "turn sync_ref_model off."
        )
    stage = deepspeed_stage(accelerator)
    if prompt_learning and (accelerator.is_fsdp2 or stage == 3):
        # peft saves such an adapter from its prompt encoder's live parameter, which these backends shard.
        raise NotImplementedError(
            "Prompt-learning adapters (prompt / prefix tuning) under FSDP2 or ZeRO-3 are not "
            "supported: use a LoRA-style adapter (e.g. peft.LoraConfig), or DDP or "
            "ZeRO-1/2."
        )
    if accelerator.is_fsdp2 and args.ref_model_dtype:
        raise NotImplementedError(
            f"ref_model_dtype={args.ref_model_dtype!r} under FSDP2 is not supported yet (the "
            f"reference is sharded with the policy's settings); unset it, or set the dtype of "
            f"both with model_init_kwargs={{'dtype': ...}}."
        )
    if args.torch_compile and (accelerator.is_fsdp2 or stage is not None):
        raise NotImplementedError(
            "torch_compile under FSDP2 / DeepSpeed is not verified in grpokit: turn it off "
            "there, or use it under DDP or in one process."
        )
    if stage == 3 and args.sync_ref_model:
        raise NotImplementedError(
            "sync_ref_model under ZeRO-3 is not supported yet (the policy's weights are "
            "partitioned); use ZeRO-2 or FSDP2."
        )


def place_before_reference_copy(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """On an accelerator, with the whole policy in this process (one process, or DDP), the policy moves to the device
    before the frozen reference is copied from it: the copy is then made on the device, and the host never holds two
    full copies of the weights (a 7B float32 policy and its reference: 56 GB of host memory). Measured on an H200 at
    the Qwen2.5-0.5B shape before this: peak host RSS 4.8 GB against TRL's 3.3. FSDP2 and DeepSpeed place the model
    themselves (sharded), and a model loaded quantized or across devices (`hf_device_map`) stays where it is."""
    if accelerator.device.type == "cpu" or accelerator.is_fsdp2 or deepspeed_stage(accelerator) is not None:
        return model
    if getattr(model, "hf_device_map", None) or getattr(model, "is_quantized", False):
        return model
    return model.to(accelerator.device)


def prepare_reference(accelerator, reference: torch.nn.Module | None, engine) -> torch.nn.Module | None:
    """Place the frozen reference like the policy: partitioned and wrapped for forwards under ZeRO-3 (as loaded),
    sharded under FSDP2, else moved to the device."""
    if reference is None:
        return None
    if is_zero3(reference):
        return zero3_inference_engine(reference, engine)
    if accelerator.is_fsdp2:
        from accelerate.utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, reference)
    return reference.to(accelerator.device)


def unwrap_model(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The model inside accelerate's wrappers. A model that no wrapper holds (one process, FSDP2, which shards in
    place) is returned as is: accelerate's own unwrap imports DeepSpeed wherever it is installed, and DeepSpeed
    imports MLflow (~55 MiB of resident memory) on a run that uses neither."""
    if not hasattr(model, "module") and not hasattr(model, "_orig_mod"):  # DDP, DeepSpeedEngine; torch.compile
        return model
    return accelerator.unwrap_model(model)


def as_wrapper_forward(wrapper: torch.nn.Module, module: torch.nn.Module, function, *args, **kwargs):
    """`function(*args, **kwargs)` run as the forward of `wrapper` (DDP around `module`), for a computation that
    calls the module's parts directly (its decoder, its head's weight): DDP prepares the gradient reduction of a
    backward only for what went through its forward (TRL's `_ForwardRedirection` does the same). Without a wrapper
    (wrapper is module), a plain call."""
    if wrapper is module:
        return function(*args, **kwargs)
    original = module.forward

    def forward(*unused_args, **unused_kwargs):
        module.forward = original
        return function(*args, **kwargs)

    module.forward = forward
    try:
        return wrapper()
    finally:
        module.forward = original
