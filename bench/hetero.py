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
- each island's utilisation (its inner steps over the steps its measured speed could take,
  from the first merge until 80% of the budget is merged; the steps from the tokens it reports
  consumed, so that fill steps, which move no schedule position, count), the fast islands'
  against the equal-speed run's;
- each island's share of merged tokens against its share of compute, read from its measured
  speed in the same run (the time-mean of 1 / its reported step time t_i, measure.rate_of;
  shares (1 / t_i) / sum_j (1 / t_j): an emulated 3x island runs slower than 3x on a shared
  machine, bench/harness/hetero_figures.py);
- each island's H_i moves (the syncer's log: how often its round changed).
--repeats N runs the equal-speed baseline and the mixed runs N times, interleaved, and judges the
fast islands' utilisation against the baselines' mean with its 95% interval (and the time to
target against the mean of the fast islands alone, run each repeat too).

torchft 0.2.0's DiLoCo on the same work, after ours' runs (skipped with --skip-torchft, or where
torchft is not installed, the reason printed): the same preset, seed, M, H and slowdowns (its
workers sleep by the same rule), at K = M (min_replicas = M: every replica group in every sync,
as bench/busy_link runs it), equal speeds and each mix, each for 1.5x the budget's rounds (room
to reach the target), once per repeat. Its figures: time to ours' target loss, loss at equal
tokens against its own equal-speed run and against ours', and each replica's utilisation
(compute seconds / wall), the fast replicas' against its equal-speed run's.

    python -m bench.hetero                                   # M = 4: speeds 1,1,1,3 and 1,1,2,4
    python -m bench.hetero --mixes 1,1,1,3 --quorums 4       # one mix, K = M only
    python -m bench.hetero --mixes 1,1,1,3 --no-fixed --repeats 3   # judged against 3 baselines
    python -m bench.hetero --mixes 1,1,1,3 --quorums 4 --no-fixed --skip-torchft   # ours alone
    python -m bench.hetero --no-fixed --repeats 3 --emulate-step-ms 50   # separate hardware
    python -m bench.hetero --no-fixed --repeats 3 --pace-step-ms 200 --skip-torchft  # trained

--emulate-step-ms T: every island's inner step is an emulated accelerator's
(learner/emulated_step.py, DILOCO_EMULATE_STEP_SECONDS) of T x its speed factor (a 3x island
3T), mostly asleep, instead of real training slowed by DILOCO_SLOWDOWN. On a host with fewer
cores than processes the real runs' islands take their compute from the same cores (a slow
island's compute, a fill step's, a start-up's slow the fast islands too); emulated, each
island's step time is exact and independent of the others' load, as on separate hardware, while
the sync path (push, the syncer's merge, pull, apply) stays real. What it measures: the fast
islands' utilisation against the equal-speed job (emulated at T too), the K = M merges' waits,
each island's H_i (inner.stepsPerIsland auto still reads the speeds from the reported step
times) and merged-token share against its compute share. What it cannot: an emulated step does
not train (it scales a slice of the weights and reports a constant loss), so time to target and
loss at equal tokens are printed as n/a, the fast islands alone (whose only figure is the time
to target) and torchft's runs are left out. T = 50 ms is a real gpt-tiny step on this host's
kind of CPU (a round of 30 steps took 1.575 s at load 2, bench/RESULTS.md "busy_link", link13),
so the sync path's share of a round stays what it is in the real runs.

--pace-step-ms P: every island trains for real, and each inner step is padded with sleep to P x
its speed factor (DILOCO_PACE_STEP_SECONDS, learner/loop.step_sleep): the step times of
separate hardware, as emulated, with the model trained, so time to target and loss at equal
tokens are measured too and the fast islands alone run. Without it, on a host with fewer cores
than processes, a 3x island's compute (a third of a fast one's a second) and its fill steps take
CPU from the fast islands, and the fast islands alone run one process fewer on the same cores:
time to target against them is partly a count of processes. P must exceed a step's compute
under the run's load (the report counts each island's steps that went over, its learner's exit
line); torchft's runs are left out (its workers are not paced).

A CPU island beside emulated accelerators (issue 47): with --emulate-step-ms, a mix's entry
`cpu` (e.g. `--mixes 1,cpu`) is an island that really trains the model on this machine's CPU
(one intra-op thread, as every learner here) while the others are emulated at T: its speed
factor is not set but read from its own measured step time in the same run (the step-time
column), so its compute share, and its H_i with stepsPerIsland auto, come from what it really
did. Figures: the fast islands' utilisation against the equal-speed emulated job, and the CPU
island's merged-token share against its measured compute share. Loss stays n/a: the emulated
islands do not train, so the merged model is the CPU island's training mixed with the emulated
islands' scaled weights. Its step time moves with the machine's load (the shared cores), as a
real CPU island beside GPUs would with its host's. Only M = 2 measures: an emulated island's
delta is 1e-3 of the weights a round, no real one, so the syncer's guards tell them apart. At
M >= 3 the direction guard (syncer/intake/direction.py) refuses the real island's pushes as
pointing against the emulated majority (cosine -0.53 to -0.55 at 1,1,1,cpu), and at K = M the
job then waits for it for good; at M = 2 nothing is judged by direction, and
`--movement-factor 0` turns off a job of two's movement clip and work-evidence check, which
compare the two islands' deltas per step.

    python -m bench.hetero --emulate-step-ms 10 --inner-steps 50 --mixes 1,cpu --quorums 2 1 \
        --no-fixed --skip-torchft --rounds 30 --movement-factor 0 --repeats 3
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_trainer.api.contract import EMULATE_STEP, PACE_STEP, island_name
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
    wait_all,
    workdir,
)
from bench.harness.flags import TRAINING
from bench.harness.hetero_figures import (
    Kept,
    compute_shares,
    kept_utilisation,
    repeats_to_resolve,
    round_paths,
    speed_ratios,
)
from bench.harness.measure import IslandWindow, StatusSampler, ours_islands, torchft_replica
from bench.harness.merge_waits import run_waits
from bench.harness.ours_harness import OursRun
from bench.harness.peer_training import read_progress
from bench.harness.torchft_harness import job_of_every_replica, read_result, start_job

