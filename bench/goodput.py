"""Goodput: islands killed at random (SIGKILL) and restarted; useful tokens/s against no failures.

For ours and torchft's DiLoCo, the same seeded failure schedule: every island fails as a Poisson
process with the given mean time between failures (its clock runs only while it is up); a failed
island's process group gets SIGKILL and a fresh process is started `--restart-delay` seconds later
(it then pays its own start-up and rejoins: ours joins the syncer and takes the global weights;
torchft's replica joins a new quorum and heals from a peer).

Useful tokens are tokens that made it into the global model: ours, the syncer's merged tokens;
torchft, the tokens of rounds whose sync committed (a healing replica's first round excluded: it
sends a copy of a peer's work). Over a window of W seconds from the first sync, useful tokens/s
are divided by the potential of the run (M islands at the inner-step time measured in that run),
and goodput is that share with failures relative to the share without, in this run: runs follow
each other on a shared machine whose load drifts, and the step time carries that drift. The eval
loss of the global weights at the end of the window is reported beside it, as a check that the
tokens were useful.

    python -m bench.goodput                               # M=4, MTBF 120 s/island, W=90 s
    python -m bench.goodput --mtbf 300 --seconds 600 --islands 8
"""

from __future__ import annotations

import heapq
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.models.parts import build_parts, evaluate

from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_pct,
    fmt_ratio,
    install_signal_cleanup,
    poll_until,
    publish,
    ratio,
    training_spec,
    verdict,
    workdir,
)
from bench.harness.flags import TRAINING, WALL_CLOCK
from bench.harness.measure import StatusSampler, torchft_replica
from bench.harness.ours_harness import OursRun
from bench.harness.peer_training import read_progress
from bench.harness.torchft_harness import TorchftJob, start_lighthouse, start_replica


@dataclass(frozen=True)
class Failure:
    at: float  # seconds after the window opened
    island: int


def failure_schedule(
    islands: int, mtbf: float, restart_delay: float, seconds: float, seed: int
) -> list[Failure]:
    """Kills within the window: per island, exponential up-times with mean `mtbf`, each followed
    by `restart_delay` down (start-up after that is the system's own cost, not scheduled)."""
    rng = random.Random(seed)
    out = []
    for i in range(islands):
        t = rng.expovariate(1 / mtbf)
        while t < seconds:
            out.append(Failure(t, i))
            t += restart_delay + rng.expovariate(1 / mtbf)
    return sorted(out, key=lambda f: f.at)


def run_schedule(
    schedule: Sequence[Failure],
    restart_delay: float,
    seconds: float,
    kill: Callable[[int], None],
    restart: Callable[[int], None],
) -> tuple[float, float, int]:
    """Play the schedule from now; returns (t1, t2, kills). Restarts due after t2 are dropped."""
    t1 = time.time()
    events: list[tuple[float, int, str, int]] = []
    for n, f in enumerate(schedule):
        heapq.heappush(events, (t1 + f.at, n, "kill", f.island))
    down: set[int] = set()
    kills = 0
    seq = len(schedule)
    while events:
        at, _, what, island = heapq.heappop(events)
        if at > t1 + seconds:
            break
        time.sleep(max(0.0, at - time.time()))
        if what == "kill" and island not in down:
            kill(island)
            kills += 1
            down.add(island)
            seq += 1
            heapq.heappush(events, (time.time() + restart_delay, seq, "start", island))
        elif what == "start":
            restart(island)
            down.discard(island)
    time.sleep(max(0.0, t1 + seconds - time.time()))
    return t1, time.time(), kills


def make_spec(args: Any) -> JobSpec:
    return training_spec(
        args,
        sync={
            "quorum": args.quorum or max(1, args.islands - 1),
            "compression": args.codec,
            # torchft's lighthouse drops a silent replica after 5 s; ours does the same.
            "heartbeatTimeoutSeconds": 5,
        },
        syncer={"evalEveryOuterSteps": 1},
        eval_tokens=args.eval_tokens,
    )


