"""Decoupled quality: does a small quorum keep the quality of K = M, and beat a straggler?

One model, data and token budget (M islands x S inner steps x batch x seqLen tokens), trained by:
- synchronous data-parallel over M simulated workers in one process (the baseline,
  diloco_trainer.models.reference.train_synchronous);
- ours (a syncer + M learner processes, the job's defaults for everything but the quorum) with
  K = M, K = M/2 and K = 1, on identical islands and with island M-1 made 3x slower;
- torchft 0.2.0's DiLoCo at K = M (every replica group in every sync), identical and with the
  same straggler: the peer.
Every variant runs with two seeds (model init and data order), stopping at the token budget
(ours: stopAfter.tokens; torchft: S/H commits). The runs with the straggler may go on past it
(--past-budget, default 1.5x), so that the wall time at which each first reaches K = M's
no-straggler loss is measured rather than cut off at the budget: ours stops at the first status
past the budget once an evaluation reached that loss (else at the limit), torchft runs
ceil(limit x S/H) commits. Every equal-token figure is still read at the budget.

Reported: eval loss at equal tokens processed (interpolated at the budget; tokens processed are
read from the learners' own progress lines), loss at equal wall time, wall time to reach the
K = M no-straggler loss, bytes per worker pushed and pulled (DDP's per-step ring all-reduce of
the gradients as the reference), the other islands' throughput with the straggler, and a plot of
eval loss against tokens and against wall time for every variant (bench/plots/).

    python -m bench.decoupled_quality                  # M=4, H=30, 600 steps/island, 2 seeds
    python -m bench.decoupled_quality --quick --no-record   # a smoke run (M=2, H=8, 1 seed)
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.models.parts import build_parts, evaluate
from diloco_trainer.models.reference import train_synchronous

from bench.harness.common import (
    LoadMonitor,
    Report,
    base_parser,
    install_signal_cleanup,
    plot_file,
    publish,
    wait_all,
    workdir,
)
from bench.harness.decoupled_quality_report import interp, loss_at_tokens, plot, tables
from bench.harness.flags import INNER_OPTIMIZER, TRAINING, inner_section
from bench.harness.ours_harness import OursRun
from bench.harness.peer_training import read_progress
from bench.harness.torchft_harness import job_of_every_replica, read_result, start_job

SLOWDOWN = 3.0
# A learner's log lines that tell its tokens processed: joining (0), its progress line every
# LOG_EVERY_STEPS steps ("tokens T"), and its last line ("after N steps").
LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+ diloco\.learner: (.*)$")
PROGRESS = re.compile(r"^step \d+ loss \S+ tokens (\d+)")
LAST = re.compile(r"^(?:the job has finished: exiting|stopping on request) after (\d+) steps")


def budget(args: Any) -> int:
    return args.islands * args.steps * args.batch_size * args.seq_len


def sync_overrides(args: Any) -> dict[str, Any]:
    """--sync KEY=VALUE pairs (spec.sync fields, camelCase; values parsed as JSON where they
    are JSON, else kept as strings), for trying a setting against the defaults."""
    out: dict[str, Any] = {}
    for item in getattr(args, "sync", None) or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--sync wants KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def make_spec(args: Any, *, seed: int, quorum: int, tokens: int | None = None) -> JobSpec:
    """The job every variant trains; sync settings are the defaults but for the quorum.
    `tokens`: its stopAfter.tokens when it may run past the budget."""
    return parse_spec(
        {
            "model": {"preset": args.preset, "seed": seed},
            "data": {"source": "builtin:stdlib-text", "evalTokens": args.eval_tokens, "seed": seed},
            "islands": {"count": args.islands},
            "inner": inner_section(args),
            "sync": {**sync_overrides(args), "quorum": quorum},
            "stopAfter": {"tokens": tokens or budget(args)},
            "syncer": {"evalEveryOuterSteps": 1, "checkpoint": {"everyOuterSteps": 100000}},
        }
    )


def island_progress(log_file: Path, step_tokens: int) -> list[tuple[float, int]]:
    """(wall time, tokens processed) from one learner's log."""
    out = []
    for line in log_file.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if not m:
            continue
        t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        msg = m.group(2)
        if msg.startswith("joined the syncer"):
            out.append((t, 0))
        elif p := PROGRESS.match(msg):
            out.append((t, int(p.group(1))))
        elif last := LAST.match(msg):
            out.append((t, int(last.group(1)) * step_tokens))
    return out


