"""Push alignment in a job of two (issue 46): how far above noise do honest pushes point along
each other? Measured, not modelled: a real syncer and two real learners (gpt-tiny), and for every
push the syncer judges, its direction sample's cosine (syncer/intake/direction.py's positions,
d = the sample's length) with four references a credit-by-direction rule could read:

- other: the other island's latest accepted push;
- other_sum: the sum of all the other island's accepted pushes so far;
- other_recent: the sum of its last RECENT accepted pushes;
- global: the fragment's last outer update (θ before the merge minus θ after: the direction a
  pseudo-gradient points along).

z = cos x sqrt(d): for a direction independent of the reference (noise) z ~ N(0, 1). Beside each
honest push, the noise of bench/adversary.py's faint_claims and credited_noise (a fresh sign
vector each push, seeded as there; the two differ only in scale, which a cosine does not see:
one draw stands for both) is scored against the same references at the same moment.

The syncer runs in a child of this module (`--syncer-child`): the product's syncer with two
read-only hooks (ContributionGuard.check_delta and .accepted, GlobalModel.commit_merge) that
record the cosines to a JSON-lines file; nothing it decides changes.

Cases (the job of tests/e2e/test_island_rounds.py, a cosine over 40 outer steps of H = 12, with a
warm-up of 2 rounds added): speeds 1:1 and 1:3 (inner.stepsPerIsland auto), K = M (quorum 2) and
K = 1 (quorum 1).

    python -m bench.studies.push_alignment
    python -m bench.studies.push_alignment --cases 1:3/K=1 --no-record
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.models.parts import MIN_LR_RATIO, inner_lr

from bench.harness.common import LoadMonitor, Report, Table, base_parser, publish, workdir
from bench.harness.ours_harness import HookedRun

H = 12
OUTER_STEPS = 40
WARMUP = 2 * H
RECENT = 4  # other_recent: the other island's last RECENT accepted pushes
REFS = ("other", "other_sum", "other_recent", "global", "best", "best+")
# name -> (slowdown of island-1, quorum)
CASES: dict[str, tuple[float, int]] = {
    "1:1/K=M": (1.0, 2),
    "1:1/K=1": (1.0, 1),
    "1:3/K=1": (3.0, 1),
    "1:3/K=M": (3.0, 2),
}
HONEST_COLUMNS: tuple[str, ...] = ("case", "reference", "pushes", "n", "min z", "1st pct z")
HONEST_COLUMNS += ("median z", "min |z|", "1st pct |z|")
RECORDS_ENV = "DILOCO_STUDY_ALIGNMENT_FILE"  # where the child syncer writes its records


def job_spec(case: str, preset: str, seed: int) -> JobSpec:
    slowdown, quorum = CASES[case]
    return pair_job(preset, seed, slowdown=slowdown, quorum=quorum)


def pair_job(
    preset: str, seed: int, *, slowdown: float, quorum: int, compression: str = "none"
) -> JobSpec:
    """The study's job of two (also bench.studies.faint_naming's): a cosine over OUTER_STEPS
    outer steps of H, island-1 `slowdown` times slower (its round then sized automatically)."""
    return parse_spec(
        {
            "model": {"preset": preset, "seed": seed},
            "data": {"evalTokens": 2048, "seed": seed},
            "islands": {"count": 2},
            "inner": {
                "steps": H,
                "stepsPerIsland": "auto" if slowdown != 1.0 else "fixed",
                "batchSize": 4,
                "seqLen": 32,
                "lr": 3e-3,
                "warmupSteps": WARMUP,
            },
            "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
            "sync": {
                "quorum": quorum,
                "fragments": 2,
                "graceSeconds": "auto",
                "heartbeatTimeoutSeconds": 4,
                "compression": compression,
            },
            "stopAfter": {"outerSteps": OUTER_STEPS},
            "syncer": {"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 100},
        }
    )


# ---- the child: the product's syncer with read-only recording hooks ----


def cos(a: torch.Tensor, b: torch.Tensor | None) -> float | None:
    if b is None or a.shape != b.shape:
        return None
    na, nb = float(a.double().norm()), float(b.double().norm())
    if na == 0.0 or nb == 0.0:
        return None
    return float(a.double() @ b.double()) / (na * nb)


class Recorder:
    """The references per fragment and the records, shared by the hooked methods. It holds no
    copy of the model: per island and fragment RECENT + 2 direction samples (at most
    direction.SAMPLE values each, fp64) and one per fragment for the last update, whatever the
    model's size."""

    def __init__(self, path: Path) -> None:
        self.out = path.open("a", buffering=1)
        self.lock = threading.Lock()
        self.latest: dict[tuple[int, str], torch.Tensor] = {}
        self.total: dict[tuple[int, str], torch.Tensor] = {}
        self.recent: dict[tuple[int, str], deque[torch.Tensor]] = {}
        self.steps: dict[tuple[int, str], int] = {}  # accepted claimed steps so far
        self.update: dict[int, torch.Tensor] = {}
        self.noise = torch.Generator().manual_seed(1)  # as bench/adversary.py's faint_claims

    def refs(self, fragment: int, island: str) -> dict[str, torch.Tensor | None]:
        other = next((i for f, i in self.latest if f == fragment and i != island), None)
        key = (fragment, other or "")
        recent = self.recent.get(key)
        return {
            "other": self.latest.get(key),
            "other_sum": self.total.get(key),
            "other_recent": torch.stack(list(recent)).sum(0) if recent else None,
            "global": self.update.get(fragment),
        }

    def judged(self, fragment: int, island: str, sample: torch.Tensor, steps: int) -> dict:
        with self.lock:
            refs = self.refs(fragment, island)
            noise = torch.sign(torch.randn(sample.shape, generator=self.noise))
            return {
                "t": time.time(),
                "fragment": fragment,
                "island": island,
                "steps": steps,
                "start": self.steps.get((fragment, island), 0),
                "d": int(sample.numel()),
                "cos": {k: cos(sample, r) for k, r in refs.items()},
                "noise": {k: cos(noise, r) for k, r in refs.items()},
            }

    def accepted(self, fragment: int, island: str, sample: torch.Tensor, steps: int) -> None:
        with self.lock:
            key = (fragment, island)
            s = sample.double()
            self.latest[key] = s
            self.total[key] = self.total[key] + s if key in self.total else s.clone()
            self.recent.setdefault(key, deque(maxlen=RECENT)).append(s)
            self.steps[key] = self.steps.get(key, 0) + steps

    def merged(self, fragment: int, before: torch.Tensor, after: torch.Tensor) -> None:
        with self.lock:
            self.update[fragment] = (before - after).double()

    def write(self, record: dict) -> None:
        with self.lock:
            self.out.write(json.dumps(record) + "\n")


