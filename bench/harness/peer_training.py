"""The inner training step the peer baselines (torch DDP, torchft DiLoCo) share with our learner.

The peers must train exactly what ours trains: the same parts (`build_parts`: model, shard, loss),
the same inner AdamW with the same schedule (`inner_lr`) and gradient clipping. Only the way the
replicas talk differs. Worker processes also record their progress as JSON lines, so a benchmark
can read throughput and useful tokens from outside, even from a worker it killed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.models.parts import TrainingParts, inner_lr, set_lr
from torch import nn


def build_outer_optimizer(spec: JobSpec, model: nn.Module) -> torch.optim.SGD:
    """The outer Nesterov SGD our syncer applies, as a torch optimizer (for torchft)."""
    return torch.optim.SGD(
        model.parameters(),
        lr=spec.outer.lr,
        momentum=spec.outer.momentum,
        nesterov=spec.outer.nesterov,
    )


def forward_backward(
    spec: JobSpec,
    parts: TrainingParts,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
) -> tuple[float, int]:
    """Zero the grads, set the step's learning rate, run one batch forward and backward, clip.

    Returns (loss, tokens). The caller calls `optimizer.step()` (peers hook their syncs into it).
    `step` counts from 0, like the schedule.
    """
    assert parts.train is not None, "worker parts were built without a train stream"
    set_lr(optimizer, inner_lr(spec, step))
    batch = parts.train.next_batch()
    optimizer.zero_grad(set_to_none=True)
    loss = parts.loss_fn(model, batch)
    loss.backward()
    if spec.inner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.inner.grad_clip)
    return float(loss.detach()), batch.tokens


class Throttle:
    """Makes a worker `factor` times slower than it is by sleeping after each step's compute.

    The same rule as our learner's DILOCO_SLOWDOWN: a straggler on purpose.
    """

    def __init__(self, factor: float) -> None:
        if factor < 1:
            raise ValueError(f"slowdown must be >= 1, got {factor}")
        self.factor = factor

    def after(self, compute_seconds: float) -> float:
        """Sleep (factor-1) x compute_seconds; returns the time slept."""
        extra = (self.factor - 1.0) * compute_seconds
        if extra > 0:
            time.sleep(extra)
        return extra


@dataclass
class Progress:
    """A worker's running totals, appended to its progress file as one JSON line per record."""

    worker: str
    started: float
    time: float = 0.0
    steps: int = 0
    tokens: int = 0
    useful_tokens: int = 0
    compute_seconds: float = 0.0
    sync_seconds: float = 0.0
    commits: int = 0
    loss: float = float("nan")


class ProgressLog:
    """Appends Progress records (JSON lines) to a file, at most every `interval` seconds."""

    def __init__(self, path: Path | None, interval: float = 0.5) -> None:
        self.path = path
        self.interval = interval
        self._last = 0.0

    def write(self, progress: Progress, *, force: bool = False) -> None:
        if self.path is None:
            return
        now = time.time()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        progress.time = now
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(progress)) + "\n")


def read_progress(path: Path) -> list[dict[str, float]]:
    """Every record in a progress file (a torn last line, from a killed worker, is skipped)."""
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
