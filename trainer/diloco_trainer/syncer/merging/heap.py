"""Freed memory back to the system: the syncer's large buffers come and go with every merge
(pushes in flight, merged gradients, pull bodies, snapshots), and glibc keeps freed blocks below
its mmap threshold in its heaps, one per worker thread, where they fragment: RSS grew round
after round (15.1x P × 4 bytes after four rounds at 125M, 6.8x with the threshold fixed; issue
20). Fixing the threshold at 1 MiB maps every block above it on its own and unmaps it when freed
(setting it also stops glibc from raising it as it does by default).

Blocks below the threshold (an evaluation's activations, a merge's small temporaries) still go
to the heap of the thread that made them, where the free ones between live ones stay with the
process: `trim()` after an evaluation and a merge hands their pages back (glibc's malloc_trim,
which releases free pages inside the heaps too, not only at their tops). At gpt-125m they
were the 0.01-0.02x that put the syncer's peak over its bound (bench/log/2026-11-26.md,
"issue 20, fifth part: the heaps trimmed")."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("diloco.syncer")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has mallopt and malloc_trim), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc (musl has neither)
        return None
    return libc


def return_freed_memory() -> bool:
    """Set glibc's mmap threshold (once per process); False where there is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not ok:
        log.warning("could not set malloc's mmap threshold: freed memory may stay with the syncer")
    return ok


def trim() -> bool:
    """Give the heaps' free pages back to the system (glibc's malloc_trim(0): a walk of the
    heaps, milliseconds); True when any was given back, False too where there is no glibc."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


# madvise(2)'s MADV_PAGEOUT (Linux 5.4): reclaim these pages now; touched again, they come back.
_MADV_PAGEOUT = 21


def release_compiler_pages() -> int:
    """Ask the kernel to reclaim the pages of LLVM's library (llvmlite's, ~80-100 MB of its code
    and data read in at import and while compiling; the compiled loop lives elsewhere and runs
    without it): the syncer's RSS then carries ~50 MB for the compiler, not ~150 MB. Advisory and
    safe: a page that is needed again is read back in (file pages) or was never dropped (private
    pages without swap). Returns the mappings advised; 0 where there is no /proc or madvise."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for line in maps:
        parts = line.split()
        if len(parts) >= 6 and "llvmlite" in parts[5]:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            advised += madvise(lo, hi - lo, _MADV_PAGEOUT) == 0
    return advised