def run_ours(args: Any, schedule: Sequence[Failure], wd: Path) -> dict[str, Any]:
    run = OursRun(spec=make_spec(args), workdir=wd)
    try:
        run.start()
        with StatusSampler(run) as sampler:
            sampler.wait_first_merge(args.warmup_timeout)
            t1, t2, kills = run_schedule(
                schedule, args.restart_delay, args.seconds, run.kill_island, run.start_island
            )
            time.sleep(1.5)
        final = run.status()
    finally:
        run.stop()
    tokens = int(sampler.at(t2)[1]["tokens"]) - int(sampler.at(t1)[1]["tokens"])
    evals = [h for h in final.get("evalHistory", []) if h["time"] <= t2]
    step_times = [
        float(isl["stepTime"])
        for t, st in sampler.samples
        if t1 <= t <= t2
        for isl in st["islands"].values()
        if isl.get("stepTime")
    ]
    return {
        "tokens_per_s": tokens / (t2 - t1),
        "step_time": sum(step_times) / len(step_times) if step_times else float("nan"),
        "loss": float(evals[-1]["evalLoss"]) if evals else float("nan"),
        "kills": kills,
    }


def latest_global_loss(spec: JobSpec, job: TorchftJob, t: float) -> float:
    """Eval loss of the newest global weights any torchft replica committed at or before t."""
    from safetensors.torch import load_model

    best: tuple[int, float, Path] | None = None
    for i in range(job.num_replicas):
        index = job.save_dir(i) / "index.jsonl"
        if not index.exists():
            continue
        for line in index.read_text().splitlines():
            e = json.loads(line)
            cand = (int(e["outer_step"]), float(e["time"]), job.save_dir(i) / e["file"])
            if cand[1] <= t and (best is None or cand[:2] > best[:2]):
                best = cand
    if best is None:
        return float("nan")
    parts = build_parts(spec, shard_index=0, num_shards=1, with_train=False)
    load_model(parts.model, str(best[2]))
    return evaluate(parts)


