"""The optimizer a run asks for: `optim` (with `optim_args`, `optim_target_modules`), `learning_rate`, `adam_beta1`,
`adam_beta2`, `adam_epsilon` and `weight_decay`, built through transformers' own optimizer registry
(`transformers.Trainer.get_optimizer_cls_and_kwargs`), so each name means what it means in TRL: `adamw_torch`,
`adamw_torch_fused` (torch's fused kernel, which also runs on CPU), `adafactor`, `sgd`, `adagrad`, `rmsprop`, the
bitsandbytes 8-bit and paged ones (`adamw_8bit`, `paged_adamw_32bit`, ...), torchao's 8-bit and 4-bit AdamW
(`adamw_torch_8bit`, `adamw_torch_4bit`), GaLore, schedule-free, ... and one of grpokit's own, `adamw_torch_bf16`
(torchao's AdamW with states in the weights' dtype, GRPOKIT_OPTIMIZERS). The low-precision ones (`pip install
'.[lowmem]'` in grpokit's checkout) run on the CPU too; tests/test_memory.py checks that they learn and resume
bitwise.

Weight decay skips biases and norm weights, as transformers' Trainer does (`Trainer.get_decay_parameter_names`).
With `weight_decay=0` (the default) that split changes nothing, so there is one parameter group, and
`optim='adamw_torch'` gives exactly `torch.optim.AdamW(trainable, lr, betas, eps, weight_decay=0)`: the same numbers
and the same state-dict layout as grpokit's optimizer before this module (which decayed every parameter).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from types import SimpleNamespace

import torch
from torch.optim.adam import adam as adam_update  # torch's functional Adam (torch.optim deletes its `adam` name)

from .extras import install_command


def decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of the parameters weight decay applies to: all but biases and norm weights (transformers' rule)."""
    from transformers import Trainer

    # An instance method that does not read `self` (transformers 4.x-5.x); tests/test_optim.py pins its answer.
    return set(Trainer.get_decay_parameter_names(None, model))


def _transformers_args(args) -> SimpleNamespace:
    """What transformers' optimizer handlers read from TrainingArguments, from a GRPOConfig (or TrainingArguments)."""
    from transformers.training_args import OptimizerNames, ParallelMode

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    values["optim"] = OptimizerNames(values["optim"])  # the registry is keyed by the enum
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    values["parallel_mode"] = ParallelMode.DISTRIBUTED if distributed else ParallelMode.NOT_PARALLEL
    return SimpleNamespace(**values)


# grpokit's own optimizer names, beside transformers' registry (TRL has no AdamW with bf16 states):
# `adamw_torch_bf16` is torchao's AdamW (`torchao.optim._AdamW`), whose states take the parameters' dtype: with
# bf16 weights, bf16 weights, gradients and states (6 bytes per parameter against AdamW's 16 with float32
# weights), each update computed in float32, the states rounded to the nearest bf16 and the weights stochastically
# (`RowChunkedAdam`; optim_args 'bf16_stochastic_round=False': to the nearest). Needs torchao (pip install
# '.[lowmem]' in grpokit's checkout).
GRPOKIT_OPTIMIZERS = ("adamw_torch_bf16",)


def _grpokit_optimizer(args) -> tuple[type, dict]:
    """The class and keyword arguments of one of GRPOKIT_OPTIMIZERS, as transformers' registry gives its own."""
    try:
        from torchao.optim import _AdamW
    except ImportError as error:
        raise ImportError(
            f"optim={args.optim!r} needs torchao: {install_command('lowmem', 'torchao')} ({error})"
        ) from error
    options = dict(pair.partition("=")[::2] for pair in (args.optim_args or "").replace(" ", "").split(",") if pair)
    rounding = options.pop("bf16_stochastic_round", "True").lower()
    if options or rounding not in ("true", "false"):
        raise ValueError(
            f"optim={args.optim!r} takes optim_args 'bf16_stochastic_round=True|False' only; got {args.optim_args!r}."
        )
    return _AdamW, dict(
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        bf16_stochastic_round=rounding == "true",
    )


