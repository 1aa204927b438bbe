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

from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import JobSpec


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _fmt(x: Any, spec: str = ".4f") -> str:
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


def progress_line(status: SyncerStatus, elapsed: float) -> str:
    """The one line printed per outer step when the live view is off (not a terminal)."""
    return (
        f"outer step {status.outer_step}  tokens {status.tokens:,}  "
        f"eval loss {_fmt(status.eval_loss)}  ({elapsed:.0f}s)"
    )


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


def status_view(
    spec: JobSpec,
    status: SyncerStatus,
    *,
    started: float,
    slowdowns: Mapping[int, float],
    dead: Mapping[str, int],
) -> RenderableType:
    """The live view: one progress line, the headline figures, and a row per island."""
    frac, label = progress_fraction(spec, status)
    limit = spec.stop_after.outer_steps
    head = Text.assemble(
        ("outer step ", "bold"),
        f"{status.outer_step}" + (f"/{limit}" if limit else ""),
        ("  tokens ", "bold"),
        f"{status.tokens:,}",
        ("  loss ", "bold"),
        _fmt(status.loss),
        ("  eval ", "bold"),
        f"{_fmt(status.initial_eval_loss)} -> {_fmt(status.eval_loss)}",
        ("  pushed ", "bold"),
        human_bytes(status.bytes_in),
        ("  pulled ", "bold"),
        human_bytes(status.bytes_out),
        ("  elapsed ", "bold"),
        f"{time.monotonic() - started:.0f}s",
    )
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=1.0, completed=frac, width=50), f"{frac:.0%} ({label})")
    islands = Table(box=None, pad_edge=False)
    for col in ("island", "state", "pushes", "joins", "tokens", "loss", "last push", "note"):
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
            str(info.pushes),
            str(info.joins),
            f"{info.tokens:,}",
            _fmt(info.loss),
            f"{now - info.last_push:.0f}s ago" if info.last_push else "-",
            ", ".join(notes),
        )
    return Group(bar, head, islands)


def summary_table(summary: Mapping[str, Any]) -> Table:
    """The end-of-run table of `diloco run`."""
    table = Table(title="diloco run: summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("islands (M)", str(summary["islands"])),
        ("outer steps", str(summary["outer_steps"])),
        ("tokens", f"{summary['tokens']:,}"),
        ("initial eval loss", _fmt(summary["initial_eval_loss"])),
        ("final eval loss", _fmt(summary["final_eval_loss"])),
        ("pseudo-gradients pushed", human_bytes(summary["bytes_pushed"])),
        ("weights pulled", human_bytes(summary["bytes_pulled"])),
        ("wall time", f"{summary['wall_seconds']:.1f}s"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table