def past_budget_at_target(st: dict[str, Any], budget: int, target: float) -> bool:
    """Whether a run past the budget may stop: its latest evaluation is of weights that merged
    the budget (merged tokens never exceed those processed, so the loss at the budget lies
    between evaluations) and some evaluation reached `target`."""
    evals = st.get("evalHistory") or []
    return (
        bool(evals)
        and int(evals[-1]["tokens"]) >= budget
        and any(h["evalLoss"] <= target for h in evals)
    )


def run_ours(
    spec: JobSpec, slow: bool, wd: Path, timeout: float, *, budget: int, target: float | None
) -> dict[str, Any]:
    """One job of ours, its history as (seconds, tokens processed, loss). With `target` (a run
    past the budget: spec.stopAfter.tokens is the limit) it is stopped at the first status past
    the budget once an evaluation reached the target; bytes, merges, throughput and the wall
    to budget are read at the first status whose merged tokens reached the budget."""
    m = spec.islands.count
    run = OursRun(spec=spec, workdir=wd, slowdowns={m - 1: SLOWDOWN} if slow else {})
    run.start()
    t0 = time.time()
    polls: list[tuple[float, dict[str, Any]]] = []
    until = None if target is None else (lambda st: past_budget_at_target(st, budget, target))
    try:
        st = run.wait_finished(
            timeout=timeout, on_status=lambda st: polls.append((time.time(), st)), until=until
        )
        if st.get("finished"):
            for proc in run.learners.values():
                proc.wait(120)  # learners exit once they see finished=true
        wall = time.time() - t0
    finally:
        run.stop()
    step_tokens = spec.inner.batch_size * spec.inner.seq_len
    progress = {i: island_progress(p.log_file, step_tokens) for i, p in run.learners.items()}

    def processed(t: float) -> float:
        return sum(interp([(a, float(b)) for a, b in pts], t) for pts in progress.values())

    history = [(0.0, 0.0, float(st["initialEvalLoss"]))]
    history += [(h["time"] - t0, processed(h["time"]), h["evalLoss"]) for h in st["evalHistory"]]
    t_budget, at_budget = t0 + wall, st
    if target is not None:
        t_budget, at_budget = next((p for p in polls if int(p[1]["tokens"]) >= budget), polls[-1])
    progress_to_budget = {i: [x for x in pts if x[0] <= t_budget] for i, pts in progress.items()}
    return {
        "history": history,
        "wall": t_budget - t0,
        "ran_wall": wall,
        # At the last status: a learner stopped on request may finish a step on its way out.
        "ran_tokens": processed(t0 + wall),
        "extended": target is not None,
        "push": float(at_budget["bytesIn"]) / m,
        "pull": float(at_budget["bytesOut"]) / m,
        "merges": int(at_budget.get("mergeCount", 0)),
        "outer_steps": int(at_budget["outerStep"]),
        "rates": {i: island_rate(pts) for i, pts in progress_to_budget.items()},
    }


def island_rate(points: Sequence[tuple[float, int]]) -> float:
    """Tokens/s from the first progress line (start-up excluded) to the island's last line."""
    lines = list(points[1:])
    if len(lines) < 2 or lines[-1][0] <= lines[0][0]:
        return float("nan")
    return (lines[-1][1] - lines[0][1]) / (lines[-1][0] - lines[0][0])