def build_optimizer(params_or_model, args) -> torch.optim.Optimizer:
    """The optimizer of `args.optim` over the trainable parameters of a model, or over the parameters given.

    Given a model, weight decay skips biases and norm weights; given bare parameters there are no names to tell
    them apart, so weight decay applies to all of them. Optimizers that need the model itself (GaLore, LOMO) need a
    model. A missing package (bitsandbytes for the 8-bit and paged optimizers) raises an ImportError naming it.
    """
    from transformers import Trainer

    model = params_or_model if isinstance(params_or_model, torch.nn.Module) else None
    if model is not None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    else:
        named = [(None, p) for p in params_or_model if p.requires_grad]
    decayed = decay_parameter_names(model) if model is not None and args.weight_decay else None
    if decayed is None:
        groups = [{"params": [p for _, p in named], "weight_decay": args.weight_decay}]
    else:
        groups = [
            {"params": [p for name, p in named if name in decayed], "weight_decay": args.weight_decay},
            {"params": [p for name, p in named if name not in decayed], "weight_decay": 0.0},
        ]
        groups = [group for group in groups if group["params"]]
    if args.optim in GRPOKIT_OPTIMIZERS:
        optimizer_cls, kwargs = _grpokit_optimizer(args)
    else:
        try:
            optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(_transformers_args(args), model)
        except ImportError as error:
            raise ImportError(f"optim={args.optim!r} needs a package that is not installed: {error}") from error
    kwargs = dict(kwargs)
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        return optimizer_cls()(model, **kwargs)  # a factory that splits the model's parameters itself (Muon, Dion)
    for key in ("params", "model", "optimizer_dict"):  # handlers that choose the parameters (GaLore, LOMO, layer-wise)
        if key in kwargs:
            groups = kwargs.pop(key)
    optimizer = row_chunked(optimizer_cls)(groups, **kwargs)
    if "bitsandbytes" in optimizer_cls.__module__ and kwargs.get("optim_bits") == 8 and model is not None:
        # As transformers' Trainer: embeddings keep 32-bit optimizer states (8-bit ones destabilise them).
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


# ------------------------------------------------------------------------------ torchao's AdamW in row chunks

# torchao's low-precision AdamW updates each parameter in one compiled call that holds float32 copies of the
# parameter, its gradient and both states: for the Qwen2.5-0.5B tied embedding (136M elements) that is ~830 MiB at
# once, the peak of a full fine-tuning step. Above this many elements a parameter is updated a block of rows at a
# time instead.
CHUNK_ELEMENTS = 1 << 23
# torch's AdamW (`RowBlockedTorchAdam`): 8 MiB float32 temporaries, which the CPU heap serves without page faults
TORCH_ADAM_BLOCK_ELEMENTS = 1 << 21


@functools.cache  # one class per optimizer class
def row_chunked(optimizer_cls: type) -> type:
    """torchao's AdamW classes (8-bit, 4-bit, float8 states) with `RowChunkedAdam`'s step, torch's Adam and AdamW
    with `RowBlockedTorchAdam`'s; other classes as given."""
    if not isinstance(optimizer_cls, type):
        return optimizer_cls
    mixin = None
    if optimizer_cls in (torch.optim.Adam, torch.optim.AdamW):
        # torch >= 2.6: AdamW is Adam with decoupled weight decay, one functional update for both
        mixin = RowBlockedTorchAdam if issubclass(torch.optim.AdamW, torch.optim.Adam) else None
    else:
        try:
            from torchao.optim.adam import _AdamBase
        except ImportError:
            return optimizer_cls
        mixin = RowChunkedAdam if issubclass(optimizer_cls, _AdamBase) else None
    if mixin is None:
        return optimizer_cls
    return type(optimizer_cls.__name__, (mixin, optimizer_cls), {"__module__": optimizer_cls.__module__})


