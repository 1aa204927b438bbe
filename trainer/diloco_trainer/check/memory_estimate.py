"""How much memory a job's processes need, estimated before any starts (built-in GPT only).

The estimates themselves are api/preflight.py's (torch-free: the operator makes them too,
before it creates pods); this module adds what only a local run asks: how much memory this
machine can still give.
"""

from __future__ import annotations

import os
from pathlib import Path

from diloco_trainer.api.preflight import (
    PROCESS_BYTES,
    MemoryNeed,
    estimate,
    gib,
    parse_quantity,
)

__all__ = ["PROCESS_BYTES", "MemoryNeed", "available_bytes", "estimate", "gib", "parse_quantity"]


def _cgroup_limit() -> int | None:
    """This process's cgroup v2 memory limit less its usage, when one is set."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def available_bytes() -> int | None:
    """Memory this machine can still give (MemAvailable, or the cgroup's room if smaller)."""
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        found = None
    room = _cgroup_limit()
    if room is not None and (found is None or room < found):
        found = room
    if found is None and hasattr(os, "sysconf"):
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return found
