"""Which of the job's sync defaults costs quality at K = M? Each alone and all together.

On decoupled_quality's setup (gpt-tiny, M = 4, H = 30, 600 steps per island, the same inner
optimizer and data), every variant trains in one process with the product's own sync code
(bench/studies/ablation_sim.py): the blocking configuration (fp32 both ways, one fragment, no
overlap, mean merge: torchft's DiLoCo computation), each default switched on alone (int8 pushes,
int8 pulls, 2 streamed fragments, overlap τ = 5 with the steps kept, token-weighted merge), and all
of them (the job's defaults), on exactly equal tokens and free of timing noise, for several seeds.
Fragments are pushed when learner/step_plan.plan_step says: none in the job's first round since
issue 23 ("..., first-round push" is the rule before it).
`--leave-one-out` adds the defaults with one knob switched back off.

    python -m bench.studies.ablation                      # seeds 0-2 and held-out 3, 4
    python -m bench.studies.ablation --seeds 0 --only blocking defaults --no-record
"""

from __future__ import annotations

import multiprocessing
import signal
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from bench.decoupled_quality import make_spec
from bench.harness.common import LoadMonitor, Report, Table, base_parser, fmt_ratio, publish
from bench.harness.flags import INNER_OPTIMIZER, TRAINING
from bench.studies.ablation_sim import Knobs, Simulation

BLOCKING = Knobs()
DEFAULTS = Knobs(push="int8", pull="int8", fragments=2, overlap=5, merge="tokens")
ALONE: dict[str, Knobs] = {
    "int8 pushes": replace(BLOCKING, push="int8"),
    "int8 pulls": replace(BLOCKING, pull="int8"),
    "2 fragments": replace(BLOCKING, fragments=2),
    "overlap 5": replace(BLOCKING, overlap=5),
    "token merge": replace(BLOCKING, merge="tokens"),
}
# Other rules, for --only (not in the default list).
EXTRA: dict[str, Knobs] = {
    "blocking + overlap 5, overwritten": replace(BLOCKING, overlap=5, keep=False),
    "defaults, overlap overwritten": replace(DEFAULTS, keep=False),
    "blocking + overlap 5, eager": replace(BLOCKING, overlap=5, eager=True),
    "defaults, eager": replace(DEFAULTS, eager=True),
    "blocking + 2 fragments, flushed": replace(BLOCKING, fragments=2, flush=True),
    "defaults, flushed": replace(DEFAULTS, flush=True),
    "blocking + overlap 1": replace(BLOCKING, overlap=1),
    "defaults, overlap 1": replace(DEFAULTS, overlap=1),
    # Why 2 fragments cost (issue 23): the rule before it (fragment f pushed from step f·H/F on,
    # its first push f/F of a round), not staggered, split by layers.
    "blocking + 2 fragments, first-round push": replace(
        BLOCKING, fragments=2, first_round_push=True
    ),
    "defaults, first-round push": replace(DEFAULTS, first_round_push=True),
    "blocking + 2 fragments, aligned": replace(
        BLOCKING, fragments=2, aligned=True, first_round_push=True
    ),
    "blocking + 2 fragments, by layers": replace(
        BLOCKING, fragments=2, split="layers", first_round_push=True
    ),
    "defaults, by layers": replace(DEFAULTS, split="layers"),
    # sync.mergeWait nextPush (issue 21): the merge back L steps after the push; under the
    # default rule ("defaults" at any L) the islands block at τ and install it after τ steps.
    **{
        f"defaults, merge {late} steps late, nextPush": replace(
            DEFAULTS, late=late, merge_wait="nextPush"
        )
        for late in (10, 20, 29)
    },
}
LEAVE_OUT: dict[str, Knobs] = {
    "defaults, fp32 pushes": replace(DEFAULTS, push="none"),
    "defaults, fp32 pulls": replace(DEFAULTS, pull="none"),
    "defaults, 1 fragment": replace(DEFAULTS, fragments=1),
    "defaults, no overlap": replace(DEFAULTS, overlap=0),
    "defaults, mean merge": replace(DEFAULTS, merge="mean"),
}


def variants(args: Any) -> dict[str, Knobs]:
    out = {"blocking": BLOCKING, **{f"blocking + {k}": v for k, v in ALONE.items()}}
    out["defaults"] = DEFAULTS
    if args.leave_one_out:
        out.update(LEAVE_OUT)
    if args.only:
        out = {k: v for k, v in {**out, **LEAVE_OUT, **EXTRA}.items() if k in args.only}
    return out