class RowBlockedTorchAdam:
    """Mixin for torch's Adam / AdamW (`optim="adamw_torch"`, transformers' and so TRL's choice on a CPU): its step,
    with each large parameter updated in blocks of rows where torch would run its single-tensor update.

    That update (torch's path for CPU tensors: no foreach kernels there) allocates `exp_avg_sq.sqrt()` and its
    quotient by the bias correction, two temporaries of a parameter's size: 1,038 MiB for the Qwen2.5-0.5B tied
    embedding, at the step's memory peak (weights, gradients and both states all live). In blocks of at most
    TORCH_ADAM_BLOCK_ELEMENTS elements they are 8 MiB each, under the training loop's mmap threshold
    (`cpu_memory.TRAINING_MMAP_THRESHOLD`): the heap serves them again and again, without the page faults of a
    fresh mapping per temporary. The update is elementwise, so each element goes through the same
    operations as in the whole-tensor call: bitwise the same weights and states (tested), and torch's state dict.
    Groups that torch runs otherwise (foreach, fused, capturable, differentiable, or foreach left to torch with
    parameters off the CPU) take torch's own step."""

    @torch.no_grad()
    def step(self, closure=None):
        if not all(_single_tensor_update(group) for group in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            amsgrad = group["amsgrad"]
            for i, p in enumerate(params):
                blocks = [slice(None)] if has_complex else _row_blocks(p, [], TORCH_ADAM_BLOCK_ELEMENTS)
                for rows in blocks:
                    adam_update(
                        [_rows_of(p, rows)],
                        [_rows_of(grads[i], rows)],
                        [_rows_of(exp_avgs[i], rows)],
                        [_rows_of(exp_avg_sqs[i], rows)],
                        [_rows_of(max_exp_avg_sqs[i], rows)] if amsgrad else [],
                        # the update counts its step; each block counts from the same step, once for the state
                        [steps[i] if len(blocks) == 1 else steps[i].clone()],
                        foreach=False,
                        capturable=False,
                        differentiable=False,
                        fused=False,
                        grad_scale=None,
                        found_inf=None,
                        has_complex=has_complex,
                        amsgrad=amsgrad,
                        beta1=group["betas"][0],
                        beta2=group["betas"][1],
                        lr=group["lr"],
                        weight_decay=group["weight_decay"],
                        eps=group["eps"],
                        maximize=group["maximize"],
                        decoupled_weight_decay=group["decoupled_weight_decay"],
                    )
                if len(blocks) > 1:
                    steps[i] += 1
        return loss


def _single_tensor_update(group: dict) -> bool:
    """Whether torch's Adam runs its single-tensor update on this parameter group (what RowBlockedTorchAdam
    reproduces): not fused, capturable or differentiable, and foreach off or left to torch with CPU parameters."""
    if group.get("fused") or group.get("capturable") or group.get("differentiable"):
        return False
    if group.get("foreach") is None:
        return all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.device.type == "cpu" for p in group["params"])
    return not group["foreach"]


