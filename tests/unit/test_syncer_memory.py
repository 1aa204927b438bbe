"""syncer/merging/heap.py: glibc's mmap threshold fixed, so a freed large buffer leaves the
process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from diloco_trainer.syncer.merging import heap


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_freed_buffers_leave_the_process() -> None:
    """64 buffers of 2 MiB (above the 1 MiB threshold, below glibc's default 32 MiB ceiling).
    Without the fixed threshold, a 4 MiB buffer freed first raises glibc's threshold to 4 MiB,
    the buffers then come from the heap, and a small block after them pins it: all 128 MiB stay
    with the process after the free (measured: 128 MiB kept, 0 with the threshold). In a fresh
    interpreter (_FREE_SCENARIO): the process's resident size is every thread's, and threads
    earlier tests left in the test process (a server's, a pool's) grew it by 18 MiB between the
    two readings on a loaded host."""
    got = _run_scenario(_FREE_SCENARIO)
    assert got["fixed"]  # this test runs on glibc Linux
    assert got["total"] == 16.0
    assert got["grown"] >= 100 * 2**20
    assert got["after"] < 16 * 2**20


def _run_scenario(scenario: str) -> dict[str, float]:
    """Run a scenario of this file in a fresh interpreter, heap.py loaded from its file; its last
    line of output, a JSON object."""
    out = subprocess.run(
        [sys.executable, "-c", scenario.replace("HEAP_FILE", repr(heap.__file__))],
        check=True,
        capture_output=True,
        text=True,
    )
    got: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


# Run in a fresh interpreter: in the test process, earlier tests leave free holes in the heap
# that the small live blocks would fill, the buffers would end up contiguous at the heap's top,
# and free() alone would trim them, leaving trim() nothing to show. For the same reason the
# module is loaded from its file, not through its package's face, whose imports (the global
# model, numba, safetensors) leave such holes too.
_PRELUDE = """
import importlib.util
import json
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("heap", HEAP_FILE)
heap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heap)
return_freed_memory, trim = heap.return_freed_memory, heap.trim


def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


"""

_FREE_SCENARIO = (
    _PRELUDE
    + """
fixed = return_freed_memory()
# 4 MiB freed: without the fixed threshold glibc raises it to 4 MiB, so 2 MiB buffers come
# from the heap (in the test process earlier tests' frees had raised it already).
warm = torch.ones(1024 * 1024)
del warm
before = rss()
held = [torch.ones(512 * 1024) for _ in range(64)]
pin = torch.ones(16)
grown = rss()
del held
after = rss()
print(json.dumps(dict(fixed=fixed, total=float(pin.sum()), grown=grown - before,
                      after=after - before)))
"""
)

_TRIM_SCENARIO = (
    _PRELUDE
    + """
fixed = return_freed_memory()
before = rss()
# 256 buffers of 256 KiB (below the 1 MiB threshold), each followed by a small live block
# that keeps the heap from shrinking at its top when the buffers are freed.
held, pins = [], []
for _ in range(256):
    held.append(torch.ones(64 * 1024))
    pins.append(torch.ones(16))
grown = rss()
del held
kept = rss()
trimmed = trim()
after = rss()
total = sum(float(p.sum()) for p in pins)
print(json.dumps(dict(fixed=fixed, trimmed=trimmed, total=total, grown=grown - before,
                      kept=kept - before, after=after - before)))
"""
)


def test_trim_hands_back_free_pages_between_live_blocks() -> None:
    """Blocks below the threshold come from the heap; freed between live ones, their pages stay
    with the process until trim() gives them back."""
    got = _run_scenario(_TRIM_SCENARIO)
    assert got["fixed"] and got["trimmed"]
    assert got["total"] == 256 * 16.0
    assert got["grown"] >= 48 * 2**20
    assert got["kept"] >= 48 * 2**20  # free() alone gave the pages back: nothing to show
    assert got["after"] < 16 * 2**20
