"""Rank 0's bookkeeping for each fragment: its Δ base and version, the work counted since it
was last received, and the push whose merged result is not applied yet."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from torch import Tensor

from diloco_trainer.learner.syncer_link import SyncResult


@dataclass
class FragmentCounters:
    """An island's work on one fragment since it last received that fragment."""

    tokens: int = 0
    steps: int = 0
    loss_sum: float = 0.0
    time_sum: float = 0.0

    def add(self, tokens: int, loss: float, step_time: float) -> None:
        self.tokens += tokens
        self.steps += 1
        self.loss_sum += loss
        self.time_sum += step_time

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else 0.0

    @property
    def mean_step_time(self) -> float:
        return self.time_sum / self.steps if self.steps else 0.0


@dataclass
class InFlight:
    """A pushed fragment whose merged result is not applied yet."""

    step: int  # inner step it was pushed at
    started: float  # time.monotonic() of the push
    future: concurrent.futures.Future[SyncResult]


@dataclass
class FragmentState:
    """Rank 0's view of one fragment."""

    names: list[str]
    version: int = -1
    base: dict[str, Tensor] = field(default_factory=dict)  # fp32 CPU θ_global at `version`
    counters: FragmentCounters = field(default_factory=FragmentCounters)
    last_sync_seconds: float = 0.0