def run_torchft(
    args: Any,
    spec: JobSpec,
    slow: bool,
    wd: Path,
    extend: bool,
    *,
    sync_delay: int = 0,
    prefix: Sequence[str] = (),
) -> dict[str, Any]:
    """torchft DiLoCo at K = M for S / H commits (ceil(--past-budget x S / H) with `extend`);
    its history from the saved global weights. Past the budget, bytes and merges are those of
    the S / H commits of the budget and the wall to budget is the time of commit S / H.
    `sync_delay`: its fragment_sync_delay; `prefix`: the command prefix every process of the
    job runs under (bench/busy_link: a shaped network namespace). The result also holds the job
    (its progress files) and every replica's result file, for utilisation and bytes."""
    m = spec.islands.count
    rounds = args.steps // args.inner_steps
    run_rounds = math.ceil(args.past_budget * rounds) if extend else rounds
    job = job_of_every_replica(
        spec,
        wd,
        m,
        outer_steps=run_rounds,
        slowdowns={m - 1: SLOWDOWN} if slow else {},
        sync_delay=sync_delay,
        prefix=prefix,
    )
    t0 = time.time()
    lighthouse, replicas = start_job(job, evaluate_replica=None, save_replica=0)
    try:
        wait_all(replicas, timeout=args.timeout)
    finally:
        lighthouse.kill()
    wall = time.time() - t0
    results = [read_result(job, i) for i in range(m)]
    per_round = m * args.inner_steps * args.batch_size * args.seq_len
    parts = build_parts(spec, shard_index=0, num_shards=1, with_train=False)
    history = [(0.0, 0.0, evaluate(parts))]
    from safetensors.torch import load_model

    directory = job.save_dir(0)
    t_budget = t0 + wall
    for line in (directory / "index.jsonl").read_text().splitlines():
        entry = json.loads(line)
        load_model(parts.model, str(directory / entry["file"]))
        history.append((entry["time"] - t0, entry["outer_step"] * per_round, evaluate(parts)))
        if extend and entry["outer_step"] == rounds:
            t_budget = entry["time"]
    done = int(results[0]["outer_steps"])
    # Every commit all-reduces the same payload: the budget's share of what was sent.
    sent = sum(float(r["bytes_per_worker"]) for r in results) / m * min(1.0, rounds / max(done, 1))
    progress = {
        i: [
            (float(rec["time"]), int(rec["tokens"]))
            for rec in read_progress(job.progress_file(i))
            if float(rec["time"]) <= t_budget
        ]
        for i in range(m)
    }
    return {
        "history": history,
        "wall": t_budget - t0,
        "ran_wall": wall,
        "ran_tokens": done * per_round,
        "extended": extend,
        "push": sent,
        "pull": sent,  # a ring all-reduce receives what it sends
        "merges": min(done, rounds),
        "outer_steps": min(done, rounds),
        "rates": {i: island_rate(pts) for i, pts in progress.items()},
        "job": job,
        "results": results,
    }


def run_baseline(spec: JobSpec, args: Any) -> dict[str, Any]:
    torch.set_num_threads(1)  # as every process of the other variants
    t0 = time.perf_counter()
    ref = train_synchronous(spec, num_workers=args.islands, total_steps=args.steps)
    wall = time.perf_counter() - t0
    # As DDP would move it: one ring all-reduce of the fp32 gradients per step, sending and
    # receiving 2(M-1)/M of them per worker.
    ddp = float(ref["bytes_per_worker"])
    return {
        "history": [(0.0, 0.0, ref["initial_eval_loss"]), (wall, ref["tokens"], ref["eval_loss"])],
        "wall": wall,
        "ran_wall": wall,
        "ran_tokens": ref["tokens"],
        "extended": False,
        "push": ddp,
        "pull": ddp,
        "merges": 0,
        "outer_steps": 0,
        "rates": {},
    }


