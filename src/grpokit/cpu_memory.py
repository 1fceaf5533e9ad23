"""Freed tensor memory goes back to the operating system during CPU training (glibc's malloc).

glibc serves an allocation from the process's heap unless it is at least the "mmap threshold" (128 KiB at start),
and every time a block served by mmap is freed, it raises that threshold to the block's size (up to 32 MiB). After
a few steps of a training loop, which frees tensors of tens of MiB, nearly every tensor comes from the heap, and
memory freed in the middle of the heap is kept by the process. At the Qwen2.5-0.5B shape (bf16 weights, 8-bit
AdamW states) this made a second step's peak RSS 9.3 GB where the first step's was 7.1 GB, with the same live
tensors (`benchmarks/profile_step.py --memory`).

`keep_large_allocations_mapped` fixes the threshold (which also stops glibc from moving it): tensors of
MMAP_THRESHOLD bytes or more are mapped on allocation and unmapped when freed, so the resident size follows the
live tensors. The price is a page fault per 4 KiB page of each new large tensor. The trainer sets it before it
loads anything: loading and quantizing weights frees tensors of every size between live ones.

In the training loop that price is not small: every layer's activations (a few MiB each) are allocated afresh in
every forward and backward. `reuse_activation_memory`, called when training starts, returns what the set-up freed
to the OS (malloc_trim) and then fixes the threshold at TRAINING_MMAP_THRESHOLD: tensors below it (activations,
a layer's weight gradients) reuse heap memory, larger ones (embeddings and their gradients, optimizer transients)
stay mapped. The price is back, smaller: what the loop frees between live tensors below the threshold stays in the
process. At the Qwen2.5-0.5B shape on a 2-core AMD EPYC (bf16 weights, bf16 AdamW, int8 reference, checkpointing,
1 warm-up + 4 steps) the step went from 54.6 to 43.0 s and the peak RSS from 5,723 to 6,357 MiB in one run (with
both versions at once on the two cores: 52.9 to 47.0 s, 5,729 to 6,376 MiB); `benchmarks/README.md`. Fixed, the
threshold does not climb to 32 MiB as glibc's own does. Nothing changes in the numbers. It applies to the whole
process, from the call on; elsewhere than Linux with glibc it does nothing.

What the heap keeps adds up across the phases of a step: the rollout's KV cache grows by a position per decode
step, so each of its freed tensors leaves a hole that no later tensor fits, and the no-grad forwards (π_old, the
reference) leave theirs. `return_free_memory` (malloc_trim) hands those pages back; the trainer calls it after the
rollout and after the no-grad forwards, so that the training forward and backward start from the live tensors.
On a 4-layer proxy of the Qwen2.5-0.5B shape with QLoRA this took the step's peak RSS from 2,012 to 1,513 MiB.
Most of what they hand back is the previous backward's activations, which the next training forward faults in
again: on a small model that is the whole price and no saving (`trims_between_phases`).
The decoder's own forward leaves ~250 MiB of freed activations at that shape, so the chunked LM head
(`logprobs.chunked_token_logprobs`) calls it too before it starts: the full model's peak 1,825 -> 1,545 MiB.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 1 << 20  # bytes: tensors from 1 MiB up are mapped and unmapped (set-up)
TRAINING_MMAP_THRESHOLD = 16 << 20  # bytes: the same in the training loop (activations below it reuse the heap)
# The backward's trims per layer only where the trainable parameters' gradients take at least this many bytes
# (`trim_heap_in_backward`, read at its call).
BACKWARD_TRIM_MIN_GRADIENT_BYTES = 256 << 20
# The trims between a step's phases (after the rollout and after the no-grad forwards) only for a model whose
# parameters take at least this many bytes (`trims_between_phases`, read at its call).
PHASE_TRIM_MIN_MODEL_BYTES = 256 << 20


@functools.cache
def _glibc():
    """glibc, or None (not Linux; musl has no mallopt). Loaded once: `return_free_memory` runs in every step."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def keep_large_allocations_mapped(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes; True when it was set (Linux with glibc), else False."""
    libc = _glibc()
    return libc is not None and libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1


