"""Decoupling: one island slowed 2x/3x/5x; how fast do the others still train?

For ours (quorum K = M-1) and torchft's DiLoCo (which syncs every replica group each round), one
island is made a straggler (ours: DILOCO_SLOWDOWN; torchft: the same sleep-after-compute rule in
bench.harness.torchft_worker) and the run is compared with the same system without a straggler,
over a window of W seconds starting at the first completed sync:
- the other islands' inner-step throughput relative to the no-straggler run, measured two ways:
  steps/s, and utilisation (time in inner steps / wall time). On a machine with fewer cores than
  processes a sleeping straggler frees CPU for the others, which inflates their steps/s; the
  utilisation ratio is free of that effect (it only counts time lost waiting), so the target is
  judged on it;
- the eval loss of the global weights at the end of the window (equal wall time), relative to the
  no-straggler run (ours: the syncer's own eval; torchft: the committed global weights saved at
  each commit, evaluated afterwards on the same eval batches).

    python -m bench.decoupling                        # M=4, gpt-tiny, H=20, factors 2 3 5
    python -m bench.decoupling --islands 8 --seconds 120 --factors 3
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco_trainer.api.contract import island_name
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
    plot_file,
    poll_until,
    publish,
    ratio,
    save_figure,
    training_spec,
    verdict,
    workdir,
)
from bench.harness.flags import TRAINING, WALL_CLOCK
from bench.harness.measure import StatusSampler, ours_islands, torchft_replica
from bench.harness.ours_harness import OursRun
from bench.harness.peer_training import read_progress
from bench.harness.torchft_harness import job_of_every_replica, start_job


def make_spec(args: Any, quorum: int) -> JobSpec:
    return training_spec(
        args,
        sync={"quorum": quorum, "compression": args.codec, "heartbeatTimeoutSeconds": 4},
        syncer={"evalEveryOuterSteps": 1},
        eval_tokens=args.eval_tokens,
    )


def run_ours(args: Any, slowdown: float, wd: Path) -> dict[str, Any]:
    m = args.islands
    spec = make_spec(args, quorum=max(1, m - 1))
    slow = m - 1
    run = OursRun(spec=spec, workdir=wd, slowdowns={slow: slowdown} if slowdown > 1 else {})
    try:
        run.start()
        with StatusSampler(run) as sampler:
            sampler.wait_first_merge(args.warmup_timeout)
            t1 = time.time()
            time.sleep(args.seconds)
            t2 = time.time()
            time.sleep(1.5)  # one more heartbeat round and eval
        final = run.status()
    finally:
        run.stop()
    islands = ours_islands(sampler, t1, t2)
    slow_name = island_name(spec.islands.name_prefix, slow)
    others = [w for name, w in islands.items() if name != slow_name]
    evals = [h for h in final.get("evalHistory", []) if h["time"] <= t2]
    return {
        "steps_per_s": sum(w.steps_per_s for w in others) / len(others),
        "utilisation": sum(w.utilisation for w in others) / len(others),
        "loss": float(evals[-1]["evalLoss"]) if evals else float("nan"),
        "outer_steps": evals[-1]["outerStep"] if evals else 0,
    }


def eval_saved(spec: JobSpec, directory: Path, t: float) -> tuple[float, int]:
    """Eval loss of the last global weights a torchft replica committed at or before t."""
    from safetensors.torch import load_model

    entries = [json.loads(line) for line in (directory / "index.jsonl").read_text().splitlines()]
    entries = [e for e in entries if e["time"] <= t]
    if not entries:
        return float("nan"), 0
    parts = build_parts(spec, shard_index=0, num_shards=1, with_train=False)
    load_model(parts.model, str(directory / entries[-1]["file"]))
    return evaluate(parts), int(entries[-1]["outer_step"])


def run_torchft(args: Any, slowdown: float, wd: Path) -> dict[str, Any]:
    m = args.islands
    spec = make_spec(args, quorum=m)
    job = job_of_every_replica(spec, wd, m, slowdowns={m - 1: slowdown} if slowdown > 1 else {})
    lighthouse, replicas = start_job(job, evaluate_replica=None, save_replica=0)
    try:

        def committed() -> bool:
            for p in [lighthouse, *replicas]:
                if not p.alive:
                    raise RuntimeError(f"{p.name} exited:\n{p.log_text()[-2000:]}")
            recs = read_progress(job.progress_file(0))
            return bool(recs and recs[-1]["commits"] >= 1)

        poll_until(committed, timeout=args.warmup_timeout, what="torchft's first commit")
        t1 = time.time()
        time.sleep(args.seconds)
        t2 = time.time()
        time.sleep(1.0)
    finally:
        for p in [lighthouse, *replicas]:
            p.kill()
    others = [torchft_replica(job.progress_files(i), t1, t2) for i in range(m - 1)]
    loss, outer = eval_saved(spec, job.save_dir(0), t2)
    return {
        "steps_per_s": sum(o["steps_per_s"] for o in others) / len(others),
        "utilisation": sum(o["utilisation"] for o in others) / len(others),
        "loss": loss,
        "outer_steps": outer,
    }


def plot(
    results: dict[tuple[str, float], dict[str, Any]], factors: list[float], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for system in dict.fromkeys(s for s, _ in results):
        base = results[(system, 1.0)]["utilisation"]
        xs = [1.0, *factors]
        ax.plot(
            xs,
            [ratio(results[(system, f)]["utilisation"], base) for f in xs],
            marker="o",
            label=system,
        )
    ax.axhline(0.95, color="grey", linestyle=":", label="target 95%")
    ax.set_ylim(0, 1.15)
    ax.set_xlabel("straggler slowdown (x)")
    ax.set_ylabel("others' utilisation / no-straggler run")
    ax.set_title("Other islands' throughput with one straggler")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    # Ours runs at K = M-1 of the --islands.
    p = base_parser(__doc__ or "", **TRAINING, **WALL_CLOCK, islands=4, seconds=40)
    p.add_argument("--factors", nargs="+", type=float, default=[2, 3, 5], help="slowdowns")
    args = p.parse_args(argv)
    install_signal_cleanup()
    m = args.islands
    systems = {f"ours K={m - 1} of {m}": run_ours}
    if not args.skip_torchft:
        systems[f"torchft DiLoCo, {m} replica groups"] = run_torchft
    results: dict[tuple[str, float], dict[str, Any]] = {}
    with LoadMonitor() as load, workdir(args.workdir, "decoupling") as wd:
        for system, fn in systems.items():
            for f in [1.0, *args.factors]:
                print(f"{system}, straggler {f:g}x", flush=True)
                tag = "ours" if system.startswith("ours") else "torchft"
                results[(system, f)] = fn(args, f, wd / f"{tag}-x{f:g}")
                print(f"  -> {results[(system, f)]}", flush=True)

    table = Table(
        f"Other islands with one straggler ({args.preset}, M={m}, H={args.inner_steps}, "
        f"{args.seconds:.0f}s window from the first sync)",
        [
            "system",
            "straggler",
            "others' steps/s",
            "vs no straggler",
            "others' utilisation",
            "vs no straggler",
            "eval loss at end of window",
            "vs no straggler",
            "outer steps",
        ],
    )
    targets = Table("Targets", ["target", "figure", "verdict"])
    for system in systems:
        base = results[(system, 1.0)]
        for f in [1.0, *args.factors]:
            r = results[(system, f)]
            table.add(
                system,
                "none" if f == 1.0 else f"{f:g}x slower",
                f"{r['steps_per_s']:.2f}",
                fmt_ratio(ratio(r["steps_per_s"], base["steps_per_s"])),
                fmt_pct(r["utilisation"]),
                fmt_ratio(ratio(r["utilisation"], base["utilisation"])),
                f"{r['loss']:.4f}",
                fmt_ratio(ratio(r["loss"], base["loss"]), 4),
                r["outer_steps"],
            )
        if system.startswith("ours") and 3.0 in args.factors:
            kept = ratio(results[(system, 3.0)]["utilisation"], base["utilisation"])
            targets.add(
                "one island 3x slower, K=M-1: others keep >= 95% of their throughput",
                fmt_pct(kept),
                verdict(kept >= 0.95),
            )
    plot_path = plot_file(args, "decoupling")
    plot(results, list(args.factors), plot_path)
    notes = [
        f"The straggler is island {m - 1}; 'others' averages the remaining {m - 1} islands.",
        "Utilisation = inner steps x the learner's step time / wall time (ours) or measured "
        "compute time / wall time (torchft): the share of the window the others spent training, "
        "not waiting for a sync.",
        f"{m} learners (+ syncer or lighthouse) share this machine's cores: a sleeping straggler "
        "gives the others more CPU, so steps/s ratios above 1.0 are CPU-share effects.",
    ]
    report = Report(
        "decoupling",
        "Inner-step throughput of the other islands and loss at equal wall time when one island "
        "is 2x/3x/5x slower: ours (K = M-1) and torchft's DiLoCo.",
        tables=[table, targets] if targets.rows else [table],
        notes=notes,
        plots=[plot_path],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
