"""The save and backward prologue shared by the chunked LM-head autograd Functions (`logprobs._ChunkedTokenLogprobs`,
`cpu_matmul.Float32Head`, `distillation._ChunkedGeneralizedJSD`): each takes (hidden, weight, bias, ...) as its first
three inputs and returns (a per-row value with a gradient, a per-row value without one: the entropy); its forward
saves what its backward recomputes the logits from, and its backward writes the gradients of those three inputs.
"""

from __future__ import annotations

import torch


def save_for_head_backward(ctx, tensors: tuple, no_grad_output: torch.Tensor, **values) -> None:
    """The end of a head Function's forward: the tensors its backward reads (`ctx.saved_tensors`, in this order),
    the plain values it needs (temperature, chunk size, dtypes: `ctx.<name>`), and the output without a gradient."""
    ctx.save_for_backward(*tensors)
    for name, value in values.items():
        setattr(ctx, name, value)
    ctx.mark_non_differentiable(no_grad_output)


def save_for_logprobs_backward(
    ctx, frozen_head: bool, hidden, weight, bias, targets, lse, expected_rows, entropies: torch.Tensor, **values
) -> None:
    """What a token log-prob head's backward needs (`Float32Head`, `logprobs._ChunkedTokenLogprobs`): with a frozen
    head (LoRA) the weight, targets and softmax @ weight per row; else hidden, weight, bias, targets and the
    log-sum-exp per row. `ctx.saved_tensors` then reads (hidden, weight, bias, targets, lse, expected_rows)."""
    tensors = (
        (None, weight, None, targets, None, expected_rows)
        if frozen_head
        else (hidden, weight, bias, targets, lse, None)
    )
    save_for_head_backward(ctx, tensors, entropies, frozen_head=frozen_head, hidden_dtype=hidden.dtype, **values)


def frozen_head_grad(grad_logprobs, weight, targets, expected_rows) -> torch.Tensor:
    """d (grad_logprobs · logprobs) / d hidden with a frozen head: g · (W[target] - softmax @ W), [M, H] in the
    dtype of expected_rows (grad_logprobs already divided by the temperature)."""
    return grad_logprobs[:, None] * (weight[targets].to(expected_rows.dtype) - expected_rows)


def head_grad_accumulators(ctx, hidden: torch.Tensor, weight: torch.Tensor, accumulate_dtype: torch.dtype):
    """The start of a head Function's backward: which of (hidden, weight, bias) need a gradient, and where their
    gradients go: hidden's in its dtype, filled chunk by chunk; the weight's and the bias's summed over the chunks
    in `accumulate_dtype` from zero (`head_input_grads` casts them back). Returns (needs, grad_hidden,
    grad_weight, grad_bias), a gradient None where it is not needed."""
    needs = tuple(ctx.needs_input_grad[:3])
    need_hidden, need_weight, need_bias = needs
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=accumulate_dtype, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=accumulate_dtype, device=weight.device) if need_bias else None
    return needs, grad_hidden, grad_weight, grad_bias


# Vocabulary rows per block of `add_weight_grad` (blocks of 2^22 elements: 8 MiB of a bf16 product, 16 MiB float32).
WEIGHT_GRAD_BLOCK_ELEMENTS = 2**22


def add_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden_chunk: torch.Tensor) -> None:
    """grad_weight [V, H] += grad_logits [c, V].T @ hidden_chunk [c, H], the matmul in grad_logits' dtype.

    A half-precision matmul's product is added into the float32 gradient one block of vocabulary rows at a time:
    the whole [V, H] product (half a float32 head) and the float32 copy of it that torch makes on the CPU to add it
    (another whole head) never exist, at the backward's memory peak (545 + 272 MiB for Qwen2.5-0.5B's head). Each
    block's product is the same rows of the whole product (a row of it is dot products over the chunk's rows alone),
    rounded to the matmul's dtype as the whole one is; the sum in float32 is the same."""
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden_chunk)
        return
    transposed, rows = grad_logits.t(), max(1, WEIGHT_GRAD_BLOCK_ELEMENTS // grad_weight.shape[1])
    for start in range(0, grad_weight.shape[0], rows):
        grad_weight[start : start + rows] += transposed[start : start + rows] @ hidden_chunk


def head_input_grads(
    grad_hidden, grad_weight, grad_bias, weight: torch.Tensor, bias: torch.Tensor | None, num_other_inputs: int
) -> tuple:
    """The end of a head Function's backward: the three gradients, the weight's and the bias's in their
    parameters' dtypes, and None for each of the Function's other inputs."""
    return (
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
        *(None,) * num_other_inputs,
    )
