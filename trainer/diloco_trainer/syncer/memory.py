"""Freed memory back to the system: the syncer's large buffers come and go with every merge
(pushes in flight, merged gradients, pull bodies, snapshots), and glibc keeps freed blocks below
its mmap threshold in its heaps, one per worker thread, where they fragment: RSS grew round
after round (15.1x P × 4 bytes after four rounds at 125M, 6.8x with the threshold fixed; issue
20). Fixing the threshold at 1 MiB maps every block above it on its own and unmaps it when freed
(setting it also stops glibc from raising it as it does by default)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("diloco.syncer")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_memory() -> bool:
    """Set glibc's mmap threshold (once per process); False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not ok:
        log.warning("could not set malloc's mmap threshold: freed memory may stay with the syncer")
    return ok
