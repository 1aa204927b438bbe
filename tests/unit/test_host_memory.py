"""host_memory.trim: a learner's freed model-sized buffers leave the process. glibc raises its
mmap threshold to the largest block freed, so after the first few-MB tensor is freed the next
ones come from the heap; freed between live blocks, they stay with the process until trim()."""

from __future__ import annotations

import json
import subprocess
import sys

from diloco_trainer import host_memory

# A fresh interpreter (earlier tests leave holes in the heap that would take the blocks), and
# the module loaded from its file alone, as test_syncer_memory.py does for the syncer's heap.
_SCENARIO = """
import importlib.util
import json
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("host_memory", HOST_MEMORY_FILE)
host_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_memory)


def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# A 4 MiB tensor freed: glibc's threshold rises above the 2 MiB buffers below (its default).
first = torch.ones(1024 * 1024)
del first
before = rss()
held, pins = [], []
for _ in range(64):
    held.append(torch.ones(512 * 1024))  # 2 MiB, a model's tensor
    pins.append(torch.ones(16))  # a small live block after each
grown = rss()
del held
kept = rss()
trimmed = host_memory.trim()
after = rss()
total = sum(float(p.sum()) for p in pins)
print(json.dumps(dict(trimmed=trimmed, total=total, grown=grown - before,
                      kept=kept - before, after=after - before)))
"""


def test_trim_hands_back_freed_tensors_that_glibc_kept() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCENARIO.replace("HOST_MEMORY_FILE", repr(host_memory.__file__))],
        check=True,
        capture_output=True,
        text=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["total"] == 64 * 16.0
    assert got["grown"] >= 100 * 2**20
    assert got["kept"] >= 100 * 2**20  # free() alone gave them back: nothing to show
    assert got["trimmed"]
    assert got["after"] < 16 * 2**20