# The mixed-speed runs' budget against the equal-speed run's: room to reach its final loss.
EXTRA_BUDGET = 1.5
# Utilisation is read up to this share of the budget merged (ours) or committed (torchft).
NEAR_END = 0.8
# A mix's `cpu` entry: an island that really trains on the CPU beside emulated ones; its speed
# factor is read from its measured step time, so this one stands for "not set" (not factor 1:
# never counted among the fast islands; never emulated).
CPU = math.inf


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
            "syncer": {
                "evalEveryOuterSteps": 1,
                "checkpoint": {"everyOuterSteps": 1000},
                **movement(args),
            },
            "stopAfter": {"tokens": tokens},
        }
    )


def movement(args: Any) -> dict[str, Any]:
    """syncer.guards.movementFactor when --movement-factor sets it (else the spec's default),
    syncer.guards.pairClip when --pair-clip does and pairCredit with --pair-credit (issue 46)."""
    factor = getattr(args, "movement_factor", None)
    clip = getattr(args, "pair_clip", None)
    credit = getattr(args, "pair_credit", False)
    guards = {
        **({} if factor is None else {"movementFactor": factor}),
        **({} if clip is None else {"pairClip": clip}),
        **({"pairCredit": True} if credit else {}),
    }
    return {"guards": guards} if guards else {}


def emulated_env(speeds: Sequence[float], step_ms: float) -> dict[int, dict[str, str]]:
    """Each island's environment for an emulated step of `step_ms` x its speed factor (in
    seconds, DILOCO_EMULATE_STEP_SECONDS); empty when `step_ms` is 0 (real steps). A CPU island
    (factor CPU) gets none: it trains for real."""
    if step_ms <= 0:
        return {}
    return {i: {EMULATE_STEP: f"{step_ms * f / 1000:g}"} for i, f in enumerate(speeds) if f != CPU}


def paced_env(speeds: Sequence[float], pace_ms: float) -> dict[int, dict[str, str]]:
    """Each island's environment for real steps paced to `pace_ms` (DILOCO_PACE_STEP_SECONDS,
    in seconds; the learner multiplies it by the island's DILOCO_SLOWDOWN, its speed factor);
    empty when `pace_ms` is 0 (steps take what they take)."""
    if pace_ms <= 0:
        return {}
    return {i: {PACE_STEP: f"{pace_ms / 1000:g}"} for i in range(len(speeds))}


# A paced learner's exit line (learner/loop.py): its steps whose compute outlasted the pace.
OVER_PACE = re.compile(r"paced steps: (\d+) of (\d+) over the pace")