def install_hooks(rec: Recorder) -> None:
    from diloco_trainer.syncer.intake.direction import direction_sample
    from diloco_trainer.syncer.intake.guards import ContributionGuard
    from diloco_trainer.syncer.merging.global_model import GlobalModel

    check_delta, accepted = ContributionGuard.check_delta, ContributionGuard.accepted
    commit = GlobalModel.commit_merge

    def hooked_check(self: Any, fragment: int, island: str, stats: Any, steps: int = 0) -> None:
        record = None if stats.sample is None else rec.judged(fragment, island, stats.sample, steps)
        try:
            check_delta(self, fragment, island, stats, steps)
        except Exception as err:
            if record is not None:
                rec.write(record | {"refused": getattr(err, "code", type(err).__name__)})
            raise
        if record is not None:
            rec.write(record | {"refused": None})

    def hooked_accepted(self: Any, fragment: int, island: str, stats: Any, steps: int = 0) -> None:
        accepted(self, fragment, island, stats, steps)
        if stats.sample is not None:
            rec.accepted(fragment, island, stats.sample, steps)

    def hooked_commit(self: Any, f: int, prepared: Any, *, new_version: int) -> Any:
        def sample() -> torch.Tensor:
            return direction_sample({n: self.weights[n] for n in self.fragments[f]}).clone()

        before = sample()
        result = commit(self, f, prepared, new_version=new_version)
        rec.merged(f, before, sample())
        return result

    ContributionGuard.check_delta = hooked_check  # type: ignore[method-assign]
    ContributionGuard.accepted = hooked_accepted  # type: ignore[method-assign]
    GlobalModel.commit_merge = hooked_commit  # type: ignore[method-assign]


def child() -> int:
    from diloco_trainer.syncer.service import main as syncer_main

    install_hooks(Recorder(Path(os.environ[RECORDS_ENV])))
    return syncer_main(argparse.Namespace())


# ---- the parent: one job per case ----


