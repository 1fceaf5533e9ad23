"""Freed tensor memory goes back to the operating system during CPU training (glibc's malloc).

glibc serves an allocation from the process's heap unless it is at least the "mmap threshold" (128 KiB at start),
and every time a block served by mmap is freed, it raises that threshold to the block's size (up to 32 MiB). After
a few steps of a training loop, which frees tensors of tens of MiB, nearly every tensor comes from the heap, and
memory freed in the middle of the heap is kept by the process. At the Qwen2.5-0.5B shape (bf16 weights, 8-bit
AdamW states) this made a second step's peak RSS 9.3 GB where the first step's was 7.1 GB, with the same live
tensors (`benchmarks/profile_step.py --memory`).

`keep_large_allocations_mapped` fixes the threshold (which also stops glibc from moving it): tensors of
MMAP_THRESHOLD bytes or more are mapped on allocation and unmapped when freed, so the resident size follows the
live tensors. The price is a page fault per 4 KiB page of each new large tensor, a small share of a step's
arithmetic at training sizes. Nothing changes in the numbers. It applies to the whole process, from the call on;
elsewhere than Linux with glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD = 1 << 20  # bytes: tensors from 1 MiB up are mapped and unmapped


def keep_large_allocations_mapped(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes; True when it was set (Linux with glibc), else False."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
