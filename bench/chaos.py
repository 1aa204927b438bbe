"""Chaos on the real node (issue 22): runs tests/node/test_chaos.py, which trains one tiny job on
the real node while faults are injected one at a time and measures each (merges lost, their
tokens, pushes refused, seconds until both islands merge again, container restarts), then runs
the same job calm to the same outer step; the table goes to the log (bench/log/DAY.md).

The node tier needs root and one real node per machine: run it under the machine's real-node
lock when other tiers may be using the node, e.g. `flock LOCKFILE python -m bench.chaos`.
`--rows FILE` renders a table from the rows an earlier run wrote instead of running it. The
images are the node tier's (DILOCO_NODE_IMAGES_DIR names an already built directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness.common import (
    REPO_ROOT,
    LoadMonitor,
    Report,
    Table,
    base_parser,
    publish,
    workdir,
)

TEST = "tests/node/test_chaos.py"
# Container restarts are expected where a fault kills or deletes a process: the syncer's own.
COLUMNS = [
    "fault",
    "held (s)",
    "merges lost",
    "tokens lost",
    "pushes refused",
    "merges missing an island",
    "both islands merge again after (s)",
    "container restarts",
    "note",
]


def run_suite(rows_file: Path, log_file: Path) -> int:
    """pytest on the chaos module, its rows written to `rows_file`; its exit code."""
    env = {**os.environ, "DILOCO_CHAOS_RESULTS": str(rows_file)}
    with log_file.open("w") as log:
        # The first test starts the cluster and loads the images: more than the default 900 s.
        # `-m chaos`: the suite is left out of `make test` (pyproject's addopts deselect it).
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=1800"]
        cmd += ["-m", "chaos"]
        cmd.append(TEST)
        return subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=log).returncode


def fault_table(rows: list[dict[str, Any]]) -> Table:
    table = Table("Faults on the real node, one at a time (one job, gpt-tiny, 2 islands)", COLUMNS)
    for row in rows:
        if row["fault"].startswith("("):
            continue
        refused = ", ".join(f"{k} {v}" for k, v in sorted(row["refused"].items())) or "none"
        table.add(
            row["fault"],
            row["seconds"],
            row["merges_lost"],
            row["tokens_lost"],
            refused,
            row.get("partial_merges", "not recorded"),
            row["recovery_s"],
            row["restarts"],
            row["note"] or "",
        )
    return table


def along_table(rows: list[dict[str, Any]]) -> Table | None:
    """The chaos and calm runs' eval losses at equal merged tokens along the run (the calm
    row's `along`, written by the test), or None without a calm row."""
    calm = next((row for row in rows if row["fault"] == "(calm)"), None)
    if calm is None or not calm.get("along"):
        return None
    table = Table(
        "Eval loss at equal merged tokens along the run",
        ["merged tokens", "chaos", "calm", "chaos / calm"],
    )
    for tokens, chaos, base in calm["along"]:
        table.add(f"{tokens:,}", f"{chaos:.4f}", f"{base:.4f}", f"{chaos / base:.3f}")
    return table


def outcome_notes(rows: list[dict[str, Any]], code: int | None) -> list[str]:
    """The end of the chaos job and the calm comparison, said plainly (or that they are
    missing)."""
    by = {row["fault"]: row for row in rows}
    faults = [row for row in rows if not row["fault"].startswith("(")]
    ran = "rows of an earlier run" if code is None else f"pytest exit code {code} ({TEST})"
    notes = [f"{ran}; faults measured: {len(faults)}"]
    end, calm = by.get("(end)"), by.get("(calm)")
    if end is None:
        notes.append("the chaos job did not reach its end: no success and no loss comparison")
        return notes
    notes.append(
        f"the chaos job succeeded on its own at outer step {end['outer_step']}: "
        f"{end['tokens']} merged tokens, final eval loss {end['eval_loss']:.4f}"
    )
    if calm is None:
        notes.append("the calm run did not finish: no loss comparison")
    else:
        notes.append(
            f"calm run to the same outer step: {calm['tokens']} merged tokens, final eval loss "
            f"{calm['eval_loss']:.4f}; chaos final loss / calm loss at the chaos run's tokens "
            f"= {calm['chaos_loss_ratio']} (the test asks <= 1.05)"
        )
    return notes


def main() -> int:
    p = base_parser(__doc__ or "")
    p.add_argument("--rows", type=Path, default=None, help="render these rows; run nothing")
    args = p.parse_args()
    with LoadMonitor() as load, workdir(args.workdir, "chaos-") as work:
        if args.rows is not None:
            rows_file, code = args.rows, None
        else:
            rows_file = work / "chaos-rows.json"
            code = run_suite(rows_file, work / "pytest.log")
            print((work / "pytest.log").read_text()[-4000:])
        rows = json.loads(rows_file.read_text()) if rows_file.is_file() else []
    report = Report(
        script="bench/chaos.py",
        summary=(
            "A tiny job (gpt-tiny, 2 islands x 1 rank, K = M = 2, H = 5, checkpoints every "
            "outer step on a 48 MiB tmpfs volume) trains on the real node while each fault is "
            "injected once, the next only after both islands merged again. Merges lost: "
            "versions merged again after a restart from an older checkpoint."
        ),
        tables=[t for t in (fault_table(rows), along_table(rows)) if t is not None],
        notes=outcome_notes(rows, code),
    )
    return publish(report, args, load) or (code or 0)


if __name__ == "__main__":
    raise SystemExit(main())
