"""bench/hetero's figures that are judged against issue 47's targets, as pure functions.

Compute share from measured speed (compute_shares): an island slowed by DILOCO_SLOWDOWN = f
sleeps (f - 1) x its compute after each step, and on a shared machine that compute is contended
too, so its real speed is not 1/f of the others' (bench/hetero's 3x island read 4.5-6x even on
a quiet machine). Its share of the job's compute is read from the same run instead: with t_i
island i's mean inner-step wall time over the run's window (bench/hetero: the time-mean of its
reported stepTime, sleep included), its speed is 1 / t_i steps a second and, every island's
step carrying the same tokens, its compute share is

    share_i = (1 / t_i) / sum_j (1 / t_j)

the share of the job's merged tokens it would carry if no island ever waited.

The fast islands' utilisation against equal speeds (kept_utilisation): one equal-speed run on a
loaded 2-core machine swings +-10%, more than the 3% the target allows, so the benchmark can run
the equal-speed baseline N times interleaved with the mixed runs (--repeats) and judges the
ratio of the means with its noise: the target is met only when the whole 95% interval of the
ratio is at or above it, MISSED only when the whole interval is below it, else not resolved.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.harness.adversary_report import T95, T95_MORE

KEPT_TARGET = 0.97  # issue 47: fast islands keep >= 97% of their equal-speed utilisation

# The syncer's log line for a round's change (syncer/service/island_calls.py's heartbeat).
_ROUND = re.compile(r"(\S+): rounds of (\d+) inner steps \(was (\d+)\)")


def round_paths(syncer_log: str, names: Sequence[str]) -> dict[str, list[int]]:
    """Each island's H_i over a run from the syncer's log: its first round (the first line's
    `was`), then every round it changed to; a probe's line that changed nothing adds none. An
    island with no line: an empty path (its round never moved from the spec's).

    >>> line = "x: island-1: rounds of {} inner steps (was {}) at ..."
    >>> log = "\\n".join(line.format(*p) for p in [(20, 50), (20, 20), (30, 20)])
    >>> round_paths(log, ["island-0", "island-1"])
    {'island-0': [], 'island-1': [50, 20, 30]}
    """
    paths: dict[str, list[int]] = {n: [] for n in names}
    for m in _ROUND.finditer(syncer_log):
        name, now, was = m[1], int(m[2]), int(m[3])
        if name not in paths or now == was:
            continue
        path = paths[name]
        if not path:
            path.append(was)
        path.append(now)
    return paths


def compute_shares(step_times: Sequence[float]) -> list[float]:
    """Each island's share of the job's compute from its measured step time (seconds):
    (1 / t_i) / sum_j (1 / t_j). An island without a positive, finite step time has no measured
    speed: every share is then NaN (no share is honest without all of them).

    >>> compute_shares([1.0, 1.0, 2.0])  # speeds 1, 1, 0.5 of 2.5
    [0.4, 0.4, 0.2]
    """
    if not step_times or any(not (t > 0 and math.isfinite(t)) for t in step_times):
        return [math.nan] * len(step_times)
    speeds = [1.0 / t for t in step_times]
    total = sum(speeds)
    return [s / total for s in speeds]


def speed_ratios(step_times: Sequence[float], factors: Sequence[float]) -> list[float]:
    """Each island's measured step time over the mean step time of the islands not slowed
    (factor 1): how much slower it really ran than the fast ones in the same run (the nominal
    figure is its factor). NaN without a fast island or a step time.

    >>> speed_ratios([0.25, 0.75, 1.25], [1, 1, 3])  # fast mean 0.5
    [0.5, 1.5, 2.5]
    """
    fast = [t for t, f in zip(step_times, factors, strict=True) if f == 1 and t > 0]
    if not fast or len(fast) != sum(1 for f in factors if f == 1):
        return [math.nan] * len(step_times)
    ref = statistics.fmean(fast)
    return [t / ref if t > 0 else math.nan for t in step_times]


@dataclass(frozen=True)
class Kept:
    """The fast islands' utilisation in the mixed runs against the equal-speed baselines'."""

    ratio: float  # mean of the mixed runs / mean of the baselines
    half_width: float  # of its 95% interval (NaN when the noise cannot be estimated)
    per_run: tuple[float, ...]  # each mixed run / the mean of the baselines
    baselines: tuple[float, ...]  # each baseline / the mean of the baselines: their own spread

    @property
    def verdict(self) -> str:
        """met when the interval lies at or above KEPT_TARGET, MISSED when below, else not
        resolved (always with one baseline and one mixed run: no estimate of the noise)."""
        if math.isnan(self.half_width):
            return "not resolved"
        if self.ratio - self.half_width >= KEPT_TARGET:
            return "met"
        if self.ratio + self.half_width < KEPT_TARGET:
            return "MISSED"
        return "not resolved"

    def describe(self) -> str:
        spread = "" if math.isnan(self.half_width) else f" ± {self.half_width:.3f}"
        runs = ", ".join(f"{r:.3f}" for r in self.per_run)
        base = ", ".join(f"{b:.3f}" for b in self.baselines)
        return f"{self.ratio:.3f}x{spread} (runs {runs}; baselines {base})"


def kept_utilisation(mixed: Sequence[float], baselines: Sequence[float]) -> Kept:
    """The ratio of the mixed runs' mean fast-island utilisation to the baselines' mean, and the
    half-width of its 95% interval.

    The runs interleave on the same machine, so both sides are taken to have the same relative
    run-to-run noise: its variance is pooled from both sides' relative deviations from their own
    means, s^2 = (sum (b_i / b - 1)^2 + sum (m_j / m - 1)^2) / (n_b + n_m - 2), and the ratio
    m / b has the relative standard error s x sqrt(1 / n_m + 1 / n_b) (to first order) and the
    half-width ratio x t(n_b + n_m - 2) x that (Student's t, two-sided 95%). With a single run
    on each side there is no estimate (NaN).

    >>> k = kept_utilisation([0.9], [0.9, 1.1])  # s^2 = 0.02 / 1, rel. se = 0.1414 x 1.2247
    >>> round(k.ratio, 3), round(k.half_width, 3), k.per_run, k.baselines
    (0.9, 1.981, (0.9,), (0.9, 1.1))
    """
    if not mixed or not baselines:
        raise ValueError("need at least one mixed run and one baseline")
    m, b = statistics.fmean(mixed), statistics.fmean(baselines)
    if b <= 0:
        raise ValueError(f"baselines' mean utilisation must be positive, got {b}")
    ratio = m / b
    dof = len(mixed) + len(baselines) - 2
    if dof < 1 or m <= 0:
        half = math.nan
    else:
        squares = sum((x / b - 1) ** 2 for x in baselines) + sum((x / m - 1) ** 2 for x in mixed)
        rel_se = math.sqrt(squares / dof) * math.sqrt(1 / len(mixed) + 1 / len(baselines))
        half = ratio * T95.get(dof, T95_MORE) * rel_se
    return Kept(
        ratio=ratio,
        half_width=half,
        per_run=tuple(x / b for x in mixed),
        baselines=tuple(x / b for x in baselines),
    )


def repeats_to_resolve(kept: Kept, most: int = 100, target: float = KEPT_TARGET) -> int | None:
    """The fewest runs a side (as many baselines as mixed runs) at which a ratio this far from
    `target` (default KEPT_TARGET; bench/heldout_quorum: 1.01), with this run-to-run noise,
    would be resolved: ratio x t(2n - 2) x s x sqrt(2 / n) < |ratio - target|, with s the
    relative noise of one run that kept_utilisation pooled (read back from its half-width).
    None without a noise estimate, with the ratio on the target, or past `most`: how far a
    "not resolved" is from a verdict, never one itself (the mean may move with more runs)."""
    margin = abs(kept.ratio - target)
    n_m, n_b = len(kept.per_run), len(kept.baselines)
    if math.isnan(kept.half_width) or margin == 0 or kept.ratio <= 0:
        return None
    t_now = T95.get(n_m + n_b - 2, T95_MORE)
    s = kept.half_width / (kept.ratio * t_now * math.sqrt(1 / n_m + 1 / n_b))
    for n in range(2, most + 1):
        if kept.ratio * T95.get(2 * n - 2, T95_MORE) * s * math.sqrt(2 / n) < margin:
            return n
    return None
