"""check/memory_estimate.py's estimates against the peak memory of a real step and a real
evaluation of the built-in GPT (a child process each, so the peak is its own)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.check.memory_estimate import PROCESS_BYTES, estimate

PEAK = r"""
import json, sys
import torch
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.models.data import Batch
from diloco_trainer.models.model import build_model
from diloco_trainer.models.parts import lm_loss, make_inner_optimizer
spec = parse_spec(json.loads(sys.argv[1]))
torch.manual_seed(0)
model = build_model(spec.model.preset, spec.inner.seq_len, 256)
rows = int(sys.argv[2])
x = torch.randint(0, 256, (rows, spec.inner.seq_len))
opt = make_inner_optimizer(spec, model)
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
# The peak of this block alone: RSS now, then the high-water mark reset (ru_maxrss would keep an
# earlier peak of the imports and the build, and under-count the block).
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
if sys.argv[3] == "step":
    lm_loss(model, Batch(x, x, x.numel())).backward()
    opt.step()
else:
    with torch.no_grad():
        lm_loss(model, Batch(x, x, x.numel()))
print(status("VmHWM") - base)
"""

SPEC = {
    "model": {"preset": "gpt-tiny"},
    "inner": {"seqLen": 2048, "batchSize": 8},
    "data": {"evalTokens": 16384},
}


def _peak(kind: str, rows: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PEAK, json.dumps(SPEC), str(rows), kind],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return int(out.stdout.strip())


@pytest.mark.parametrize("kind", ["step", "eval"])
def test_check_memory_estimate_within_twice_the_measured_peak(kind: str) -> None:
    spec = parse_spec(SPEC)
    need = estimate(spec, 256)
    # What the estimate adds to a process that holds the model (its weights are in `base`).
    if kind == "step":
        estimated = need.learner - PROCESS_BYTES - 4 * need.parameters
    else:
        estimated = need.syncer - PROCESS_BYTES - 5 * 4 * need.parameters
    measured = _peak(kind, spec.inner.batch_size)
    assert measured / 2 <= estimated <= measured * 2, (kind, estimated, measured)