def over_pace(wd: Path, names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Per island, (steps over the pace, steps) from its rank-0 learner's exit line; islands
    whose log has none (not paced, or it did not exit cleanly) are left out."""
    out: dict[str, tuple[int, int]] = {}
    for n in names:
        log = wd / f"{n}.0.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        found = OVER_PACE.findall(text)
        if found:
            out[n] = (int(found[-1][0]), int(found[-1][1]))
    return out


def run_one(args: Any, spec: JobSpec, speeds: list[float], wd: Path) -> dict[str, Any]:
    """One job to its finish; its eval history, utilisations and merged tokens per island.
    Emulated (--emulate-step-ms): no island is slowed by a sleep; its step time is its own.
    Paced (--pace-step-ms): real steps, each padded to the pace x its speed factor."""
    env = emulated_env(speeds, args.emulate_step_ms) or paced_env(speeds, args.pace_step_ms)
    slowdowns = {} if args.emulate_step_ms else {i: f for i, f in enumerate(speeds) if f > 1}
    run = OursRun(spec=spec, workdir=wd, slowdowns=slowdowns, island_env=env)
    budget = spec.stop_after.tokens or 0
    started = time.time()
    try:
        run.start()
        with StatusSampler(run) as sampler:
            sampler.wait_first_merge(args.timeout)
            t1 = time.time()
            t2: list[float] = []

            def near_end(st: dict[str, Any]) -> bool:
                if not t2 and int(st.get("tokens") or 0) >= NEAR_END * budget:
                    t2.append(time.time())
                return False

            final = run.wait_finished(args.timeout, on_status=near_end)
        end = t2[0] if t2 else time.time()
    finally:
        run.stop()
    # Steps from the tokens each island reports consumed, fill steps included (a heartbeat's
    # step, the schedule position, leaves them out: K = M islands take them at mixed speeds).
    windows = ours_islands(sampler, t1, end, tokens_per_step=spec.inner.tokens_per_step)
    names = [island_name(spec.islands.name_prefix, i) for i in range(len(speeds))]
    waits = run_waits(wd, names) if spec.sync.quorum >= len(speeds) else None
    islands = final.get("islands", {})
    merged = {n: float(islands.get(n, {}).get("mergedTokens") or 0) for n in names}
    syncer_log = wd / "syncer.log"
    text = syncer_log.read_text(errors="replace") if syncer_log.exists() else ""

    def window(n: str) -> IslandWindow:
        return windows.get(n, IslandWindow(0.0, 0.0))

    return {
        "started": started,
        "evals": [e for e in final.get("evalHistory", []) if e.get("evalLoss") is not None],
        # Speed, compute share and utilisation from the time-mean of 1 / stepTime (measure.
        # rate_of): "step_time" is the step time of that speed; the time-mean of stepTime and
        # the utilisation it gives (capped at 1), hetero17's reading, are kept beside them.
        "utilisation": {n: window(n).busy for n in names},
        "step_time": {n: 1 / window(n).speed if window(n).speed > 0 else 0.0 for n in names},
        "mean_step_time": {n: window(n).step_time for n in names},
        "mean_utilisation": {n: window(n).utilisation for n in names},
        "rounds": round_paths(text, names),
        "merged": merged,
        "inner_steps": {n: islands.get(n, {}).get("innerSteps") for n in names},
        "final_loss": float(final["evalLoss"]),
        "waits": waits,
        "over_pace": over_pace(wd, names),
    }


def torchft_unavailable(args: Any) -> str | None:
    """Why torchft's runs are left out (None: they run). No network namespace is needed here:
    the runs share the loopback unshaped, as ours do."""
    if args.skip_torchft:
        return "skipped (--skip-torchft)"
    if args.emulate_step_ms:
        return "its workers cannot emulate a step (--emulate-step-ms): real training only"
    if args.pace_step_ms:
        return "its workers' steps are not paced (--pace-step-ms): they would not compare"
    try:
        import torchft  # noqa: F401
    except ImportError:
        return "torchft is not installed (pip install -e '.[bench]')"
    return None


def near_end_commits(budget: int, per_round: int) -> int:
    """The commit by which NEAR_END of the budget is committed (torchft commits every replica's
    round at once: `per_round` tokens), at least the second so that the window holds a round."""
    return max(2, math.ceil(NEAR_END * budget / per_round))


def torchft_window(records: Sequence[dict[str, Any]], commits: int) -> tuple[float, float] | None:
    """A torchft replica's utilisation window, as ours' is read: from its first commit (start-up
    and the first round's join left out) to its first progress record with `commits` commits
    (its last record when it never got there). None without a commit or an empty window."""
    committed = [r for r in records if r["commits"] >= 1]
    if not committed:
        return None
    end = next((r for r in records if r["commits"] >= commits), records[-1])
    t1, t2 = float(committed[0]["time"]), float(end["time"])
    return (t1, t2) if t2 > t1 else None


def torchft_history(
    started: float, initial: float, saved: Sequence[tuple[dict[str, Any], float]], per_round: int
) -> list[dict[str, Any]]:
    """torchft's eval history in ours' form (time, tokens, evalLoss): the initial weights' loss
    at its start, then each saved commit's (index entry, loss) at outer_step x `per_round`
    tokens (every replica's round is committed at once)."""
    out = [{"time": started, "tokens": 0, "evalLoss": initial}]
    for entry, loss in saved:
        out.append(
            {
                "time": float(entry["time"]),
                "tokens": int(entry["outer_step"]) * per_round,
                "evalLoss": loss,
            }
        )
    return out


def run_torchft(
    args: Any, spec: JobSpec, speeds: list[float], wd: Path, rounds: int, budget: int
) -> dict[str, Any]:
    """torchft's DiLoCo at K = M for `rounds` commits with the same slowdowns: its history from
    the global weights replica 0 saves after every commit, evaluated afterwards; each replica's
    utilisation (compute seconds, the slowdown's sleep included as in ours' step time, over
    the window of torchft_window)."""
    from diloco_trainer.models.parts import build_parts, evaluate
    from safetensors.torch import load_model

    m = len(speeds)
    job = job_of_every_replica(
        spec, wd, m, outer_steps=rounds, slowdowns={i: f for i, f in enumerate(speeds) if f > 1}
    )
    started = time.time()
    lighthouse, replicas = start_job(job, evaluate_replica=None, save_replica=0)
    try:
        wait_all(replicas, timeout=args.timeout)
    finally:
        lighthouse.kill()
    per_round = m * spec.inner.steps * spec.inner.batch_size * spec.inner.seq_len
    parts = build_parts(spec, shard_index=0, num_shards=1, with_train=False)
    initial = evaluate(parts)
    saved = []
    directory = job.save_dir(0)
    for line in (directory / "index.jsonl").read_text().splitlines():
        entry = json.loads(line)
        load_model(parts.model, str(directory / entry["file"]))
        saved.append((entry, evaluate(parts)))
    evals = torchft_history(started, initial, saved, per_round)
    commits = near_end_commits(budget, per_round)
    utilisation = {}
    for i in range(m):
        window = torchft_window(read_progress(job.progress_file(i)), commits)
        utilisation[f"replica{i}"] = (
            0.0
            if window is None
            else torchft_replica([job.progress_file(i)], *window)["utilisation"]
        )
    return {
        "started": started,
        "evals": evals,
        "utilisation": utilisation,
        "final_loss": evals[-1]["evalLoss"],
        "commits": int(read_result(job, 0)["outer_steps"]),
    }


def plan_torchft(
    args: Any, mixes: list[list[float]], budget: int
) -> list[tuple[str, str, list[float], JobSpec]]:
    """torchft's runs in order, once per repeat: equal speeds, then each mix; (name, key,
    speeds, spec), the spec the one ours' K = M runs train (its quorum unused: K = M)."""
    m = len(mixes[0])
    out: list[tuple[str, str, list[float], JobSpec]] = []
    for r in range(args.repeats):
        tag = f" #{r + 1}" if args.repeats > 1 else ""
        for speeds in [[1.0] * m, *mixes]:
            label = "equal speeds" if speeds == [1.0] * m else mix_label(speeds)
            key = f"torchft {label}, K={m}"
            spec = make_spec(args, islands=m, quorum=m, mode="fixed", tokens=budget)
            out.append((key + tag, key, speeds, spec))
    return out


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
    """The speed factors of a mix such as 1,1,2,4; an entry `cpu` is a CPU island (CPU)."""
    return [CPU if x.strip() == "cpu" else float(x) for x in text.split(",")]


def mix_label(speeds: Sequence[float]) -> str:
    """The mix as it is written on the command line: "1,1,1,3", "1,1,1,cpu"."""
    return ",".join("cpu" if f == CPU else f"{f:g}" for f in speeds)


def mix_problem(
    mixes: Sequence[Sequence[float]], step_ms: float, pace_ms: float = 0.0
) -> str | None:
    """Why these mixes cannot run (None: they can): a CPU island needs the others emulated
    (without --emulate-step-ms every island is a real CPU one); an emulated island's step is
    at most 60 s (the learner's bound), a paced one's pace too; steps are emulated or paced,
    not both; every mix has the same number of islands."""
    if step_ms and pace_ms:
        return "--emulate-step-ms and --pace-step-ms exclude each other (emulated steps are paced)"
    if pace_ms < 0 or pace_ms / 1000 > 60:
        return "--pace-step-ms must be >= 0 and at most 60 s"
    if len({len(mix) for mix in mixes}) != 1:
        return "every mix must have the same number of islands"
    if any(CPU in mix for mix in mixes) and step_ms <= 0:
        return "a mix's cpu island needs --emulate-step-ms (the other islands emulated)"
    if any(all(f == CPU for f in mix) for mix in mixes):
        return "a mix needs at least one island that is not cpu"
    slowest = max(f for mix in mixes for f in mix if f != CPU)
    if step_ms < 0 or slowest * step_ms / 1000 > 60:
        return "--emulate-step-ms must be >= 0 and the slowest island's step at most 60 s"
    return None


def plan_runs(
    args: Any, mixes: list[list[float]], budget: int, extra: int
) -> list[tuple[str, str, list[float], JobSpec]]:
    """The runs in order: (name, key, speeds, spec). Each repeat runs the equal-speed baseline
    and the fast islands alone and then every mixed run, so baselines and mixed runs interleave
    (baseline, alone, mixed, baseline, alone, mixed ...) and share the machine's drift in load
    (one fast-alone run took 34-78 s from one command to the next at load 10-15, bench/RESULTS.md,
    "hetero"). `key` groups the repeats of one configuration; the name numbers them when there
    are several. Emulated steps (--emulate-step-ms) leave the fast islands alone out: their only
    figure is the time to target, and emulated steps do not train."""
    m = len(mixes[0])
    fast = min(sum(1 for f in mix if f == 1.0) for mix in mixes)
    equal = f"equal speeds, K={m}"
    out: list[tuple[str, str, list[float], JobSpec]] = []
    for r in range(args.repeats):
        tag = f" #{r + 1}" if args.repeats > 1 else ""
        spec = make_spec(args, islands=m, quorum=m, mode="fixed", tokens=budget)
        out.append((equal + tag, equal, [1.0] * m, spec))
        if not args.emulate_step_ms:
            alone = f"{fast} fast islands alone, K={fast}"
            spec = make_spec(args, islands=fast, quorum=fast, mode="fixed", tokens=extra)
            out.append((alone + tag, alone, [1.0] * fast, spec))
        for mix in mixes:
            label = mix_label(mix)
            for k in args.quorums:
                for mode in ("auto",) if args.no_fixed else ("auto", "fixed"):
                    if mode == "fixed" and k != m:
                        continue  # today's behaviour: at K = M only
                    key = f"{label} {mode}, K={k}"
                    spec = make_spec(args, islands=m, quorum=k, mode=mode, tokens=extra)
                    out.append((key + tag, key, mix, spec))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(
        __doc__ or "",
        **TRAINING,
        inner_steps=20,
        eval_tokens=4096,
        timeout=900,
        skip_torchft=False,
    )
    p.add_argument(
        "--mixes",
        nargs="+",
        default=["1,1,1,3", "1,1,2,4"],
        help="slowdowns; with --emulate-step-ms an entry cpu is an island training for real on "
        "the CPU (e.g. 1,1,1,cpu)",
    )
    p.add_argument("--quorums", nargs="+", type=int, default=[4, 1], help="K of the mixes")
    p.add_argument("--rounds", type=int, default=10, help="equal-speed budget in rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fixed", action="store_true", help="leave the fixed-H mixes out")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the equal-speed baseline and every mixed run this many times, interleaved "
        "(baseline, mixed, baseline, mixed ...); the fast islands' utilisation is judged against "
        "the baselines' mean with the 95%% interval of the ratio (one: no interval, not resolved)",
    )
    p.add_argument(
        "--emulate-step-ms",
        type=float,
        default=0.0,
        help="every island's inner step an emulated accelerator's of this many ms x its speed "
        "factor instead of real training slowed by a sleep: step times exact and independent of "
        "the shared cores, as separate hardware (50: a real gpt-tiny step here); the steps do "
        "not train, so time to target and loss are n/a and the fast-alone and torchft runs are "
        "left out (default 0: real steps)",
    )
    p.add_argument(
        "--pace-step-ms",
        type=float,
        default=0.0,
        help="real training, each island's inner step padded with sleep to this many ms x its "
        "speed factor (DILOCO_PACE_STEP_SECONDS): step times that do not move with the shared "
        "cores' load, as separate hardware, while the model trains, so time to target and loss "
        "stay measured; pick it above a step's compute under the run's load (each run says how "
        "many steps went over); torchft's runs are left out (default 0: not paced)",
    )
    p.add_argument(
        "--movement-factor",
        type=float,
        default=None,
        help="syncer.guards.movementFactor of every run (default: the spec's); 0 turns off a "
        "job of two's movement clip and work-evidence check, which compare the islands' deltas "
        "per step: an emulated step's (1e-3 of the weights a round) is no real one's, so a real "
        "CPU island beside one emulated island needs 0",
    )
    p.add_argument(
        "--pair-clip",
        type=float,
        default=None,
        help="syncer.guards.pairClip of every run (default: the spec's): in a job of two a "
        "push's pseudo-gradient per claimed step is held to this x the other island's median "
        "(issue 46); what it costs an honest pair",
    )
    p.add_argument(
        "--pair-credit",
        action="store_true",
        help="syncer.guards.pairCredit in every run (off by default): in a job of two a push's "
        "merge credits at most one round of its island's own steps as work (issue 46); what it "
        "costs an honest pair",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    try:
        mixes = [parse_mix(m) for m in args.mixes]
    except ValueError as err:
        p.error(f"--mixes: {err}")
    problem = mix_problem(mixes, args.emulate_step_ms, args.pace_step_ms)
    if problem:
        p.error(problem)
    install_signal_cleanup()
    m = len(mixes[0])
    step_tokens = args.batch_size * args.seq_len
    budget = args.rounds * m * args.inner_steps * step_tokens
    extra = int(budget * EXTRA_BUDGET)
    runs = plan_runs(args, mixes, budget, extra)
    why_not = torchft_unavailable(args)
    if why_not:
        print(f"torchft's runs left out: {why_not}", flush=True)
    peer = Peer(runs=[] if why_not else plan_torchft(args, mixes, budget), why_not=why_not)
    results: dict[str, dict[str, Any]] = {}
    with LoadMonitor() as load, workdir(args.workdir, "hetero") as wd:
        for n, (name, _key, speeds, spec) in enumerate(runs):
            print(f"{name}", flush=True)
            results[name] = run_one(args, spec, speeds, wd / f"run-{n}")
            print(
                f"  -> final {results[name]['final_loss']:.4f}, H_i {results[name]['inner_steps']}",
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        rounds = math.ceil(EXTRA_BUDGET * args.rounds)
        for n, (name, _key, speeds, spec) in enumerate(peer.runs):
            print(f"{name}: {rounds} commits", flush=True)
            try:
                r = run_torchft(args, spec, speeds, wd / f"torchft-{n}", rounds, budget)
            except (RuntimeError, TimeoutError) as err:
                # Ours' runs, minutes of them, still get reported: the row is left out, named.
                print(f"  -> failed, left out: {err!s:.300}", flush=True)
                peer.failed.append(f"{name}: {(str(err).splitlines() or [type(err).__name__])[0]}")
                continue
            peer.results[name] = r
            print(
                f"  -> final {r['final_loss']:.4f} after {r['commits']} commits, utilisation "
                + " ".join(f"{u:.3f}" for u in r["utilisation"].values()),
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        # What the report reads, kept with the run's files (--workdir keeps them).
        (wd / "results.json").write_text(
            json.dumps({"ours": results, "torchft": peer.results}, default=str)
        )
    return report(args, runs, results, budget, load, peer)


@dataclass
class Peer:
    """torchft's runs (name, key, speeds, spec), their results by name, and why they were left
    out (`why_not`) or which failed."""

    runs: list[tuple[str, str, list[float], JobSpec]]
    why_not: str | None = None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)


def fast_utilisation(r: dict[str, Any], speeds: Sequence[float]) -> float:
    """The mean utilisation of a run's islands that are not slowed (factor 1)."""
    fast = [u for u, f in zip(r["utilisation"].values(), speeds, strict=True) if f == 1]
    return sum(fast) / max(1, len(fast))


def mean_reached(times: Sequence[float | None]) -> float | None:
    """The mean of the times that reached the target; None when none did."""
    reached = [t for t in times if t is not None]
    return sum(reached) / len(reached) if reached else None


def all_or_none(flags: Sequence[bool]) -> str:
    """A verdict over repeats: met when every run met it, MISSED when none did."""
    if all(flags):
        return verdict(True)
    return verdict(False) if not any(flags) else f"met in {sum(flags)} of {len(flags)}"


def report(
    args: Any,
    runs: list[tuple[str, str, list[float], JobSpec]],
    results: dict[str, dict[str, Any]],
    budget: int,
    load: LoadMonitor,
    peer: Peer | None = None,
) -> int:
    emulated = bool(args.emulate_step_ms)
    # Emulated steps do not train: no fast-alone runs, and no loss or time figure means a thing.
    equal_key, alone_key = runs[0][1], None if emulated else runs[1][1]
    baselines = [results[name] for name, key, _, _ in runs if key == equal_key]
    target = sum(b["final_loss"] for b in baselines) / len(baselines)
    alone_times = [
        time_to(results[name]["evals"], target, results[name]["started"])
        for name, key, _, _ in runs
        if key == alone_key
    ]
    alone_time = mean_reached(alone_times)
    base_utils = [fast_utilisation(b, [1.0] * len(b["utilisation"])) for b in baselines]
    base_util = sum(base_utils) / len(base_utils)
    aim = (
        f"steps emulated, {args.emulate_step_ms:g} ms x the speed factor: loss and time n/a"
        if emulated
        else f"target {target:.4f}, the mean final loss of {len(baselines)} equal-speed run(s)"
    )
    table = Table(
        f"Mixed speeds ({args.preset}, H={args.inner_steps}, budget {budget} tokens = "
        f"{args.rounds} rounds of the equal-speed job, mixes {EXTRA_BUDGET:g}x; {aim})",
        [
            "run",
            "H_i",
            "time to target",
            "vs fast alone",
            f"loss at {budget} tokens",
            "vs equal",
            "fast islands' utilisation vs equal (baselines' mean)",
            "utilisation per island",
            "measured step time per island / fast islands'",
            "merged-token share / measured compute share per island",
            "the same by the time-mean step time (hetero17's reading)",
            "H_i moves per island (path of the most moved)",
            "K = M merges' waits for each island alone",
        ],
    )
    by_key: dict[str, list[dict[str, Any]]] = {}
    for name, key, speeds, _ in runs:
        r = results[name]
        islands = list(r["utilisation"])
        t = time_to(r["evals"], target, r["started"])
        steps = [r["step_time"][n] for n in islands]
        total_merged = sum(r["merged"].values()) or 1.0
        shares = [
            ratio(r["merged"][n] / total_merged, c)
            for n, c in zip(islands, compute_shares(steps), strict=True)
        ]
        mean_steps = [r.get("mean_step_time", r["step_time"])[n] for n in islands]
        mean_shares = [
            ratio(r["merged"][n] / total_merged, c)
            for n, c in zip(islands, compute_shares(mean_steps), strict=True)
        ]
        paths = r.get("rounds") or {n: [] for n in islands}
        moved = max(islands, key=lambda n: len(paths[n]))
        loss = loss_at(r["evals"], budget)
        by_key.setdefault(key, []).append(
            {
                "util": fast_utilisation(r, speeds),
                "t": t,
                "loss": ratio(loss, target),
                "shares": shares,
                "speeds": speed_ratios(steps, speeds),
                "cpu": [i for i, f in enumerate(speeds) if f == CPU],
            }
        )
        table.add(
            name,
            " ".join(str(r["inner_steps"][n] or "-") for n in islands),
            *(
                ["n/a"] * 4
                if emulated
                else [
                    "not reached" if t is None else f"{t:.1f}s",
                    "n/a" if t is None or alone_time is None else fmt_ratio(t / alone_time),
                    f"{loss:.4f}",
                    fmt_ratio(ratio(loss, target), 4),
                ]
            ),
            fmt_ratio(ratio(fast_utilisation(r, speeds), base_util)),
            " ".join(fmt_pct(r["utilisation"][n]) for n in islands),
            " ".join(fmt_ratio(x, 2) for x in speed_ratios(steps, speeds)),
            " ".join(fmt_ratio(x, 2) for x in shares),
            " ".join(fmt_ratio(x, 2) for x in mean_shares),
            " ".join(str(max(0, len(paths[n]) - 1)) for n in islands)
            + (f" ({' '.join(map(str, paths[moved]))})" if paths[moved] else ""),
            "-" if r["waits"] is None else " ".join(f"{r['waits'][n]:.2f}s" for n in islands),
        )
    targets = Table("Targets (issue 47)", ["target", "figure", "verdict"])
    for key, rows in by_key.items():
        if " auto, " in key:
            add_targets(
                targets, key, rows, base_utils, alone_times, seed=args.seed, emulated=emulated
            )
    peer = peer or Peer(runs=[], why_not="not run")
    ours_times = {key: mean_reached([x["t"] for x in rows]) for key, rows in by_key.items()}
    m = len(runs[0][2])
    tables = [table, targets]
    if peer.results:
        tables.append(torchft_table(args, peer, target, budget, ours_times, m))
    rep = Report(
        "hetero",
        "Islands of different speeds (issue 47): rounds sized per island (stepsPerIsland auto) "
        "against a fixed H, equal speeds, the fast islands alone and torchft's DiLoCo.",
        tables=tables,
        notes=[
            *([EMULATED_NOTE] if emulated else []),
            *([paced_note(args, runs, results)] if args.pace_step_ms else []),
            *(NOTES[1:] if emulated or args.pace_step_ms else NOTES),
            *([CPU_NOTE] if any(CPU in speeds for _, _, speeds, _ in runs) else []),
            f"torchft's runs left out: {peer.why_not}." if peer.why_not else TORCHFT_NOTE,
            *(f"torchft run failed, its row left out: {f}" for f in peer.failed),
        ],
    )
    return publish(rep, args, load)


def paced_note(
    args: Any, runs: list[tuple[str, str, list[float], JobSpec]], results: dict[str, Any]
) -> str:
    """What --pace-step-ms did, and per run how many of each island's steps outlasted the pace
    (their compute longer than it: there the shared cores still set the step time)."""
    parts = []
    for name, _key, _speeds, _spec in runs:
        counts = results[name].get("over_pace") or {}
        cells = " ".join(f"{o}/{n}" for o, n in counts.values()) or "no exit line"
        parts.append(f"{name}: {cells}")
    return (
        f"Paced steps (--pace-step-ms {args.pace_step_ms:g}): every island trains for real and "
        "pads each inner step with sleep to the pace x its speed factor "
        "(DILOCO_PACE_STEP_SECONDS), so its step time is its own, not the shared cores' load, as "
        "on hardware of its own (while its compute stays under the pace): a slow island's "
        "compute no longer slows the fast ones. Steps over the pace per island, over all: "
        + "; ".join(parts)
        + "."
    )


def torchft_table(
    args: Any,
    peer: Peer,
    target: float,
    budget: int,
    ours_times: dict[str, float | None],
    m: int,
) -> Table:
    """torchft's rows: each against its own equal-speed run (the mean of its repeats) and
    against ours' runs of the same speeds (equal speeds K = M; a mix: auto at K = M)."""
    commits = math.ceil(EXTRA_BUDGET * args.rounds)
    table = Table(
        f"torchft 0.2.0's DiLoCo on the same work (K = {m}, {commits} commits; target "
        f"{target:.4f}, ours' equal-speed final loss)",
        [
            "run",
            "time to target",
            "vs torchft equal speeds",
            "vs ours, same speeds",
            f"loss at {budget} tokens",
            "vs torchft equal speeds",
            "vs ours' equal speeds (the target)",
            "fast replicas' utilisation",
            "vs torchft equal speeds",
            "utilisation per replica",
        ],
    )
    equal = [
        peer.results[n] for n, key, speeds, _ in peer.runs if n in peer.results and max(speeds) == 1
    ]
    ref = (
        {
            "t": mean_reached([time_to(r["evals"], target, r["started"]) for r in equal]),
            "loss": sum(loss_at(r["evals"], budget) for r in equal) / len(equal),
            "util": sum(fast_utilisation(r, [1.0] * m) for r in equal) / len(equal),
        }
        if equal
        else None
    )
    for name, _key, speeds, _ in peer.runs:
        if name not in peer.results:
            continue
        label = mix_label(speeds)
        ours_key = f"equal speeds, K={m}" if max(speeds) == 1 else f"{label} auto, K={m}"
        table.add(
            name,
            *torchft_cells(
                peer.results[name], speeds, target, budget, ref, ours_times.get(ours_key)
            ),
        )
    return table


def torchft_cells(
    r: dict[str, Any],
    speeds: Sequence[float],
    target: float,
    budget: int,
    ref: dict[str, Any] | None,
    ours_time: float | None,
) -> list[str]:
    """One torchft run's cells: its time to `target` (from its start), over its equal-speed
    runs' (`ref`: their mean time "t", loss at the budget "loss", fast utilisation "util") and
    over ours' of the same speeds (`ours_time`); its loss at `budget` tokens over ref's and over
    the target; its fast (factor 1) replicas' mean utilisation over ref's; every replica's."""
    t = time_to(r["evals"], target, r["started"])
    loss = loss_at(r["evals"], budget)
    util = fast_utilisation(r, speeds)

    def over(x: float | None, base: float | None) -> str:
        return "n/a" if x is None or base is None else fmt_ratio(ratio(x, base))

    return [
        "not reached" if t is None else f"{t:.1f}s",
        over(t, ref["t"] if ref else None),
        over(t, ours_time),
        f"{loss:.4f}",
        "n/a" if ref is None else fmt_ratio(ratio(loss, ref["loss"]), 4),
        fmt_ratio(ratio(loss, target), 4),
        fmt_pct(util),
        over(util, ref["util"] if ref else None),
        " ".join(fmt_pct(u) for u in r["utilisation"].values()),
    ]


def add_targets(
    targets: Table,
    key: str,
    rows: list[dict[str, Any]],
    base_utils: list[float],
    alone_times: list[float | None],
    *,
    seed: int,
    emulated: bool = False,
) -> None:
    """Issue 47's targets for one configuration's repeats; with emulated steps (which do not
    train) the time-to-target and loss targets are n/a."""
    kept = kept_utilisation([x["util"] for x in rows], base_utils)
    targets.add(
        f"{key}: fast islands keep >= 97% of equal-speed utilisation ({len(rows)} run(s) "
        f"against {len(base_utils)} baseline(s), 95% interval)",
        kept.describe() + resolve_note(kept),
        kept.verdict,
    )
    if emulated:
        for what in ("target loss no later than the fast islands alone", "loss at equal tokens"):
            targets.add(f"{key}: {what}", "n/a: emulated steps do not train", "n/a")
    else:
        add_loss_targets(targets, key, rows, alone_times, seed=seed)
    worst = [max(abs(v - 1) for v in x["shares"]) for x in rows]
    slow = [max(x["speeds"]) for x in rows]
    targets.add(
        f"{key}: each island's merged-token share within 10% of its measured compute share",
        ", ".join(f"worst {w:.1%}" for w in worst)
        + " (slowest island's step time "
        + ", ".join(f"{v:.2f}x" for v in slow)
        + " the fast islands')",
        all_or_none([w <= 0.10 for w in worst]),
    )
    if rows[0]["cpu"]:
        add_cpu_target(targets, key, rows)


def add_cpu_target(targets: Table, key: str, rows: list[dict[str, Any]]) -> None:
    """The CPU islands' own row: each one's merged-token share over its measured compute share
    and its measured speed (step time over the fast islands'), run by run."""
    cells = []
    for x in rows:
        for i in x["cpu"]:
            cells.append(f"{x['shares'][i]:.3f}x at {x['speeds'][i]:.2f}x the fast step time")
    targets.add(
        f"{key}: the CPU island's merged-token share within 10% of its measured compute share",
        ", ".join(cells),
        all_or_none([abs(x["shares"][i] - 1) <= 0.10 for x in rows for i in x["cpu"]]),
    )


def no_later(t: float | None, alone_time: float | None, *, alone_runs: int) -> bool:
    """Whether a mixed run reached the target no later than the fast islands alone: it reached
    it, and at or before their mean time (mean_reached), or none of their `alone_runs` runs
    reached it at all (pace47 seed 2: the mix in 44.6 s, the fast islands alone never, within
    their run).

    >>> no_later(50.0, 60.0, alone_runs=1), no_later(70.0, 60.0, alone_runs=1)
    (True, False)
    >>> no_later(44.6, None, alone_runs=1), no_later(None, None, alone_runs=1)
    (True, False)
    >>> no_later(44.6, None, alone_runs=0)  # none run (emulated): nothing to be earlier than
    False
    """
    if t is None or (alone_time is None and alone_runs == 0):
        return False
    return alone_time is None or t <= alone_time


def no_later_figure(t: float | None, alone_time: float | None) -> str:
    """A mixed run's time to the target over the fast islands alone's, or why there is none.

    >>> no_later_figure(45.0, 60.0), no_later_figure(44.6, None), no_later_figure(None, 60.0)
    ('0.750x', '44.6s (alone: not reached)', 'not reached')
    """
    if t is None:
        return "not reached"
    return f"{t:.1f}s (alone: not reached)" if alone_time is None else fmt_ratio(t / alone_time)


def add_loss_targets(
    targets: Table,
    key: str,
    rows: list[dict[str, Any]],
    alone_times: list[float | None],
    *,
    seed: int,
) -> None:
    """The targets read from the loss (real steps only): time to the target loss against the
    fast islands alone, and loss at equal tokens."""
    alone_time = mean_reached(alone_times)
    times = [x["t"] for x in rows]
    spread = ", ".join("not reached" if t is None else f"{t:.1f}s" for t in alone_times)
    targets.add(
        f"{key}: target loss no later than the fast islands alone (against the mean of their "
        f"{len(alone_times)} run(s): {spread})",
        ", ".join(no_later_figure(t, alone_time) for t in times),
        all_or_none([no_later(t, alone_time, alone_runs=len(alone_times)) for t in times]),
    )
    losses = [x["loss"] for x in rows]
    targets.add(
        f"{key}: loss at equal tokens within 1% (seed {seed})",
        ", ".join(fmt_ratio(v, 4) for v in losses),
        all_or_none([abs(v - 1) <= 0.01 for v in losses]),
    )


def resolve_note(kept: Kept) -> str:
    """What a "not resolved" would take at this noise (repeats_to_resolve)."""
    if kept.verdict != "not resolved" or math.isnan(kept.half_width):
        return ""
    n = repeats_to_resolve(kept)
    at = "over 100" if n is None else str(n)
    return f"; at this noise and mean, {at} runs a side would resolve it"


CPU_NOTE = (
    "A mix's cpu island really trains the model on this machine's CPU (one intra-op thread, "
    "sharing the cores with the syncer and everything else on the machine) beside the emulated "
    "islands: its speed factor is its measured step time over the fast islands' (the step-time "
    "column), not set, and its compute share is read from it. Loss stays n/a: the merged model "
    "mixes its real training with the emulated islands' scaled weights."
)

EMULATED_NOTE = (
    "Steps emulated (--emulate-step-ms): every island's inner step is an emulated accelerator's "
    "(learner/emulated_step.py) of T x its speed factor, mostly asleep, the weights moved by a "
    "real delta so that the sync path is real; no island is slowed by DILOCO_SLOWDOWN, so the "
    "islands' step times are independent of each other's load, as on separate hardware. The "
    "steps do not train: time to target and loss at equal tokens are n/a, and the fast "
    "islands alone and torchft's runs are left out."
)

NOTES = [
    "Slow islands sleep (factor - 1) x their compute after each step; on a machine with "
    "fewer cores than processes a sleeping island frees CPU for the others, so the fast "
    "islands' utilisation is the figure judged (it counts only time lost waiting).",
    "Time to target counts from the processes' start (start-up is the same in every run).",
    "The equal-tokens loss of the mixes is at the equal-speed run's budget of merged tokens; "
    "the target loss is the mean final loss of the equal-speed runs.",
    "Measured speed: the time-mean of 1 / an island's reported stepTime (its learner's "
    "average inner-step wall time, the slowdown's sleep included) over the window from the "
    "first merge to 80% of the budget, sampled each second: the steps a second it could take "
    "never waiting (bench/harness/measure.rate_of); its measured step time is 1 / that, shown "
    "over the mean of the fast (factor 1) islands' in the same run. Measured compute share: "
    "(1 / t_i) / sum_j (1 / t_j) (bench/harness/hetero_figures.py); merged tokens over the "
    "whole run. Until hetero18 t_i was the time-mean of stepTime, which under-reads the speed "
    "of an island whose step time moves (1 / mean(t) < mean(1 / t)): its share by that "
    "reading is the column beside.",
    "Utilisation: an island's steps in the window (the tokens it reports consumed over tokens "
    "a step: fill steps count, which its reported step, the schedule position, leaves out) "
    "over the steps its measured speed could take in it (not capped at 100%). "
    "Fast islands' utilisation: each mixed run's mean over the factor-1 islands, over the "
    "mean of the equal-speed baselines'; with --repeats the verdict reads the 95% interval "
    "of the ratio of the means (variance pooled from both sides, Student's t): met when the "
    "whole interval is >= 0.97, MISSED when it is all below, else not resolved.",
    "K = M merges' waits: per island, the seconds between the second-last push of a merge "
    "and its own when it pushed last, summed over the run's merges but the first "
    "(bench/harness/merge_waits.py, from the learners' logs): whose rounds the others "
    "waited for.",
]

TORCHFT_NOTE = (
    "torchft 0.2.0's DiLoCo (fp32 ring all-reduce over gloo on the loopback, one fragment, "
    "no sync delay, K = M: every sync waits for every replica group), the same preset, seed, "
    "data shards, inner and outer optimizers, H and slowdowns (its workers sleep (factor - 1) x "
    "their compute after each step, as DILOCO_SLOWDOWN), run after ours' for 1.5x the budget's "
    "rounds, once per repeat. Its history: the global weights replica 0 saved after every "
    "commit, evaluated afterwards, at commits x M x H x batch x seqLen tokens; time to target "
    "from its lighthouse's start. Utilisation: a replica's compute seconds (the sleep included, "
    "as in ours' step time) over the wall from its first commit to its commit at 80% of the "
    "budget (ours' window: first merge to 80% merged)."
)


if __name__ == "__main__":
    raise SystemExit(main())
