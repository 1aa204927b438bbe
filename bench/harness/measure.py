"""Reading progress over a time window: ours from the syncer's status, torchft from progress files.

Every figure is a difference between two instants of one run (t1, t2) divided by t2 - t1, so
start-up and warm-up never count. Times are wall-clock (time.time()) on this machine for both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.common import poll_until
from bench.harness.ours_harness import OursRun
from bench.harness.peer_training import read_progress


class StatusSampler:
    """Samples our syncer's /v1/status every `interval` seconds in a background thread."""

    def __init__(self, run: OursRun, interval: float = 1.0) -> None:
        self.run = run
        self.interval = interval
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="status-sampler")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                st = self.run.status()
                self.samples.append((time.time(), st))
            except OSError:
                self.errors += 1  # the syncer is busy or the relay slow: try again
            self._stop.wait(self.interval)

    def __enter__(self) -> StatusSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def latest(self) -> dict[str, Any] | None:
        return self.samples[-1][1] if self.samples else None

    def wait_first_merge(self, timeout: float) -> None:
        """Block until the syncer reports outer step >= 1 (windows open after warm-up); fails
        early if a process of the run died."""

        def merged() -> bool:
            self.run.check_alive()
            st = self.latest()
            return bool(st and st["outerStep"] >= 1)

        poll_until(merged, timeout=timeout, what="the first merge")

    def at(self, t: float) -> tuple[float, dict[str, Any]]:
        """The last sample taken at or before t (the first one if none)."""
        before = [s for s in self.samples if s[0] <= t]
        return before[-1] if before else self.samples[0]


@dataclass(frozen=True)
class IslandWindow:
    """One island's progress over a window."""

    steps_per_s: float
    utilisation: float  # time in inner steps / wall time
    step_time: float = 0.0  # the time-mean of its reported step time over the window (s)
    # The steps a second it could take over the window, never waiting: the time-mean of the
    # inverse of its reported step time (rate_of). 0.0 without a step time.
    speed: float = 0.0
    # Its steps over those it could take (steps_per_s / speed), not capped at 1.
    busy: float = 0.0


def ours_islands(
    sampler: StatusSampler, t1: float, t2: float, *, tokens_per_step: int | None = None
) -> dict[str, IslandWindow]:
    """Per island: inner steps/s and utilisation (steps x the learner's step time / wall time).

    Steps come from the islands' heartbeats (every second), the step time from the learner's own
    moving average of its inner-step time, averaged over the window's samples. A heartbeat's
    step is the learner's schedule position, which a fill step (K = M, learner/fill_steps.py)
    does not move; with `tokens_per_step` the steps are instead the tokens it reports consumed
    over that (every step it trains, fill steps included: bench/hetero).
    """
    return islands_over(sampler.samples, sampler.at(t1)[0], sampler.at(t2)[0], tokens_per_step)


def islands_over(
    samples: Sequence[tuple[float, dict[str, Any]]],
    s1: float,
    s2: float,
    tokens_per_step: int | None = None,
) -> dict[str, IslandWindow]:
    """ours_islands over status `samples` (time, status) from the one at s1 to the one at s2."""
    first = next(st for t, st in samples if t == s1)
    last = next(st for t, st in samples if t == s2)
    window = [st for t, st in samples if s1 <= t <= s2]
    out: dict[str, IslandWindow] = {}
    dt = max(s2 - s1, 1e-9)
    for name, isl in last["islands"].items():
        start = first["islands"].get(name, {})
        if tokens_per_step:
            d_tokens = int(isl.get("tokens") or 0) - int(start.get("tokens") or 0)
            d_steps = d_tokens // tokens_per_step
        else:
            d_steps = int(isl.get("step") or 0) - int(start.get("step") or 0)
        times = [
            float(st["islands"][name]["stepTime"])
            for st in window
            if name in st["islands"] and st["islands"][name].get("stepTime")
        ]
        step_time = sum(times) / len(times) if times else 0.0
        speed = rate_of(times)
        out[name] = IslandWindow(
            d_steps / dt,
            min(1.0, d_steps * step_time / dt),
            step_time,
            speed=speed,
            busy=d_steps / dt / speed if speed > 0 else 0.0,
        )
    return out


def rate_of(step_times: Sequence[float]) -> float:
    """The steps a second an island could take over a window whose step times (seconds) were
    sampled at even intervals: the time-mean of 1 / t, not 1 / the time-mean of t.

    Why (issue 47, hetero18): an island whose step time moves with its host's load (a CPU
    island beside accelerators, 1.2-4.5x the fast islands' within a run) takes in a window
    the integral of 1 / t(tau) steps, and 1 / mean(t) is less than the mean of 1 / t (Jensen),
    the more so the more t moves: half the time at 1x and half at 4x, the mean step time 2.5x
    says 0.4 steps a unit where it could take 0.625. Read by the mean step time its compute
    share was too low and its utilisation over 100% (capped at 100.0% in every K = M run of
    hetero17), so its merged-token share read 1.01-1.40x its compute share. A step time of
    0 s or less is no reading; 0.0 without one.

    >>> rate_of([1.0, 4.0])  # (1 + 0.25) / 2
    0.625
    """
    inverse = [1.0 / t for t in step_times if t > 0]
    return sum(inverse) / len(inverse) if inverse else 0.0


def value_at(records: Sequence[dict[str, Any]], t: float, key: str) -> float:
    """A progress counter's value at time t: from the last record at or before t (0 if none)."""
    before = [r for r in records if r["time"] <= t]
    return float(before[-1][key]) if before else 0.0


def torchft_replica(files: Sequence[Path], t1: float, t2: float) -> dict[str, float]:
    """A replica's progress over a window, summed over its incarnations (restarts)."""
    steps = compute = useful = 0.0
    for f in files:
        recs = read_progress(f)
        steps += value_at(recs, t2, "steps") - value_at(recs, t1, "steps")
        compute += value_at(recs, t2, "compute_seconds") - value_at(recs, t1, "compute_seconds")
        useful += value_at(recs, t2, "useful_tokens") - value_at(recs, t1, "useful_tokens")
    dt = max(t2 - t1, 1e-9)
    return {
        "steps_per_s": steps / dt,
        "utilisation": min(1.0, compute / dt),
        "useful_tokens": useful,
    }
