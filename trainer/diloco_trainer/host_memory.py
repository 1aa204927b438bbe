"""Freed host memory back to the system, for a learner: glibc's malloc_trim.

A learner's sync path frees fragment-sized buffers every round (a push's int8 values and body,
a pulled body and its decoded copy, the base a receipt replaces, the weights at the push).
glibc serves blocks below its mmap threshold from per-thread heaps, and raises that threshold
to the largest block freed (up to 32 MiB), so a model's tensors (a gpt-350m layer's 4-16 MB)
come to live in the heaps of the training thread and the link's threads, where freed ones stay
with the process between live ones: an emulated gpt-350m learner's RSS grew round after round
from 3.0 to 6.4 copies of the model while it held 3.5 at most (bench/log/2026-11-29.md, "a
learner's copies of the model"). `trim()` after each sync hands those pages back. The syncer
fixes the mmap threshold instead (syncer/merging/heap.py); a learner does not, since a CPU
learner's training steps would then map and unmap every activation above it, each a fresh page
fault.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, other systems)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    trim_fn: Callable[[int], int] = fn
    return trim_fn


def trim() -> bool:
    """Give the heaps' free pages back to the system (malloc_trim(0): it walks every heap, and
    releases free pages inside them too, not only at their tops; milliseconds); True when any
    was given back, False too where there is no glibc."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