def variants(args: Any) -> list[tuple[str, str, int, bool]]:
    """(label, system, quorum, straggler) for every variant, in run order."""
    m = args.islands
    quorums = sorted({m, max(1, m // 2), 1}, reverse=True)
    out = [("sync DP (baseline)", "baseline", m, False)]
    for slow in (False, True) if not args.no_straggler else (False,):
        tag = f", island {m - 1} {SLOWDOWN:g}x slower" if slow else ""
        out += [(f"ours K={k}{tag}", "ours", k, slow) for k in quorums]
        if not args.skip_torchft:
            out.append((f"torchft K={m}{tag}", "torchft", m, slow))
    if args.only:
        out = [v for v in out if v[1] == "baseline" or any(o in v[0] for o in args.only)]
    if args.skip_baseline:
        out = [v for v in out if v[1] != "baseline"]
    return out


def run_all(args: Any, wd: Path) -> dict[str, list[dict[str, Any]]]:
    """Every variant for every seed: {label: [result per seed]}."""
    results: dict[str, list[dict[str, Any]]] = {}
    km = f"ours K={args.islands}"
    for seed in args.seeds:
        for label, system, quorum, slow in variants(args):
            # The straggler group runs past the budget; ours stops once it reached the loss of
            # K = M without the straggler at the budget (run earlier in the same seed).
            extend = slow and args.past_budget > 1
            target = None
            if extend and system == "ours":
                target = next(
                    (
                        loss_at_tokens(r, budget(args))
                        for r in results.get(km, [])
                        if r["seed"] == seed
                    ),
                    -math.inf,  # no K = M run (--only): to the limit
                )
            limit = math.ceil(args.past_budget * budget(args)) if extend else None
            spec = make_spec(args, seed=seed, quorum=quorum, tokens=limit)
            print(f"seed {seed}: {label}", flush=True)
            sub = wd / f"seed{seed}-{system}-k{quorum}-{'slow' if slow else 'even'}"
            if system == "baseline":
                r = run_baseline(spec, args)
            elif system == "torchft":
                r = run_torchft(args, spec, slow, sub, extend)
            else:
                r = run_ours(spec, slow, sub, args.timeout, budget=budget(args), target=target)
            r["seed"] = seed
            results.setdefault(label, []).append(r)
            print(
                f"  -> {loss_at_tokens(r, budget(args)):.4f} at the budget, {r['wall']:.0f}s to "
                f"it, {r['merges']} merges; ran {r['ran_tokens'] / budget(args):.2f}x the "
                f"budget in {r['ran_wall']:.0f}s, last loss {r['history'][-1][2]:.4f}",
                flush=True,
            )
    return results


def parse_args(argv: Sequence[str] | None) -> Any:
    p = base_parser(
        __doc__ or "",
        **TRAINING,
        **INNER_OPTIMIZER,
        islands=4,
        inner_steps=30,
        steps=600,
        eval_tokens=8192,
        seeds=[0, 1],
        timeout=1800,
        skip_torchft=False,
    )
    p.add_argument(
        "--past-budget",
        type=float,
        default=1.5,
        help="the runs with the straggler may train up to this multiple of the token budget, to "
        "measure when they reach K=M's no-straggler loss (ours stops once past the budget and "
        "at that loss; 1 = stop at the budget); equal-token figures are read at the budget",
    )
    p.add_argument(
        "--no-straggler",
        action="store_true",
        help="only the identical-island variants (e.g. more seeds for the equal-token figures)",
    )
    p.add_argument(
        "--sync",
        action="append",
        metavar="KEY=VALUE",
        help="a spec.sync setting for every variant of ours instead of its default (repeatable), "
        "e.g. --sync compression=int8; the recorded command shows it",
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=[],
        help="run only variants whose label contains one of these (e.g. 'K=1' 'K=4'; the "
        "baseline always runs); for focused --no-record checks",
    )
    p.add_argument(
        "--skip-baseline",
        action="store_true",
        help="leave synchronous data-parallel out (it is deterministic for a seed: for reruns "
        "that compare ours with itself; no ratio to it and no bytes against DDP then)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: M=2, H=8, 32 steps, 1 seed")
    args = p.parse_args(argv)
    if args.quick:
        args.islands, args.inner_steps, args.steps, args.seeds = 2, 8, 32, [0]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    install_signal_cleanup()
    with LoadMonitor() as load, workdir(args.workdir, "decoupled-quality") as wd:
        results = run_all(args, wd)
    plot_path = plot_file(args, "decoupled_quality")
    plot(results, plot_path, budget(args))
    report_tables, notes = tables(args, results, budget(args), SLOWDOWN)
    report = Report(
        "decoupled_quality",
        "Eval loss at equal tokens and equal wall time, bytes per worker, and a 3x straggler: "
        "synchronous data-parallel (baseline), ours at K = M, M/2 and 1, torchft DiLoCo at K = M.",
        tables=report_tables,
        notes=notes,
        plots=[plot_path],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
