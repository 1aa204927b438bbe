"""Rich renderings for `diloco run`: the live view of a job and the final summary.

Pure functions from the syncer's status document (api.documents.SyncerStatus) to rich renderables,
so the launcher stays a thin loop and these can be looked at without processes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from diloco_trainer.api.documents import IslandStatus, SyncerStatus
from diloco_trainer.api.preflight import run_tokens
from diloco_trainer.api.spec import JobSpec

# In a pipe, a progress line at least this often (besides one per outer step and evaluation).
PROGRESS_SECONDS = 10.0


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_or_dash(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


_NUMBER = re.compile(r"(\d+)")
_ISLAND_INDEX = re.compile(r"island-(\d+)$")


def island_order(name: str) -> tuple[Any, ...]:
    """Sort key putting island-2 before island-10 (numbers compare as numbers)."""
    return tuple(int(part) if part.isdigit() else part for part in _NUMBER.split(name))


def island_index(name: str) -> int | None:
    """The index in an island's name ('eu-island-3' -> 3), None for another name."""
    match = _ISLAND_INDEX.search(name)
    return int(match.group(1)) if match else None


def exit_notes(island: str, dead: Mapping[str, int]) -> list[str]:
    """'exited CODE' notes for the island's processes that exited (`dead` is keyed by process
    name: the island itself, or 'ISLAND/rankR' for one of its ranks)."""
    notes = []
    for proc in sorted(dead, key=island_order):
        if proc == island:
            notes.append(f"exited {dead[proc]}")
        elif proc.startswith(island + "/"):
            notes.append(f"{proc.removeprefix(island + '/')} exited {dead[proc]}")
    return notes


def latest_eval(status: SyncerStatus) -> tuple[float, int] | None:
    """(eval loss, the outer step it was measured at) of the newest evaluation, None before one.

    The syncer evaluates in the background, so its evalLoss may be an earlier step's while
    outerStep has moved on: a figure shown beside a step must say which step it is of."""
    points = [p for p in status.eval_history if p.eval_loss is not None]
    if points:
        newest = max(points, key=lambda p: p.outer_step)
        assert newest.eval_loss is not None
        return newest.eval_loss, newest.outer_step
    return None


def eval_text(status: SyncerStatus) -> str:
    """'2.5293 (step 3)': the newest eval loss and its step ('-' before the first)."""
    newest = latest_eval(status)
    if newest is None:
        return fmt_or_dash(status.eval_loss)
    loss, step = newest
    return f"{loss:.4f} (step {step})"


def duration(seconds: float | None) -> str:
    """93 -> '1m33s'; None -> '-'."""
    if seconds is None:
        return "-"
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def eta_seconds(fraction: float, elapsed: float) -> float | None:
    """Seconds left at the pace so far, None before any progress (or with no stop condition)."""
    if fraction <= 0 or elapsed <= 0:
        return None
    return elapsed * (1 - fraction) / fraction


def step_of(spec: JobSpec | None, status: SyncerStatus) -> str:
    """'3/20' with stopAfter.outerSteps, else '3'."""
    limit = spec.stop_after.outer_steps if spec is not None else None
    return f"{status.outer_step}/{limit}" if limit else str(status.outer_step)


def trained_tokens(status: SyncerStatus) -> int:
    """Tokens the islands have trained on: their heartbeats' counts (island_tokens), which
    move every few steps, not only when a merge lands; at least the merged ones."""
    reported = sum(island_tokens(info) for info in status.islands.values())
    return max(status.tokens, reported)


def token_rate(status: SyncerStatus, elapsed: float, base: int = 0) -> float | None:
    """Tokens per second trained in this session (`base`: the trained tokens when it began,
    a resumed job's earlier ones), None before any."""
    done = trained_tokens(status) - base
    if elapsed <= 0 or done <= 0:
        return None
    return done / elapsed


def eta(spec: JobSpec | None, status: SyncerStatus, elapsed: float, base: int = 0) -> float | None:
    """Seconds left at this session's pace: how far the job is (the merged fraction, or the
    tokens the islands trained against those the run trains, api/preflight.run_tokens,
    whichever is further: trained tokens move from the first steps, merges once a round) since
    this session began (`base`: the trained tokens then)."""
    if spec is None:
        return None
    frac, _ = progress_fraction(spec, status)
    start = 0.0
    total = run_tokens(spec)
    if total:
        frac = max(frac, min(1.0, trained_tokens(status) / total))
        start = min(frac, base / total)
    if frac <= start or elapsed <= 0:
        return None
    return elapsed * (1 - frac) / (frac - start)