class RowChunkedAdam:
    """Mixin for a torchao `_AdamBase` optimizer: its step, with each large parameter updated in blocks of rows.

    The update is elementwise and the states are quantized in blocks of consecutive elements, so blocks of rows that
    start on a quantization block give bitwise the states of the whole-tensor update, and the same float32 weights
    before rounding. State dicts are torchao's.

    bf16 weights with `bf16_stochastic_round` take torchao's update in float32 (a float32 copy of the block: the
    float32 weights torchao computes before it rounds) and are then rounded by `stochastic_round_to_bf16`, whose
    random bits are a hash of the element's index and a seed drawn per block, in place of torchao's
    `torch.randint` per element, which its compiled CPU kernel draws one at a time. At the Qwen2.5-0.5B shapes
    (one thread, AVX-512 EPYC; benchmarks/optimizer_step.py) torchao's own step takes 6.33 s, 12.8 ns per
    parameter, and this one 1.97 s, 4.0 ns. On an accelerator torchao's fused step draws its bits in parallel and
    reads and writes each element once (the float32 copy would double that traffic), and a DTensor (FSDP2) has no
    plain rows to copy: both keep torchao's own rounding."""

    @torch.no_grad()
    def step(self, closure=None):
        from torchao.optim.adam import single_param_adam

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
        rounding = torch.compile(stochastic_round_to_bf16, fullgraph=True, dynamic=False)
        master = torch.empty(0)  # float32 scratch for the blocks of bf16 weights on the CPU, grown as needed
        with torch._dynamo.utils.disable_cache_limit():  # as torchao: a fixed set of shapes per model
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    raise RuntimeError(
                        "lr was changed to a non-Tensor object; torchao's optimizers need "
                        "optim.param_groups[i]['lr'].fill_(new_lr)."
                    )
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("Sparse gradient is not supported")
                    state = self.state[p]
                    if len(state) == 0:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    states = [state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq")]
                    round_bf16 = self.bf16_stochastic_round and p.dtype is torch.bfloat16
                    own_rounding = (
                        round_bf16 and p.device.type == "cpu" and type(p) in (torch.Tensor, torch.nn.Parameter)
                    )
                    for rows in _row_blocks(p, states):
                        weights = _rows_of(p.detach(), rows)
                        if own_rounding:
                            if master.numel() < weights.numel():
                                master = torch.empty(weights.numel())
                            target, weights = weights, master[: weights.numel()].view(weights.shape).copy_(weights)
                        update(
                            weights,
                            _rows_of(p.grad, rows),
                            state["step"],
                            *[_rows_of(x, rows) for x in states],
                            group["lr"],
                            group["betas"][0],
                            group["betas"][1],
                            group["weight_decay"],
                            group["eps"],
                            self.is_adamw,
                            round_bf16 and not own_rounding,
                        )
                        if own_rounding:
                            seed = torch.randint(1 << 31, (), dtype=torch.int64, device=p.device)
                            rounding(weights, target, seed)
        return loss


def stochastic_round_to_bf16(source: torch.Tensor, out: torch.Tensor, seed: torch.Tensor) -> None:
    """out (bfloat16) = source (float32, same shape, contiguous) rounded stochastically: away from zero with the
    probability of the 16 bits that bfloat16 drops, read as a fraction of 2^16, else towards zero; so the expected
    value is the float32 value (torchao's `_fp32_to_bf16_sr` rule). The 16 random bits of each element are the low
    bits of a 32-bit integer hash (two xor-shift-multiply rounds, each a bijection) of its flat index plus `seed`
    (a 0-d int64 tensor below 2^31): integer arithmetic that compiles to vector code. A new seed for each call."""
    index = torch.arange(source.numel(), dtype=torch.int64, device=source.device).view(source.shape)
    h = (index + seed) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    random_bits = ((h ^ (h >> 16)) & 0xFFFF).to(torch.int32)
    bits = source.view(torch.int32)
    towards_zero = bits & -0x10000  # the upper 16 bits: the float32 value truncated to bfloat16
    rounded = torch.where(random_bits < (bits & 0xFFFF), towards_zero + 0x10000, towards_zero)
    out.copy_(rounded.view(torch.float32))


def _row_blocks(p: torch.Tensor, states: list, limit: int | None = None) -> list[slice]:
    """Blocks of rows of p, each under `limit` elements (default CHUNK_ELEMENTS) and starting on a quantization
    block of every state; the whole tensor when it is small, not a plain tensor (DTensor), or has no rows that split
    so."""
    limit = CHUNK_ELEMENTS if limit is None else limit
    if p.dim() < 2 or type(p) not in (torch.Tensor, torch.nn.Parameter) or p.numel() <= limit:
        return [slice(None)]
    row = p[0].numel()
    block = max([getattr(x, "block_size", 1) for x in states if x is not None], default=1)
    step = block // math.gcd(row, block)  # rows per step so that each block of rows starts on a state block
    rows = (limit // row) // step * step
    if rows == 0 or rows >= p.shape[0]:
        return [slice(None)]
    return [slice(start, min(start + rows, p.shape[0])) for start in range(0, p.shape[0], rows)]


def _rows_of(state: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """Rows of a parameter, gradient or optimizer state that writes go through to (all of it for slice(None)): a
    plain tensor's view, or a torchao quantized state's
    own block-aligned slice rebuilt as a fresh wrapper in the state's appearance dtype (the slice itself is an
    autograd view with another dtype, which torch.compile cannot trace)."""
    if state is None or rows == slice(None):
        return state
    sliced = state[rows]
    if type(sliced) is torch.Tensor:
        return sliced
    names, context = sliced.__tensor_flatten__()  # torchao's states: the appearance dtype comes last
    return type(sliced).__tensor_unflatten__(
        {name: getattr(sliced, name) for name in names}, [*context[:-1], state.dtype], None, None
    )
