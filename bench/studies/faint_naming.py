"""How often does the work evidence name an HONEST island of two (issue 46)?

A job of two names an island islandWorkUnsupported when its last AT_BOUND_PUSHES judged pushes to
a fragment all moved less than 1/FAINT_RATIO of the other island's median movement per claimed
step (syncer/intake/guards.py, ContributionGuard.faint); faint_claims (bench/adversary.py) is
named that way. Before the naming can carry a consequence, how often does it fire on honest jobs?

Measured, not modelled: a real syncer and two real learners, and for every push the syncer judges
its work-evidence figure (the push's movement per claimed step over the other island's reference,
the value guards.WorkEvidence's detection keeps) and whether the guard names anybody after it.
The syncer runs in a child of this module (`--syncer-child`): the product's syncer with one
read-only hook (ContributionGuard.check_evidence) that records; nothing it decides changes.

Per job: the judged pushes, the namings (pushes after which faint() or unsupported() named an
island), and the margin: the smallest, over every window of AT_BOUND_PUSHES consecutive judged
pushes of one island to one fragment, of the window's largest figure (a naming needs it below
1/FAINT_RATIO = 0.25; below 1/EVIDENCE_RATIO, the push is refused).

Cases: K = M (quorum 2) or K = 1; islands at one speed (1:1) or island-1 three times slower
(1:3, inner.stepsPerIsland auto); a direct link or a slow one (every learner-syncer connection
through one relay of --slow-mbit and --latency-ms, shared by both islands). The job: a cosine over
OUTER_STEPS outer steps of H = 12 with a warm-up of two rounds (bench/studies/push_alignment.py's),
two fragments, fp32 pushes (int8 with --int8).

    python -m bench.studies.faint_naming --seeds 0 1 2
    python -m bench.studies.faint_naming --cases 1:1/K=1/direct --seeds 0 --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco_trainer.api.spec import JobSpec

from bench.bandwidth import start_relay
from bench.harness.common import LoadMonitor, Report, Table, base_parser, publish, track, workdir
from bench.harness.ours_harness import HookedRun
from bench.studies.push_alignment import OUTER_STEPS, WARMUP, H, pair_job

COLUMNS = ["case", "seed", "judged pushes", "refused", "namings (pushes)", "named"]
COLUMNS += ["min figure", "1st pct", "median", "margin (naming < 0.25)", "load"]
RECORDS_ENV = "DILOCO_STUDY_FAINT_FILE"  # where the child syncer writes its records
# name -> (slowdown of island-1, quorum, slow link)
CASES: dict[str, tuple[float, int, bool]] = {
    f"{speed}/K={k}/{link}": (3.0 if speed == "1:3" else 1.0, 2 if k == "M" else 1, link == "slow")
    for speed in ("1:1", "1:3")
    for k in ("M", "1")
    for link in ("direct", "slow")
}


def job_spec(case: str, preset: str, seed: int, int8: bool) -> JobSpec:
    slowdown, quorum, _ = CASES[case]
    compression = "int8" if int8 else "none"
    return pair_job(preset, seed, slowdown=slowdown, quorum=quorum, compression=compression)


# ---- the child: the product's syncer with a read-only recording hook ----


def install_hooks(path: Path) -> None:
    from diloco_trainer.syncer.intake.guards import ContributionGuard

    out = path.open("a", buffering=1)
    lock = threading.Lock()
    check = ContributionGuard.check_evidence

    def hooked(self: Any, fragment: int, island: str, norm: float, steps: int) -> None:
        ev = self.evidence
        ref = None if ev is None else ev.reference(fragment, island)
        refused = None
        try:
            check(self, fragment, island, norm, steps)
        except Exception as err:
            refused = getattr(err, "code", type(err).__name__)
            raise
        finally:
            if ref is not None and steps > 0:
                record = {
                    "t": time.time(),
                    "fragment": fragment,
                    "island": island,
                    "steps": steps,
                    "norm": norm,
                    "figure": norm / steps / ref if ref > 0 else None,
                    "refused": refused,
                    "faint": sorted(self.faint()),
                    "unsupported": sorted(self.unsupported()),
                }
                with lock:
                    out.write(json.dumps(record) + "\n")

    ContributionGuard.check_evidence = hooked  # type: ignore[method-assign]


def child() -> int:
    from diloco_trainer.syncer.service import main as syncer_main

    install_hooks(Path(os.environ[RECORDS_ENV]))
    return syncer_main(argparse.Namespace())


# ---- the parent: one job per case and seed ----


def run_job(case: str, seed: int, args: argparse.Namespace, base: Path) -> tuple[list[dict], str]:
    """The job's records and the load during it (a finished job in --workdir is reused)."""
    name = case.replace("/", "_").replace(":", "-").replace("=", "")
    where = base / f"{name}_s{seed}"
    records, done = where / "records.jsonl", where / "done"
    if records.exists() and done.exists():
        return read(records), done.read_text()
    records.unlink(missing_ok=True)
    spec = job_spec(case, args.preset, seed, args.int8)
    relay: dict[str, Any] = {}

    def route(_i: int, url: str) -> str:
        if not relay:
            target = int(url.rsplit(":", 1)[1])
            relay["proc"], relay["port"] = start_relay(
                where, target, args.slow_mbit, args.latency_ms
            )
            track(relay["proc"])
        return f"http://127.0.0.1:{relay['port']}"

    slow = CASES[case][2]
    run = HookedRun(
        spec,
        where,
        module="bench.studies.faint_naming",
        records_env=RECORDS_ENV,
        slowdowns={1: CASES[case][0]},
        route=route if slow else None,
        records=records,
    )
    with LoadMonitor() as load:
        try:
            run.start()
            run.wait_finished(timeout=args.timeout)
        finally:
            run.stop()
            if relay:
                relay["proc"].stop()
    done.write_text(f"{time.strftime('%H:%M', time.gmtime(load.started))} UTC, {load.describe()}")
    return read(records), done.read_text()


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def margin(records: Sequence[dict], window: int) -> float | None:
    """The smallest, over every `window` consecutive judged pushes of one island to one
    fragment, of the window's largest figure (a naming needs it below 1 / FAINT_RATIO)."""
    by: dict[tuple[int, str], list[float]] = {}
    for r in records:
        if r["figure"] is not None:
            by.setdefault((r["fragment"], r["island"]), []).append(r["figure"])
    worst = None
    for figures in by.values():
        for i in range(len(figures) - window + 1):
            top = max(figures[i : i + window])
            worst = top if worst is None else min(worst, top)
    return worst