def run_torchft(args: Any, schedule: Sequence[Failure], wd: Path) -> dict[str, Any]:
    spec = make_spec(args)
    m = args.islands
    wd.mkdir(parents=True, exist_ok=True)
    spec_file = wd / "spec.json"
    spec_file.write_text(spec.to_json())
    job = TorchftJob(spec_file=spec_file, workdir=wd, num_replicas=m, min_replicas=1, timeout=30)
    lighthouse = start_lighthouse(job)
    poll_until(
        lambda: "listening" in lighthouse.log_text().lower() or not lighthouse.alive,
        timeout=60,
        what="the lighthouse",
    )
    incarnation = dict.fromkeys(range(m), 0)
    procs = {i: start_replica(job, i, save_global=True) for i in range(m)}

    def kill(i: int) -> None:
        procs[i].kill()
        procs[i].wait()

    def restart(i: int) -> None:
        incarnation[i] += 1
        procs[i] = start_replica(job, i, incarnation=incarnation[i], save_global=True)

    try:

        def committed() -> bool:
            if not lighthouse.alive:
                raise RuntimeError("lighthouse exited:\n" + lighthouse.log_text()[-2000:])
            recs = [read_progress(job.progress_file(i)) for i in range(m)]
            return all(r and r[-1]["commits"] >= 1 for r in recs)

        poll_until(committed, timeout=args.warmup_timeout, what="torchft's first commit")
        t1, t2, kills = run_schedule(schedule, args.restart_delay, args.seconds, kill, restart)
        time.sleep(1.0)
    finally:
        for p in [lighthouse, *procs.values()]:
            p.kill()
    windows = [torchft_replica(job.progress_files(i), t1, t2) for i in range(m)]
    useful = sum(w["useful_tokens"] for w in windows)
    steps = sum(w["steps_per_s"] for w in windows)
    compute = sum(w["utilisation"] for w in windows)  # compute seconds per second
    return {
        "tokens_per_s": useful / (t2 - t1),
        "step_time": compute / steps if steps else float("nan"),
        "loss": latest_global_loss(spec, job, t2),
        "kills": kills,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(__doc__ or "", **TRAINING, **WALL_CLOCK, islands=4, seconds=90)
    p.add_argument(
        "--mtbf", type=float, default=120, help="mean time between failures per island (s)"
    )
    p.add_argument("--restart-delay", type=float, default=5, help="seconds down before restart")
    p.add_argument("--seed", type=int, default=1, help="failure schedule seed")
    p.add_argument("--quorum", type=int, default=0, help="ours' K (default M-1)")
    args = p.parse_args(argv)
    install_signal_cleanup()
    m = args.islands
    schedule = failure_schedule(m, args.mtbf, args.restart_delay, args.seconds, args.seed)
    spec = make_spec(args)
    systems: dict[str, Callable[[Any, Sequence[Failure], Path], dict[str, Any]]] = {
        f"ours K={spec.sync.quorum} of {m}": run_ours
    }
    if not args.skip_torchft:
        systems[f"torchft DiLoCo, {m} replica groups (min 1)"] = run_torchft
    results: dict[tuple[str, str], dict[str, Any]] = {}
    with LoadMonitor() as load, workdir(args.workdir, "goodput") as wd:
        for system, fn in systems.items():
            tag = "ours" if system.startswith("ours") else "torchft"
            for mode, sched in (("failure-free", []), ("failures", schedule)):
                print(f"{system}: {mode}", flush=True)
                results[(system, mode)] = fn(args, sched, wd / f"{tag}-{mode}")
                print(f"  -> {results[(system, mode)]}", flush=True)

    table = Table(
        f"Goodput with islands killed at random ({args.preset}, M={m}, H={args.inner_steps}, "
        f"MTBF {args.mtbf:g}s per island, restart after {args.restart_delay:g}s, "
        f"{args.seconds:.0f}s window)",
        [
            "system",
            "run",
            "kills",
            "useful tokens/s",
            "step time",
            "useful / potential",
            "goodput vs failure-free",
            "raw tokens/s vs failure-free",
            "eval loss at end",
            "vs failure-free",
        ],
    )
    tokens_per_step = args.batch_size * args.seq_len
    goodput: dict[str, float] = {}
    for system in systems:
        for r in (results[(system, "failure-free")], results[(system, "failures")]):
            # What M islands computing all the time at this run's measured step time would merge.
            r["potential"] = m * tokens_per_step / r["step_time"]
            r["share"] = ratio(r["tokens_per_s"], r["potential"])
        base = results[(system, "failure-free")]
        for mode in ("failure-free", "failures"):
            r = results[(system, mode)]
            g = ratio(r["share"], base["share"])
            if mode == "failures":
                goodput[system] = g
            table.add(
                system,
                mode,
                r["kills"],
                f"{r['tokens_per_s']:,.0f}",
                f"{r['step_time'] * 1000:.1f} ms",
                fmt_pct(r["share"]),
                fmt_pct(g),
                fmt_ratio(ratio(r["tokens_per_s"], base["tokens_per_s"]), 3),
                f"{r['loss']:.4f}",
                fmt_ratio(ratio(r["loss"], base["loss"]), 4),
            )
    targets = Table("Targets", ["target", "figure", "verdict"])
    ours_name = next(iter(systems))
    targets.add(
        "ours keeps >= 90% of failure-free goodput (useful / potential tokens)",
        fmt_pct(goodput[ours_name]),
        verdict(goodput[ours_name] >= 0.90),
    )
    if len(goodput) > 1:
        tft = next(v for k, v in goodput.items() if k != ours_name)
        targets.add(
            "ours' goodput >= torchft's",
            f"{fmt_pct(goodput[ours_name])} vs {fmt_pct(tft)}",
            verdict(goodput[ours_name] >= tft),
        )
    notes = [
        "Potential tokens/s = M x batch x seqLen / the mean inner-step time measured in the same "
        "run (ours: the learners' reported step time; torchft: measured compute per step): what M "
        "islands computing without pause would produce. Goodput = (useful / potential) with "
        "failures over the same share without; normalising by each run's own step time keeps "
        "the machine's drifting load out of the ratio. Raw tokens/s ratios are shown beside it.",
        "Failure schedule (s after the window opened: island): "
        + (", ".join(f"{f.at:.0f}:{f.island}" for f in schedule) or "none"),
        "A restarted process pays Python + torch start-up (several seconds on a loaded machine) "
        "before it trains again; that is part of each system's cost.",
        f"Heartbeat timeouts: ours sync.heartbeatTimeoutSeconds = 5, torchft lighthouse 5 s; ours "
        f"merges with K = {spec.sync.quorum}, torchft commits with any replicas left "
        "(min_replica_size 1).",
    ]
    report = Report(
        "goodput",
        "Useful tokens/s with islands killed (SIGKILL) at random and restarted, relative to the "
        "failure-free run of the same system: ours and torchft's DiLoCo.",
        tables=[table, targets],
        notes=notes,
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