def return_free_memory() -> bool:
    """Give the heap's free pages back to the OS now (`malloc_trim(0)`: the free chunks inside the heap too, not
    only its top). Their next use faults them in again, once. True when done (Linux with glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def trims_between_phases(model: torch.nn.Module) -> bool:
    """Whether a step gives the heap's free pages back to the OS after its rollout and after its no-grad forwards
    (`experience.ExperienceMaker`): where the model's parameters take PHASE_TRIM_MIN_MODEL_BYTES or more.

    What those trims return is mostly the previous step's backward (its activations, freed to the heap) and the
    no-grad forwards' activations; the training forward then reuses the same sizes, and faults every page of them
    in again. Where the model is large they keep the rollout's and the reference's holes from stacking on the
    training peak (the QLoRA proxy above: 2,012 -> 1,513 MiB). On the 4M-parameter `small` benchmark (16 MiB of
    weights) they returned ~600 MiB a step that the next forward faulted in again: 207k minor page faults a step
    against 17k without them (`benchmarks/profile_step.py --config small`), a step of 2.09-2.13 s against
    1.66-1.91 s, for the same peak RSS (1,260 against 1,242 MiB; `benchmarks/bench_vs_trl.py --config small
    --baseline`, `results/small_fp32_2threads_notrim.json`)."""
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return parameter_bytes >= PHASE_TRIM_MIN_MODEL_BYTES


def _trim_on_gradient(_grad):
    """A tensor hook: the heap's free pages go back to the OS when this gradient is computed."""
    return_free_memory()


def _trim_in_backward(module, args, output):
    """A decoder layer's forward hook: in a forward that records a graph, the backward will trim the heap when it
    reaches this layer's output (after the layers above gave their saved activations back)."""
    hidden = output[0] if isinstance(output, (tuple, list)) else output
    if torch.is_grad_enabled() and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
        hidden.register_hook(_trim_on_gradient)


def trim_heap_in_backward(model: torch.nn.Module) -> int:
    """Give the heap's free pages back to the OS at every decoder layer of `model`'s backward (CPU training).

    The backward frees each layer's saved activations as it passes it and allocates the weights' gradients; the
    activations (below TRAINING_MMAP_THRESHOLD each) go back to the heap, whose pages the process keeps, so at the
    end of the backward it would hold every gradient and the whole forward's activations at once: ~1.4 GB more than
    the live tensors at the Qwen2.5-0.5B shape (16 rows of 72 tokens, no checkpointing; `benchmarks/profile_step.py
    --exact-memory`), at the step's peak. A trim per layer costs a page fault per 4 KiB that the backward then
    reuses. The layers are the blocks of each ModuleList of same-class blocks (a model's decoder layers; not searched
    inside). Returns how many hooks were added (once per layer).

    Without the trims the backward's heap holds at most the forward's activations (resident at the forward's end
    anyway) plus what the backward allocates besides them, the gradients first: so the trims lower the peak by about
    the gradients' size at most, and are added only where those take BACKWARD_TRIM_MIN_GRADIENT_BYTES or more. Below
    that they cost more than they save: the 4M-parameter `small` benchmark (16 MiB of gradients, ~100 MiB of
    activations per layer) took 0.68-0.73 s per backward with its eight trims (and the page faults after them),
    0.53-0.56 s without (`benchmarks/profile_step.py --config small`); without them and the chunked head's
    (`logprobs.HEAD_TRIM_MIN_BYTES`) its step is ~10 % faster and its peak RSS ~8 % higher
    (`benchmarks/bench_vs_trl.py --config small --baseline`: 1,253 against 1,152 MiB)."""
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if gradient_bytes < BACKWARD_TRIM_MIN_GRADIENT_BYTES:
        return 0
    blocks = list(model.children())
    added = 0
    while blocks:
        module = blocks.pop()
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            for layer in module:  # not searched inside: a layer's experts are not layers
                if not getattr(layer, "_grpokit_trim_in_backward", False):
                    layer.register_forward_hook(_trim_in_backward)
                    layer._grpokit_trim_in_backward = True
                    added += 1
        else:
            blocks += list(module.children())
    return added


def reuse_activation_memory(threshold: int | None = None) -> bool:
    """When training starts: give the heap's free pages back to the OS (`malloc_trim`: what the set-up freed), then
    fix the mmap threshold at `threshold`, so that the loop's activation-sized tensors reuse heap memory instead of
    a fresh mapping each, and the trim threshold at twice that (glibc's own rule when it moves the mmap threshold;
    at its default 128 KiB a tensor freed at the top of the heap is returned at once, and the next one faults its
    pages in again). `threshold` defaults to TRAINING_MMAP_THRESHOLD, read at the call: set it to MMAP_THRESHOLD
    before `train()` for the lower peak and the slower step. True when all was done (Linux with glibc)."""
    threshold = TRAINING_MMAP_THRESHOLD if threshold is None else threshold
    if not return_free_memory():
        return False
    libc = _glibc()
    return libc.mallopt(M_TRIM_THRESHOLD, 2 * threshold) == 1 and keep_large_allocations_mapped(threshold)
