"""How much memory a job's processes need, estimated before any starts (built-in GPT only).

The estimates are deliberately simple, per token of a batch and per parameter, and measured
against the real model (tests/unit/test_check_memory.py: within a factor of two of the peak RSS
of a step and of an evaluation):
- a learner's inner step keeps, per token, about 17 floats of width C per block for the
  backward pass (LayerNorms, qkv, attention output, MLP in and out, residuals) and the logits
  three times (logits, log-softmax, their gradient); attention itself is the fused kernel whose
  memory grows with T, not T²; the weights, gradients and AdamW's two moments are 16 bytes a
  parameter;
- the syncer's evaluation runs without gradients: per token the logits four times and a few
  widths C; the syncer holds about five fp32 copies of the weights (ARCHITECTURE.md, "The
  syncer's memory");
- every process pays PROCESS_BYTES for the interpreter and torch.
bf16/fp16 halve the activations; activation checkpointing keeps one block's instead of all.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from diloco_trainer.api.spec import JobSpec

if TYPE_CHECKING:  # the model's module imports torch: a refused file should not wait for it
    from diloco_trainer.models.model import GPTConfig

FLOAT = 4
PROCESS_BYTES = 400 * 2**20  # python, torch and the corpus of one process
ACTIVATION_WIDTHS = 17  # floats of width C kept per token and block for the backward pass
SYNCER_COPIES = 5  # θ exact, momentum, pull bodies, the eval copy, θ published
_QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?)?$")
_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


@dataclass(frozen=True)
class MemoryNeed:
    """Estimated peak bytes of one learner rank (a step) and of the syncer (an evaluation)."""

    learner: int
    syncer: int
    parameters: int


def gpt_config(spec: JobSpec, vocab_size: int) -> GPTConfig:
    """The built-in GPT's shape for this job (as models/model.build_model makes it)."""
    from diloco_trainer.models.model import PRESETS

    return replace(PRESETS[spec.model.preset], block_size=spec.inner.seq_len, vocab_size=vocab_size)


def eval_rows(spec: JobSpec) -> int:
    """Sequences in the syncer's largest eval batch (models/data.eval_batches)."""
    windows = max(1, -(-spec.data.eval_tokens // spec.inner.seq_len))
    return min(windows, spec.inner.batch_size)


def estimate(spec: JobSpec, vocab_size: int) -> MemoryNeed:
    """The estimates of the module docstring for the built-in GPT of `spec`."""
    from diloco_trainer.models.model import gpt_parameters

    cfg = gpt_config(spec, vocab_size)
    params = gpt_parameters(cfg)
    c, v = cfg.n_embd, cfg.vocab_size
    half = spec.inner.precision in ("bf16", "fp16")
    kept_blocks = 1 if spec.model.activation_checkpointing else cfg.n_layer
    per_token = (ACTIVATION_WIDTHS * c * kept_blocks + cfg.n_layer * c + 3 * v) * FLOAT
    if half:
        per_token //= 2
    step_tokens = spec.inner.batch_size * spec.inner.seq_len
    learner = PROCESS_BYTES + 16 * params + per_token * step_tokens
    eval_tokens = eval_rows(spec) * spec.inner.seq_len
    syncer = PROCESS_BYTES + SYNCER_COPIES * FLOAT * params + (4 * v + 8 * c) * FLOAT * eval_tokens
    return MemoryNeed(learner=learner, syncer=syncer, parameters=params)


def parse_quantity(value: object) -> int | None:
    """A Kubernetes memory quantity ('2Gi', '512M', 1e9) in bytes; None when unreadable."""
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if match is None:
        return None
    number, unit = float(match.group(1)), match.group(2) or ""
    binary = unit.endswith("i")  # Ki, Mi, Gi: powers of 1024; K, M, G: of 1000
    scale = 1024 ** (list(_UNITS).index(unit[0]) + 1) if binary else _UNITS.get(unit, 1)
    return int(number * scale)


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


def gib(n: float) -> str:
    """Bytes as GiB with two significant decimals for people."""
    return f"{n / 2**30:.2f} GiB"