def progress_line(
    status: SyncerStatus, elapsed: float, spec: JobSpec | None = None, base: int = 0
) -> str:
    """The line printed when the live view is off (a pipe, a log file): once per outer step,
    once per new evaluation and every PROGRESS_SECONDS, with the tokens the islands trained
    (their heartbeats'), this session's tokens per second, the eval loss named by the step it
    was measured at, and the ETA."""
    line = f"outer step {step_of(spec, status)}  tokens {trained_tokens(status):,}"
    if status.tokens != trained_tokens(status):
        line += f" ({status.tokens:,} merged)"
    line += f"  eval loss {eval_text(status)}"
    rate = token_rate(status, elapsed, base)
    line += f"  {rate or 0:,.0f} tok/s"
    left = eta(spec, status, elapsed, base)
    if left is not None:
        line += f"  ETA {duration(left)}"
    return line + f"  ({elapsed:.0f}s)"


def progress_key(status: SyncerStatus) -> tuple[int, int | None]:
    """What changes when a new progress line is due: the outer step or the newest eval's step."""
    newest = latest_eval(status)
    return status.outer_step, None if newest is None else newest[1]


def island_tokens(info: IslandStatus) -> int:
    """An island's tokens: those it reported in heartbeats, or, when its heartbeats have not
    said yet (a short run, an island that only pushed), its tokens in merges."""
    return max(info.tokens, info.merged_tokens)


def steps_per_second(info: IslandStatus) -> str:
    """The island's inner steps per second from its reported step time."""
    return f"{1 / info.step_time:.2f}" if info.step_time else "-"


def waiting_share(info: IslandStatus) -> str:
    """The share of its wall time the island's learner last said it waited for the syncer
    (its heartbeat's `waiting`: merge waits, holds); "-" until it says (never 0 for unknown).
    The operator raises WaitingForMerges on the same figure (docs/cluster.md)."""
    return "-" if info.waiting is None else f"{info.waiting:.0%}"


def progress_fraction(spec: JobSpec, status: SyncerStatus) -> tuple[float, str]:
    """How far the job is towards stopAfter (the nearer of its limits) and a label."""
    fractions = []
    if spec.stop_after.outer_steps:
        fractions.append((status.outer_step / spec.stop_after.outer_steps, "outer step"))
    if spec.stop_after.tokens:
        fractions.append((status.tokens / spec.stop_after.tokens, "tokens"))
    if not fractions:
        return 0.0, "no stopAfter: runs until Ctrl-C"
    frac, label = max(fractions)
    return min(1.0, frac), label


def headline(spec: JobSpec, status: SyncerStatus, elapsed: float, base: int = 0) -> Text:
    """The figures of the whole job: N of total, tokens and their rate, losses, bytes, time."""
    total = spec.stop_after.tokens
    rate = token_rate(status, elapsed, base)
    return Text.assemble(
        ("outer step ", "bold"),
        step_of(spec, status),
        ("  tokens ", "bold"),
        f"{trained_tokens(status):,}" + (f"/{total:,}" if total else ""),
        f" ({rate:,.0f}/s)" if rate else "",
        ("  loss ", "bold"),
        fmt_or_dash(status.loss),
        ("  eval ", "bold"),
        f"{fmt_or_dash(status.initial_eval_loss)} -> {eval_text(status)}",
        ("  pushed ", "bold"),
        human_bytes(status.bytes_in),
        ("  pulled ", "bold"),
        human_bytes(status.bytes_out),
        ("  elapsed ", "bold"),
        duration(elapsed),
        ("  ETA ", "bold"),
        duration(eta(spec, status, elapsed, base)),
    )


ISLAND_COLUMNS = (
    "island",
    "state",
    "step",
    "steps/s",
    "pushes",
    "joins",
    "tokens",
    "loss",
    "waiting",
)


def status_view(
    spec: JobSpec,
    status: SyncerStatus,
    *,
    started: float,
    slowdowns: Mapping[int, float],
    dead: Mapping[str, int],
    base: int = 0,
) -> RenderableType:
    """The live view: one progress line, the headline figures, and a row per island."""
    frac, label = progress_fraction(spec, status)
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=1.0, completed=frac, width=50), f"{frac:.0%} ({label})")
    islands = Table(box=None, pad_edge=False)
    for col in (*ISLAND_COLUMNS, "last push", "note"):
        islands.add_column(col, justify="left" if col in ("island", "state", "note") else "right")
    now = time.time()
    for name in sorted(status.islands, key=island_order):
        info = status.islands[name]
        notes = []
        index = island_index(name)
        if index is not None and slowdowns.get(index, 1.0) > 1:
            notes.append(f"slowed {slowdowns[index]:g}x")
        notes += exit_notes(name, dead)
        islands.add_row(
            name,
            info.state,
            str(info.step),
            steps_per_second(info),
            str(info.pushes),
            str(info.joins),
            f"{island_tokens(info):,}",
            fmt_or_dash(info.loss),
            waiting_share(info),
            f"{now - info.last_push:.0f}s ago" if info.last_push else "-",
            ", ".join(notes),
        )
    return Group(bar, headline(spec, status, time.monotonic() - started, base), islands)