def summary(records: Sequence[dict]) -> dict[str, Any]:
    from diloco_trainer.syncer.intake.guards import AT_BOUND_PUSHES

    named = [r for r in records if r["faint"] or r["unsupported"]]
    figures = sorted(r["figure"] for r in records if r["figure"] is not None)
    return {
        "judged": len(records),
        "named": len(named),
        "named_islands": sorted({i for r in named for i in r["faint"] + r["unsupported"]}),
        "refused": sum(1 for r in records if r["refused"]),
        "min": figures[0] if figures else None,
        "p1": figures[len(figures) // 100] if figures else None,
        "median": figures[len(figures) // 2] if figures else None,
        "margin": margin(records, AT_BOUND_PUSHES),
    }


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:] == ["--syncer-child"]:
        return child()
    p = base_parser(__doc__ or "")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--preset", default="gpt-tiny")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--int8", action="store_true", help="int8 pushes (default: fp32)")
    p.add_argument("--slow-mbit", type=float, default=4.0, help="the slow link's rate")
    p.add_argument("--latency-ms", type=float, default=50.0, help="the slow link's latency")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    args = p.parse_args(argv)
    table = Table(
        "Honest jobs of two: the work evidence's figures and namings",
        COLUMNS,
    )
    totals = {"judged": 0, "named": 0, "jobs": 0, "jobs_named": 0}
    margins: list[float] = []
    with LoadMonitor() as load, workdir(args.workdir, "faint_naming") as base:
        for seed in args.seeds:
            for case in args.cases:
                records, when = run_job(case, seed, args, base)
                s = summary(records)
                totals["judged"] += s["judged"]
                totals["named"] += s["named"]
                totals["jobs"] += 1
                totals["jobs_named"] += bool(s["named"])
                if s["margin"] is not None:
                    margins.append(s["margin"])
                table.add(case, seed, s["judged"], s["refused"], s["named"],
                          ", ".join(s["named_islands"]) or "-", fmt(s["min"]), fmt(s["p1"]),
                          fmt(s["median"]), fmt(s["margin"]), when)  # fmt: skip
    report = Report(
        "studies/faint_naming",
        f"The work evidence's naming on honest jobs of two ({args.preset}, H = {H}, a cosine over "
        f"{OUTER_STEPS} outer steps, warm-up {WARMUP} steps; slow link {args.slow_mbit:g} Mbit/s "
        f"+ {args.latency_ms:g} ms; {'int8' if args.int8 else 'fp32'} pushes).",
        tables=[table],
        notes=[
            f"all: {totals['jobs']} jobs, {totals['judged']} judged pushes; {totals['named']} "
            f"pushes after which an island was named, in {totals['jobs_named']} jobs; smallest "
            f"margin {fmt(min(margins) if margins else None)} (a naming needs < 0.25)",
            "figure: a judged push's movement per claimed step over the other island's "
            "reference (guards.WorkEvidence); records: <workdir>/<case>_s<seed>/records.jsonl",
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
