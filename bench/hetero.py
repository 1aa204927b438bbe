"""Islands of different speeds in one job (issue 47): each island's round sized to its speed
(inner.stepsPerIsland auto) against the same job with a fixed H, with equal speeds, and against
the fast islands alone.

Every run trains gpt-tiny to a token budget; the slow islands are slowed by DILOCO_SLOWDOWN (the
learner sleeps (factor - 1) x its compute after each step). Baselines measured in the same run:
- the equal-speed job at K = M (fixed H): its final eval loss is the target, its islands'
  utilisation the reference;
- the fast islands alone (M - slow islands, K = M): how fast the target is reached without the
  slow ones.
The mixed-speed runs get 1.5x the budget so that they can reach the target. Figures:
- wall time to the target loss (from the start of the processes; the first evaluation at or
  below it, interpolated between evaluations), against the fast islands alone;
- eval loss at the equal-speed run's token budget (interpolated over merged tokens);
- each island's utilisation (inner steps x its step time / wall time, from the first merge
  until 80% of the budget is merged), the fast islands' against the equal-speed run's;
- each island's share of merged tokens against its share of compute (1/factor over the sum).

    python -m bench.hetero                                   # M = 4: speeds 1,1,1,3 and 1,1,2,4
    python -m bench.hetero --mixes 1,1,1,3 --quorums 4       # one mix, K = M only
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco_trainer.api.contract import island_name
from diloco_trainer.api.spec import JobSpec, parse_spec

from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_pct,
    fmt_ratio,
    install_signal_cleanup,
    publish,
    ratio,
    verdict,
    workdir,
)
from bench.harness.flags import TRAINING
from bench.harness.measure import StatusSampler, ours_islands
from bench.harness.merge_waits import run_waits
from bench.harness.ours_harness import OursRun

# The mixed-speed runs' budget against the equal-speed run's: room to reach its final loss.
EXTRA_BUDGET = 1.5


def make_spec(args: Any, *, islands: int, quorum: int, mode: str, tokens: int) -> JobSpec:
    return parse_spec(
        {
            "model": {"preset": args.preset, "seed": args.seed},
            "data": {"evalTokens": args.eval_tokens},
            "islands": {"count": islands},
            "inner": {
                "lr": 3e-3,
                "warmupSteps": 10,
                "steps": args.inner_steps,
                "stepsPerIsland": mode,
                "batchSize": args.batch_size,
                "seqLen": args.seq_len,
            },
            # heartbeats every second (timeout / 4): the syncer reads step times from them
            "sync": {"quorum": quorum, "compression": "none", "heartbeatTimeoutSeconds": 4},
            "syncer": {"evalEveryOuterSteps": 1, "checkpoint": {"everyOuterSteps": 1000}},
            "stopAfter": {"tokens": tokens},
        }
    )


def run_one(args: Any, spec: JobSpec, speeds: list[float], wd: Path) -> dict[str, Any]:
    """One job to its finish; its eval history, utilisations and merged tokens per island."""
    slowdowns = {i: f for i, f in enumerate(speeds) if f > 1}
    run = OursRun(spec=spec, workdir=wd, slowdowns=slowdowns)
    budget = spec.stop_after.tokens or 0
    started = time.time()
    try:
        run.start()
        with StatusSampler(run) as sampler:
            sampler.wait_first_merge(args.timeout)
            t1 = time.time()
            t2: list[float] = []

            def near_end(st: dict[str, Any]) -> bool:
                if not t2 and int(st.get("tokens") or 0) >= 0.8 * budget:
                    t2.append(time.time())
                return False

            final = run.wait_finished(args.timeout, on_status=near_end)
        end = t2[0] if t2 else time.time()
    finally:
        run.stop()
    windows = ours_islands(sampler, t1, end)
    names = [island_name(spec.islands.name_prefix, i) for i in range(len(speeds))]
    waits = run_waits(wd, names) if spec.sync.quorum >= len(speeds) else None
    islands = final.get("islands", {})
    merged = {n: float(islands.get(n, {}).get("mergedTokens") or 0) for n in names}
    return {
        "started": started,
        "evals": [e for e in final.get("evalHistory", []) if e.get("evalLoss") is not None],
        "utilisation": {n: windows[n].utilisation if n in windows else 0.0 for n in names},
        "merged": merged,
        "inner_steps": {n: islands.get(n, {}).get("innerSteps") for n in names},
        "final_loss": float(final["evalLoss"]),
        "waits": waits,
    }


def time_to(evals: Sequence[dict[str, Any]], target: float, started: float) -> float | None:
    """Seconds from `started` to the first evaluation at or below `target`, interpolated
    linearly in time from the one before; None when never reached."""
    prev = None
    for e in evals:
        loss, t = float(e["evalLoss"]), float(e["time"])
        if loss <= target:
            if prev is None or prev[0] == loss:
                return t - started
            frac = (prev[0] - target) / (prev[0] - loss)
            return prev[1] + frac * (t - prev[1]) - started
        prev = (loss, t)
    return None


def loss_at(evals: Sequence[dict[str, Any]], tokens: float) -> float:
    """Eval loss at `tokens` merged tokens, linear between the evaluations around it."""
    points = sorted((float(e["tokens"]), float(e["evalLoss"])) for e in evals)
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= tokens <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    return float("nan")


def parse_mix(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(__doc__ or "", **TRAINING, inner_steps=20, eval_tokens=4096, timeout=900)
    p.add_argument("--mixes", nargs="+", default=["1,1,1,3", "1,1,2,4"], help="slowdowns")
    p.add_argument("--quorums", nargs="+", type=int, default=[4, 1], help="K of the mixes")
    p.add_argument("--rounds", type=int, default=10, help="equal-speed budget in rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fixed", action="store_true", help="leave the fixed-H mixes out")
    args = p.parse_args(argv)
    install_signal_cleanup()
    mixes = [parse_mix(m) for m in args.mixes]
    m = len(mixes[0])
    step_tokens = args.batch_size * args.seq_len
    budget = args.rounds * m * args.inner_steps * step_tokens
    extra = int(budget * EXTRA_BUDGET)
    runs: dict[str, tuple[list[float], JobSpec]] = {
        f"equal speeds, K={m}": (
            [1.0] * m,
            make_spec(args, islands=m, quorum=m, mode="fixed", tokens=budget),
        ),
    }
    fast = min(sum(1 for f in mix if f == 1.0) for mix in mixes)
    runs[f"{fast} fast islands alone, K={fast}"] = (
        [1.0] * fast,
        make_spec(args, islands=fast, quorum=fast, mode="fixed", tokens=extra),
    )
    for mix in mixes:
        label = ",".join(f"{f:g}" for f in mix)
        for k in args.quorums:
            for mode in ("auto",) if args.no_fixed else ("auto", "fixed"):
                if mode == "fixed" and k != m:
                    continue  # today's behaviour: at K = M only
                runs[f"{label} {mode}, K={k}"] = (
                    mix,
                    make_spec(args, islands=m, quorum=k, mode=mode, tokens=extra),
                )
    results: dict[str, dict[str, Any]] = {}
    with LoadMonitor() as load, workdir(args.workdir, "hetero") as wd:
        for n, (name, (speeds, spec)) in enumerate(runs.items()):
            print(f"{name}", flush=True)
            results[name] = run_one(args, spec, speeds, wd / f"run-{n}")
            print(
                f"  -> final {results[name]['final_loss']:.4f}, H_i {results[name]['inner_steps']}",
                flush=True,
            )
    return report(args, runs, results, budget, load)


def report(
    args: Any,
    runs: dict[str, tuple[list[float], JobSpec]],
    results: dict[str, dict[str, Any]],
    budget: int,
    load: LoadMonitor,
) -> int:
    names = list(runs)
    base, alone = results[names[0]], results[names[1]]
    target = base["final_loss"]
    alone_time = time_to(alone["evals"], target, alone["started"])
    base_util = sum(base["utilisation"].values()) / len(base["utilisation"])
    table = Table(
        f"Mixed speeds ({args.preset}, H={args.inner_steps}, budget {budget} tokens = "
        f"{args.rounds} rounds of the equal-speed job, mixes {EXTRA_BUDGET:g}x; target "
        f"{target:.4f})",
        [
            "run",
            "H_i",
            "time to target",
            "vs fast alone",
            f"loss at {budget} tokens",
            "vs equal",
            "fast islands' utilisation vs equal",
            "utilisation per island",
            "merged-token share / compute share per island",
            "K = M merges' waits for each island alone",
        ],
    )
    targets = Table("Targets (issue 47)", ["target", "figure", "verdict"])
    for name in names:
        speeds, _ = runs[name]
        r = results[name]
        islands = list(r["utilisation"])
        t = time_to(r["evals"], target, r["started"])
        fast_util = [r["utilisation"][n] for n, f in zip(islands, speeds, strict=True) if f == 1]
        kept = ratio(sum(fast_util) / max(1, len(fast_util)), base_util)
        compute = [1 / f for f in speeds]
        total_merged = sum(r["merged"].values()) or 1.0
        shares = [
            ratio(r["merged"][n] / total_merged, c / sum(compute))
            for n, c in zip(islands, compute, strict=True)
        ]
        loss = loss_at(r["evals"], budget)
        table.add(
            name,
            " ".join(str(r["inner_steps"][n] or "-") for n in islands),
            "not reached" if t is None else f"{t:.1f}s",
            "n/a" if t is None or alone_time is None else fmt_ratio(t / alone_time),
            f"{loss:.4f}",
            fmt_ratio(ratio(loss, target), 4),
            fmt_ratio(kept),
            " ".join(fmt_pct(r["utilisation"][n]) for n in islands),
            " ".join(fmt_ratio(s, 2) for s in shares),
            "-" if r["waits"] is None else " ".join(f"{r['waits'][n]:.2f}s" for n in islands),
        )
        if " auto, " in name:
            reached = t is not None and alone_time is not None and t <= alone_time
            targets.add(
                f"{name}: fast islands keep >= 97% of equal-speed utilisation",
                fmt_ratio(kept),
                verdict(kept >= 0.97),
            )
            targets.add(
                f"{name}: target loss no later than the fast islands alone",
                "n/a" if t is None or alone_time is None else fmt_ratio(t / alone_time),
                verdict(reached),
            )
            targets.add(
                f"{name}: loss at equal tokens within 1% (one seed)",
                fmt_ratio(ratio(loss, target), 4),
                verdict(abs(ratio(loss, target) - 1) <= 0.01),
            )
            worst = max(abs(s - 1) for s in shares)
            targets.add(
                f"{name}: each island's merged-token share within 10% of its compute share",
                f"worst {worst:.1%}",
                verdict(worst <= 0.10),
            )
    notes = [
        "Slow islands sleep (factor - 1) x their compute after each step; on a machine with "
        "fewer cores than processes a sleeping island frees CPU for the others, so the fast "
        "islands' utilisation is the figure judged (it counts only time lost waiting).",
        "Time to target counts from the processes' start (start-up is the same in every run).",
        "The equal-tokens loss of the mixes is at the equal-speed run's budget of merged tokens.",
        "K = M merges' waits: per island, the seconds between the second-last push of a merge "
        "and its own when it pushed last, summed over the run's merges but the first "
        "(bench/harness/merge_waits.py, from the learners' logs): whose rounds the others "
        "waited for.",
    ]
    rep = Report(
        "hetero",
        "Islands of different speeds (issue 47): rounds sized per island (stepsPerIsland auto) "
        "against a fixed H, equal speeds and the fast islands alone.",
        tables=[table, targets],
        notes=notes,
    )
    return publish(rep, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
