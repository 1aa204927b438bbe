"""A run's CPU floor on this host (bench/busy_emulated, issue 45): the CPU seconds a round of the
job needs against the core-seconds the host's cores offer in a round, and the utilisation that
permits.

With an emulated accelerator an inner step is asleep: almost every CPU second of the run's
processes (the learners' training and link threads, the syncer, the relay) is the sync path's
(and the emulated step's own small write of its slice of the weights). When those seconds a
round exceed what the host's cores can give in a round's compute time, no overlap can hide
them: the round lasts at least cpu / cores, and the learners' steps fill at most
compute / (cpu / cores) of it. That bound is the host's, not the product's: a GPU learner's
push and apply run on its device, and its syncer and relay have their own cores.

Read from /proc: each process's utime + stime (+ its waited-for children's), and the host's
busy time from /proc/stat's first line (every process of the machine, others' work included).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_cpu_ticks(stat_line: str) -> int:
    """utime + stime + cutime + cstime (fields 14 to 17) of a /proc/<pid>/stat line, in clock
    ticks. The command name (field 2, in parentheses) may hold spaces and parentheses itself,
    so the fields are counted after its last ')': field n is word n - 3 (from 0) after it."""
    rest = stat_line[stat_line.rindex(")") + 1 :].split()
    return sum(int(w) for w in rest[11:15])


def host_ticks(proc_stat_text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of every core since boot, from /proc/stat's `cpu` line:
    busy is everything but idle and iowait (fields 4 and 5); guest time is already in user."""
    words = proc_stat_text.splitlines()[0].split()
    if words[0] != "cpu":
        raise ValueError(f"not /proc/stat's first line: {words[:3]}")
    ticks = [int(w) for w in words[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


@dataclass(frozen=True)
class PerRound:
    """A run's steady state a round: wall seconds, CPU seconds of its own processes and of
    the whole host (its own included), over `rounds` outer steps."""

    wall: float
    cpu: float
    host_cpu: float
    rounds: int

    @property
    def others_cpu(self) -> float:
        """CPU seconds a round of every other process on the host (others' work)."""
        return max(0.0, self.host_cpu - self.cpu)


def per_round(rows: Sequence[tuple[int, float, float, float]]) -> PerRound:
    """(outer step, wall, run's CPU, host's CPU) samples, seconds: the slopes a round from the
    first sample after outer step 1 (start-up and the joins' full pulls before it left out) to
    the first sample at the last outer step seen (the drain and the syncer's final evaluation
    after it left out). NaN with fewer than one round between them."""
    later = [r for r in rows if r[0] >= 1]
    if not later:
        return PerRound(math.nan, math.nan, math.nan, 0)
    last = max(r[0] for r in later)
    a, b = later[0], next(r for r in later if r[0] == last)
    n = b[0] - a[0]
    if n < 1:
        return PerRound(math.nan, math.nan, math.nan, 0)
    return PerRound((b[1] - a[1]) / n, (b[2] - a[2]) / n, (b[3] - a[3]) / n, n)


def offered(wall_per_round: float, cores: int) -> float:
    """Core-seconds the host's cores offer in a round of `wall_per_round` seconds."""
    return cores * wall_per_round


def floor_utilisation(cpu_per_round: float, compute_per_round: float, cores: float) -> float:
    """The utilisation `cores` permit a job whose round needs `cpu_per_round` CPU seconds and
    whose learners step `compute_per_round` seconds a round: a round cannot be shorter than
    its compute nor than cpu / cores, so utilisation <= compute / max(compute, cpu / cores).
    `cores` may be a fraction (a share of the host's); none: 0."""
    if compute_per_round <= 0 or cpu_per_round < 0:
        raise ValueError(
            f"compute ({compute_per_round}) must be > 0 and CPU ({cpu_per_round}) >= 0"
        )
    if cores <= 0:
        return 0.0
    return compute_per_round / max(compute_per_round, cpu_per_round / cores)


def needed_share(cpu_per_round: float, compute_per_round: float, cores: int) -> float:
    """The share of the host's cores the run's CPU would take were its rounds as short as their
    compute (utilisation 1): cpu / (cores x compute). Above 1 the cores cannot keep up (the
    floor is its inverse); near 1 they can only if nothing else runs and the work overlaps
    perfectly."""
    return cpu_per_round / (cores * compute_per_round)


def usable_cores() -> int:
    """The cores this process may run on (its affinity), which its children inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass
class CpuSampler:
    """CPU samples of a run's processes, taken at each of its status polls (run_over_link's
    on_sample). A process that has exited keeps its last reading (its CPU stays spent)."""

    rows: list[tuple[int, float, float, float]] = field(default_factory=list)
    last: dict[int, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def __call__(self, outer_step: int, pids: list[int]) -> None:
        for pid in pids:
            try:
                line = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue  # exited: its last reading stands
            self.last[pid] = stat_cpu_ticks(line) / CLOCK_TICKS
        busy, _ = host_ticks(Path("/proc/stat").read_text())
        now = time.monotonic() - self.t0
        self.rows.append((outer_step, now, sum(self.last.values()), busy / CLOCK_TICKS))
