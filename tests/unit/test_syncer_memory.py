"""syncer/merging/heap.py: glibc's mmap threshold fixed, so a freed large buffer leaves the
process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from diloco_trainer.syncer.merging import heap
from diloco_trainer.syncer.merging.heap import return_freed_memory


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_freed_buffers_leave_the_process() -> None:
    assert return_freed_memory()  # this test runs on glibc Linux
    # 64 buffers of 2 MiB (above the 1 MiB threshold, below glibc's default 32 MiB ceiling).
    # Without the fixed threshold, the first 2 MiB freed raises glibc's threshold above 2 MiB,
    # the buffers then come from the heap, and a small block after them pins it: all 128 MiB
    # stay with the process after the free (measured: 128 MiB kept, 0 with the threshold).
    warm = torch.ones(512 * 1024)
    del warm
    before = rss()
    held = [torch.ones(512 * 1024) for _ in range(64)]
    pin = torch.ones(16)
    grown = rss()
    del held
    after = rss()
    assert float(pin.sum()) == 16.0
    assert grown - before >= 100 * 2**20
    assert after - before < 16 * 2**20


# Run in a fresh interpreter: in the test process, earlier tests leave free holes in the heap
# that the small live blocks would fill, the buffers would end up contiguous at the heap's top,
# and free() alone would trim them, leaving trim() nothing to show. For the same reason the
# module is loaded from its file, not through its package's face, whose imports (the global
# model, numba, safetensors) leave such holes too.
_TRIM_SCENARIO = """
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


def test_trim_hands_back_free_pages_between_live_blocks() -> None:
    """Blocks below the threshold come from the heap; freed between live ones, their pages stay
    with the process until trim() gives them back."""
    out = subprocess.run(
        [sys.executable, "-c", _TRIM_SCENARIO.replace("HEAP_FILE", repr(heap.__file__))],
        check=True,
        capture_output=True,
        text=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["fixed"] and got["trimmed"]
    assert got["total"] == 256 * 16.0
    assert got["grown"] >= 48 * 2**20
    assert got["kept"] >= 48 * 2**20  # free() alone gave the pages back: nothing to show
    assert got["after"] < 16 * 2**20
