"""The end of `diloco run`: the JSON summary and its table, with the bytes moved against what
synchronous data-parallel training (DDP) would have moved for the same tokens."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.table import Table

from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.progress import fmt_or_dash, human_bytes
from diloco_trainer.local.run_folder import Ledger

FP32 = 4


def ddp_bytes_per_worker(spec: JobSpec, tokens: int, parameters: int) -> float:
    """Bytes each worker of DDP would send and receive for `tokens`: one ring all-reduce of the
    fp32 gradients per inner step, 2(N-1)/N of them each way, over the job's N ranks (as
    bench/decoupled_quality counts it against an island's pushes plus pulls)."""
    ranks = sum(spec.islands.replicas_of(i) for i in range(spec.islands.count))
    if ranks <= 1:
        return 0.0
    steps_per_worker = tokens / (spec.inner.tokens_per_step * ranks)
    return 2 * steps_per_worker * 2 * (ranks - 1) / ranks * parameters * FP32


def make_summary(
    status: SyncerStatus,
    *,
    spec: JobSpec,
    wall_seconds: float,
    workdir: Path,
    parameters: int | None = None,
    earlier: Ledger | None = None,
) -> dict[str, Any]:
    """The JSON summary of a finished run, from the syncer's final status: of the whole job,
    its earlier sessions (`earlier`, a resumed run's: run_folder.py) included."""
    earlier = earlier or Ledger()
    islands = spec.islands.count
    pushed = earlier.bytes_pushed + status.bytes_in
    pulled = earlier.bytes_pulled + status.bytes_out
    per_worker = (pushed + pulled) / max(1, islands)
    ddp = ddp_bytes_per_worker(spec, status.tokens, parameters) if parameters else None
    return {
        "job": status.job_name,
        "islands": islands,
        "outer_steps": status.outer_step,
        "finished": status.finished,
        "tokens": status.tokens,
        "initial_eval_loss": status.initial_eval_loss,
        "final_eval_loss": status.eval_loss,
        "bytes_pushed": pushed,
        "bytes_pulled": pulled,
        "parameters": parameters,
        "bytes_per_island": round(per_worker),
        "ddp_bytes_per_worker": None if ddp is None else round(ddp),
        "wall_seconds": round(earlier.wall_seconds + wall_seconds, 3),
        "sessions": earlier.sessions + 1,
        "session_seconds": round(wall_seconds, 3),
        "eval_history": [point.to_json() for point in status.eval_history],
        "island_stats": {name: info.to_json() for name, info in status.islands.items()},
        "workdir": str(workdir),
    }


def against_ddp(summary: Mapping[str, Any]) -> str:
    """'1.2 MiB vs 180 MiB (150x fewer)': an island's bytes (pushed and pulled) against a DDP
    worker's (sent and received)."""
    ours, ddp = summary.get("bytes_per_island"), summary.get("ddp_bytes_per_worker")
    if not ddp or ours is None:
        return "-"
    ratio = f"{ddp / ours:,.0f}x fewer" if ours else "nothing sent"
    return f"{human_bytes(ours)} vs {human_bytes(ddp)} ({ratio})"


def summary_table(summary: Mapping[str, Any]) -> Table:
    """The end-of-run table of `diloco run`."""
    table = Table(title="diloco run: summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("islands (M)", str(summary["islands"])),
        ("outer steps", str(summary["outer_steps"])),
        ("tokens", f"{summary['tokens']:,}"),
        ("initial eval loss", fmt_or_dash(summary["initial_eval_loss"])),
        ("final eval loss", fmt_or_dash(summary["final_eval_loss"])),
        ("pseudo-gradients pushed", human_bytes(summary["bytes_pushed"])),
        ("weights pulled", human_bytes(summary["bytes_pulled"])),
        ("bytes per island vs a DDP worker", against_ddp(summary)),
        ("wall time", f"{summary['wall_seconds']:.1f}s"),
    ]
    if summary.get("sessions", 1) > 1:
        rows.append(("sessions (resumed)", str(summary["sessions"])))
    for what, value in rows:
        table.add_row(what, value)
    return table