def run_one(
    job: tuple[Any, int, str, Knobs, type[Simulation]],
) -> tuple[int, str, float, float]:
    """(seed, label, eval loss, seconds) of one variant on one seed (a worker process)."""
    args, seed, label, knobs, simulation = job
    torch.set_num_threads(1)
    t0 = time.monotonic()
    spec = make_spec(args, seed=seed, quorum=args.islands)
    loss = simulation(spec, knobs, args.islands).run(args.steps)
    return seed, label, loss, time.monotonic() - t0


def run_all(
    args: Any,
    runs: Mapping[str, Knobs] | None = None,
    simulation: type[Simulation] = Simulation,
) -> dict[str, dict[int, float]]:
    """{label: {seed: loss}} of `runs` (default: this study's variants) on `simulation`,
    `--jobs` variants at a time, seeds first in the given order (bench.studies.late_merge runs
    its own variants on its own simulation here too)."""
    runs = variants(args) if runs is None else runs
    jobs = [(args, s, label, k, simulation) for s in args.seeds for label, k in runs.items()]
    out: dict[str, dict[int, float]] = {}
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.jobs) as pool:
        for seed, label, loss, secs in pool.imap_unordered(run_one, jobs):
            out.setdefault(label, {})[seed] = loss
            print(f"seed {seed}: {label}: {loss:.4f} ({secs:.0f}s)", flush=True)
    return out


def spread(values: Sequence[float]) -> str:
    """mean ± half-range."""
    return f"{statistics.mean(values):.4f} ± {(max(values) - min(values)) / 2:.4f}"


def table(args: Any, results: dict[str, dict[int, float]]) -> Table:
    seeds = args.seeds
    held = set(args.held_out)
    names = [f"{s}{' (held out)' if s in held else ''}" for s in seeds]
    t = Table(
        f"Eval loss after exactly {args.steps} steps per island, K = M = {args.islands}, "
        f"H = {args.inner_steps}, {args.preset} (in-process, the product's sync code; seeds "
        f"{', '.join(names)})",
        [
            "variant",
            "loss per seed",
            "mean ± half-range",
            "/ blocking (mean)",
            "/ blocking per seed",
        ],
    )
    ref = results.get("blocking", {})
    for label in variants(args):
        per = results.get(label, {})
        got = [s for s in seeds if s in per]
        if not got:
            continue
        losses = [per[s] for s in got]
        ratios = [per[s] / ref[s] for s in got if s in ref]
        mean_ratio = (
            statistics.mean(losses) / statistics.mean([ref[s] for s in got])
            if len(ratios) == len(got)
            else float("nan")
        )
        t.add(
            label,
            "; ".join(f"{v:.4f}" for v in losses),
            spread(losses),
            fmt_ratio(mean_ratio, 4),
            "; ".join(fmt_ratio(r, 4) for r in ratios) or "—",
        )
    return t


def parse_args(argv: Sequence[str] | None) -> Any:
    p = base_parser(
        __doc__ or "",
        **TRAINING,
        **INNER_OPTIMIZER,
        islands=4,
        inner_steps=30,
        steps=600,
        eval_tokens=8192,
        seeds=[0, 1, 2, 3, 4],
    )
    p.add_argument("--held-out", type=int, nargs="*", default=[3, 4], help="seeds marked held out")
    p.add_argument("--leave-one-out", action="store_true", help="also the defaults minus each knob")
    p.add_argument("--only", nargs="+", default=[], help="only these variants (exact labels)")
    p.add_argument("--jobs", type=int, default=2, help="variants trained at a time (processes)")
    return p.parse_args(argv)


def _exit_on_term(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # leaves the pool's `with`, which terminates its workers


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_term)
    with LoadMonitor() as load:
        results = run_all(args)
    report = Report(
        "ablation",
        "Each sync default alone and all together against the blocking configuration, at K = M "
        "on exactly equal tokens (one process, the product's sync code).",
        tables=[table(args, results)],
        notes=[
            "Blocking: fp32 pushes and pulls, 1 fragment, no overlap, mean merge (the computation "
            "of torchft's DiLoCo in bench/decoupled_quality). Defaults: int8 pushes and pulls, "
            "2 fragments, overlap 5 with the steps kept, token merge (error feedback off, the "
            "job's default). Fragments sync when learner/step_plan.plan_step says: none before "
            "step H in the job (issue 23); 'first-round push' variants use the rule before it.",
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
