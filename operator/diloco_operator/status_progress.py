"""A job's training progress and per-island view from the syncer's status (pure).

The syncer is the source of the progress figures. While it is away (restarting, unreachable)
the last figures stored in the job's status are carried over, so `kubectl get` keeps showing
the step the job had reached instead of blanks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import StopAfterSpec

from diloco_operator.api import IslandEntry
from diloco_operator.health import ACTIVE
from diloco_operator.observation import Observation
from diloco_operator.times import time_field

UNKNOWN_STATE = "unknown"  # an island the syncer does not know, or in a newer syncer's state


@dataclass(frozen=True)
class Progress:
    """The progress figures of the job's status."""

    outer_step: int | None
    tokens: int | None
    loss: float | None
    eval_loss: float | None
    last_sync_time: str | None


def carried_progress(syncer: SyncerStatus | None, previous: Mapping[str, Any] | None) -> Progress:
    """Figures from the syncer's status, or the stored ones (the job's status, named as there)
    while the syncer is not reached."""
    if syncer is not None:
        return Progress(
            outer_step=int_or_none(syncer.outer_step),
            tokens=int_or_none(syncer.tokens),
            loss=float_or_none(syncer.loss),
            eval_loss=float_or_none(syncer.eval_loss),
            last_sync_time=time_field(syncer.last_merge_time),
        )
    previous = previous or {}
    return Progress(
        outer_step=int_or_none(previous.get("outerStep")),
        tokens=int_or_none(previous.get("tokens")),
        loss=float_or_none(previous.get("loss")),
        eval_loss=float_or_none(previous.get("evalLoss")),
        last_sync_time=previous.get("lastSyncTime"),
    )


@dataclass(frozen=True)
class Completion:
    """`kubectl get dj`'s Progress and ETA columns."""

    progress: str | None  # '35%' of the nearer stopAfter limit
    eta: str | None  # '4m10s' at the pace since the syncer's first evaluation


def job_completion(
    stop_after: StopAfterSpec, syncer: SyncerStatus | None, previous: Mapping[str, Any] | None
) -> Completion:
    """How far the job is towards spec.stopAfter (the nearer of outerSteps and tokens) and the
    time left at the pace so far, from the syncer's figures: its outer step and tokens, and the
    clock of its first evaluation (taken when it started, before any merge) against the clock
    of the document. While the syncer is away the stored progress is kept and the ETA left out
    (no pace to tell it by); a job without stopAfter has neither."""
    if syncer is None:
        stored = (previous or {}).get("progress")
        return Completion(progress=stored if isinstance(stored, str) else None, eta=None)
    fractions = []
    if stop_after.outer_steps:
        fractions.append(syncer.outer_step / stop_after.outer_steps)
    if stop_after.tokens:
        fractions.append(syncer.tokens / stop_after.tokens)
    if not fractions:
        return Completion(progress=None, eta=None)
    done = min(1.0, max(0.0, max(fractions)))
    return Completion(progress=f"{int(done * 100)}%", eta=_eta(done, syncer))


def _eta(done: float, syncer: SyncerStatus) -> str | None:
    if done >= 1.0 or syncer.finished:
        return "0s"
    times = [p.time for p in syncer.eval_history if p.time is not None]
    if done <= 0 or not times or not syncer.time:
        return None
    elapsed = syncer.time - min(times)
    if elapsed <= 0:
        return None
    return duration(elapsed * (1 - done) / done)


def duration(seconds: float) -> str:
    """93 -> '1m33s', 7300 -> '2h01m', 200000 -> '2d07h' (kubectl's compact style)."""
    total = max(0, round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def island_statuses(obs: Observation, running: bool) -> list[IslandEntry]:
    """One entry per desired island: its pods (from health) and its state at the syncer."""
    out = []
    for name, island in obs.islands.items():
        info = obs.syncer.island(name) if obs.syncer is not None else None
        state = (info.known_state if info is not None else None) or UNKNOWN_STATE
        out.append(
            IslandEntry(
                name=name,
                ready_pods=island.ready_pods,
                desired_pods=island.desired_pods if running else 0,
                healthy=island.healthy,
                in_quorum=state == ACTIVE,
                state=state,
                last_push=time_field(info.last_push) if info is not None else None,
                restarts=island.restarts,
                waiting_for_quota=island.waiting_for_quota,
                holding=info is not None and info.holding,
                drained=info is not None and info.drained,
                step_time=float_or_none(info.step_time) if info is not None else None,
                waiting=share_or_none(info.waiting) if info is not None else None,
                inner_steps=info.inner_steps if info is not None else None,
            )
        )
    return out


def rounds_summary(islands: list[IslandEntry]) -> str | None:
    """Each island's round and step time as one string for kubectl's wide output: 'H_i@t' per
    island ('30@0.05s 10@0.15s'), '-' for a figure not reported; None with no island."""
    if not islands:
        return None
    parts = []
    for entry in islands:
        steps = "-" if entry.inner_steps is None else str(entry.inner_steps)
        time = "-" if entry.step_time is None else f"{entry.step_time:.3g}s"
        parts.append(f"{steps}@{time}")
    return " ".join(parts)


def waiting_summary(islands: list[IslandEntry]) -> str | None:
    """Each island's waiting share as one string for kubectl's wide output: a whole percent per
    island ('62% 4%'), '-' for a share not reported; None with no island."""
    if not islands:
        return None
    return " ".join("-" if e.waiting is None else f"{e.waiting:.0%}" for e in islands)


def share_or_none(value: Any) -> float | None:
    """A share in [0, 1] (float_or_none, clamped: the CRD bounds it), None when not one."""
    number = float_or_none(value)
    return None if number is None else min(1.0, max(0.0, number))


# Kubernetes stores integers as int64: a larger one would make the API server refuse the patch.
INT64_MAX = 2**63 - 1


def int_or_none(value: Any) -> int | None:
    """A non-negative int that fits int64, None when absent, not a number or out of range."""
    try:
        number = None if value is None else max(0, int(value))
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number is None or number <= INT64_MAX else None


def float_or_none(value: Any) -> float | None:
    """A finite float, None when absent, not a number, NaN or infinite."""
    try:
        number = None if value is None else float(value)
    except (TypeError, ValueError):
        return None
    if number is None or number != number or number in (float("inf"), float("-inf")):
        return None  # JSON has no NaN: the API server would refuse the patch
    return number