def run_case(case: str, args: argparse.Namespace, base: Path) -> tuple[list[dict], str]:
    """The case's records and the load during its job (a finished case in --workdir is
    reused)."""
    where = base / case.replace("/", "_").replace(":", "-").replace("=", "")
    records, done = where / "records.jsonl", where / "done"
    if records.exists() and done.exists():
        return read(records), done.read_text()
    records.unlink(missing_ok=True)
    spec = job_spec(case, args.preset, args.seed)
    run = HookedRun(
        spec,
        where,
        slowdowns={1: CASES[case][0]},
        records=records,
        module="bench.studies.push_alignment",
        records_env=RECORDS_ENV,
    )
    with LoadMonitor() as load:
        try:
            run.start()
            run.wait_finished(timeout=args.timeout)
        finally:
            run.stop()
    done.write_text(f"{time.strftime('%H:%M', time.gmtime(load.started))} UTC, {load.describe()}")
    return read(records), done.read_text()


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def phase(spec: JobSpec, record: dict) -> str:
    """The judged push's place in the lr schedule (its island's accepted claims so far)."""
    start, steps = record["start"], max(1, record["steps"])
    if start + steps <= spec.inner.warmup_steps:
        return "warm-up"
    lr = inner_lr(spec, start + steps // 2)
    return "min lr" if lr <= 1.05 * MIN_LR_RATIO * spec.inner.lr else "decay"


def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.floor(q * (len(s) - 1))))]


def zs(records: Sequence[dict], key: str, ref: str) -> list[float]:
    """z of each record against `ref` ("best": the reference of largest |z|, signed; "best+":
    the largest z), where there is one."""
    out = []
    for r in records:
        known = {k: v * math.sqrt(r["d"]) for k, v in r[key].items() if v is not None}
        if ref == "best" and known:
            out.append(max(known.values(), key=abs))
        elif ref == "best+" and known:
            out.append(max(known.values()))
        elif ref in known:
            out.append(known[ref])
    return out


def summary_rows(case: str, spec: JobSpec, records: Sequence[dict], add: Callable) -> None:
    judged = [r for r in records if r["refused"] is None]
    groups: dict[str, list[dict]] = {"all": judged}
    for r in judged:
        groups.setdefault(phase(spec, r), []).append(r)
        groups.setdefault(f"{r['island']} f{r['fragment']}", []).append(r)
    for ref in REFS:
        for name in sorted(groups, key=lambda g: (g != "all", g)):
            z = zs(groups[name], "cos", ref)
            if not z:
                continue
            a = [abs(x) for x in z]
            add(case, ref, name, len(z), f"{min(z):.1f}", f"{quantile(z, 0.01):.1f}",
                f"{quantile(z, 0.5):.1f}", f"{min(a):.1f}", f"{quantile(a, 0.01):.1f}")  # fmt: skip


def noise_rows(cases: dict[str, list[dict]], add: Callable) -> None:
    for ref in REFS:
        z = [x for recs in cases.values() for x in zs(recs, "noise", ref)]
        if z:
            a = [abs(x) for x in z]
            add(ref, len(z), f"{min(z):.2f}", f"{quantile(z, 0.99):.2f}", f"{max(z):.2f}",
                f"{quantile(a, 0.99):.2f}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:] == ["--syncer-child"]:
        return child()
    p = base_parser(__doc__ or "")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--preset", default="gpt-tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    args = p.parse_args(argv)
    honest = Table(
        "Honest pushes: z = cos x sqrt(d) against each reference (accepted pushes)",
        HONEST_COLUMNS,
    )
    noise = Table(
        "faint_claims / credited_noise (a fresh sign vector each push) against the same "
        "references, every case",
        ["reference", "n", "min z", "99th pct z", "max z", "99th pct |z|"],
    )
    out: dict[str, list[dict]] = {}
    loads: list[str] = []
    with LoadMonitor() as load, workdir(args.workdir, "push_alignment") as base:
        for case in args.cases:
            out[case], when = run_case(case, args, base)
            loads.append(f"{case}: {when}")
            summary_rows(case, job_spec(case, args.preset, args.seed), out[case], honest.add)
        noise_rows(out, noise.add)
    d = sorted({r["d"] for recs in out.values() for r in recs})
    report = Report(
        "studies/push_alignment",
        f"Honest pushes' direction against noise's in real jobs of two ({args.preset}, H = {H}, "
        f"a cosine over {OUTER_STEPS} outer steps, warm-up {WARMUP} steps; d = {d}).",
        tables=[honest, noise],
        notes=[
            "records: <workdir>/<case>/records.jsonl (one line per judged push); the 'pushes' "
            "column: every accepted push, its phase by its island's claimed steps so far, or "
            "one island's pushes to one fragment; best: the reference of largest |z| per push "
            "(signed), best+: the largest z",
            *loads,
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
