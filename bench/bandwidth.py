"""Bandwidth: compute utilisation of ours and torchft's DiLoCo over a slow link (1/10/100 Mbit/s).

Ours: every island reaches the syncer through one rate-limiting relay (bench.harness.relay: token
bucket, one bucket for both directions, plus an added one-way latency), so all sync traffic shares
one link of the given rate. torchft: its gloo ring connects replicas directly (addresses exchanged
through a store), which no relay can sit in; instead the lighthouse and every replica run in a
network namespace whose loopback is limited to the same rate with tc tbf (bench.harness.netns). The
kernel here has no netem, so torchft's link gets the rate but not the added latency.

For each system, link and overlap setting, training is measured over a window that opens after
the first sync and lasts at least --seconds and --rounds further syncs, and we report
- compute utilisation = time in inner steps / wall time over the window (ours: inner steps x the
  learner's step time; torchft: measured compute time, sync excluded);
- that utilisation relative to the same system over an unlimited link in this run.
Inner steps/s are printed for context only: runs follow each other, and on a shared machine the
CPU share (hence the step rate) drifts between them; utilisation is a share of each run's own time.
Both systems use the same model, H, batch and optimizers; ours pushes int8 or fp32 pseudo-gradients
and pulls the merged weights as updates in the same codec (sync.pullCompression auto), torchft
all-reduces fp32 (its quantisation needs triton/GPU).

    python -m bench.bandwidth                          # M=2, gpt-tiny, H=20, 1/10/100 Mbit/s
    python -m bench.bandwidth --rates 1 10 100 1000 --seconds 60 --islands 4
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local import Proc, free_port

from bench.harness import netns
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
    start_module,
    training_spec,
    workdir,
)
from bench.harness.flags import TRAINING
from bench.harness.measure import StatusSampler, ours_islands, torchft_replica
from bench.harness.ours_harness import OursRun
from bench.harness.peer_training import read_progress
from bench.harness.torchft_harness import TorchftJob, start_job


@dataclass(frozen=True)
class Variant:
    system: str  # "ours" | "torchft"
    codec: str  # ours only
    overlap: int  # τ: inner steps that overlap the sync

    @property
    def label(self) -> str:
        if self.system == "ours":
            return f"ours {self.codec}, τ={self.overlap}"
        return f"torchft fp32, τ={self.overlap}"


def make_spec(args: Any, *, codec: str, overlap: int) -> JobSpec:
    return training_spec(
        args,
        sync={
            "quorum": args.islands,
            "compression": codec,
            "overlapSteps": overlap,
            # Heartbeats every second: the status then tracks each island's step closely.
            "heartbeatTimeoutSeconds": 4,
        },
        # No stop: the window is timed; eval only rarely (it competes for the CPU).
        syncer={"evalEveryOuterSteps": 1000},
        eval_tokens=2048,
    )


def start_relay(
    wd: Path, target_port: int, rate: float | None, latency_ms: float
) -> tuple[Proc, int]:
    port = free_port()
    args = ["--listen", str(port), "--target", f"127.0.0.1:{target_port}", "--duplex", "shared"]
    args += ["--rate-mbit", str(rate or 0), "--latency-ms", str(latency_ms)]
    args += ["--stats", str(wd / "relay-stats.json")]
    proc = start_module("relay", "bench.harness.relay", args, log_file=wd / "relay.log")
    poll_until(lambda: "listening" in proc.log_text() or not proc.alive, timeout=60, what="relay")
    if not proc.alive:
        raise RuntimeError("relay exited:\n" + proc.log_text()[-2000:])
    return proc, port


def measure_ours(args: Any, v: Variant, rate: float | None, wd: Path) -> dict[str, float]:
    spec = make_spec(args, codec=v.codec, overlap=v.overlap)
    relay: dict[str, Any] = {}

    def route(_i: int, url: str) -> str:
        if not relay:
            target = int(url.rsplit(":", 1)[1])
            relay["proc"], relay["port"] = start_relay(wd, target, rate, args.latency_ms)
        return f"http://127.0.0.1:{relay['port']}"

    run = OursRun(spec=spec, workdir=wd, route=route)
    try:
        run.start()
        with StatusSampler(run) as sampler:
            sampler.wait_first_merge(args.warmup_timeout)
            t1 = time.time()
            start_step = sampler.latest()["outerStep"]  # type: ignore[index]
            poll_until(
                lambda: (
                    time.time() >= t1 + args.seconds
                    and sampler.latest()["outerStep"] >= start_step + args.rounds
                ),  # type: ignore[index]
                timeout=args.window_timeout,
                interval=0.25,
                what=f"{args.rounds} more merges",
            )
            t2 = time.time()
    finally:
        run.stop()
        if relay:
            relay["proc"].stop()
    islands = ours_islands(sampler, t1, t2).values()
    return {
        "utilisation": statistics.mean(w.utilisation for w in islands),
        "steps_per_s": sum(w.steps_per_s for w in islands),
    }


def measure_torchft(args: Any, v: Variant, rate: float | None, wd: Path) -> dict[str, float]:
    spec_file = wd / "spec.json"
    wd.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(make_spec(args, codec="none", overlap=v.overlap).to_json())
    with netns.shaped_namespace("bw", rate) as prefix:
        job = TorchftJob(
            spec_file=spec_file,
            workdir=wd,
            num_replicas=args.islands,
            min_replicas=args.islands,
            sync_delay=v.overlap,
            timeout=300,
            prefix=prefix,
        )
        lighthouse, replicas = start_job(job, evaluate_replica=None)
        procs = [lighthouse, *replicas]
        try:

            def committed() -> bool:
                for p in procs:
                    if not p.alive:
                        raise RuntimeError(f"{p.name} exited:\n{p.log_text()[-2000:]}")
                recs = [read_progress(job.progress_file(i)) for i in range(args.islands)]
                return all(r and r[-1]["commits"] >= 1 for r in recs)

            poll_until(committed, timeout=args.warmup_timeout, what="torchft's first commit")
            t1 = time.time()
            start = read_progress(job.progress_file(0))[-1]["commits"]
            poll_until(
                lambda: (
                    time.time() >= t1 + args.seconds
                    and read_progress(job.progress_file(0))[-1]["commits"] >= start + args.rounds
                ),
                timeout=args.window_timeout,
                interval=0.25,
                what=f"{args.rounds} more commits",
            )
            t2 = time.time()
        finally:
            for p in procs:
                p.kill()
    reps = [torchft_replica([job.progress_file(i)], t1, t2) for i in range(args.islands)]
    return {
        "utilisation": statistics.mean(r["utilisation"] for r in reps),
        "steps_per_s": sum(r["steps_per_s"] for r in reps),
    }


def plot(
    results: dict[tuple[str, float | None], dict[str, float]], rates: list[float], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = list(dict.fromkeys(label for label, _ in results))
    for label in labels:
        xs = [r for r in rates if (label, r) in results]
        ax.plot(xs, [results[(label, r)]["utilisation"] for r in xs], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel("compute utilisation")
    ax.set_title("Time in inner steps / wall time over a rate-limited link")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    # --seconds: the shortest measured window (it grows to hold --rounds syncs).
    p = base_parser(
        __doc__ or "", **TRAINING, islands=2, inner_steps=20, seconds=20, warmup_timeout=300
    )
    p.add_argument("--rates", nargs="+", type=float, default=[1, 10, 100], help="Mbit/s")
    p.add_argument("--latency-ms", type=float, default=10, help="one-way latency (ours)")
    p.add_argument("--rounds", type=int, default=3, help="fewest syncs in a measured window")
    p.add_argument("--window-timeout", type=float, default=300, help="longest window")
    p.add_argument(
        "--overlap", type=int, default=None, help="τ for the overlapped variants (default H/2)"
    )
    p.add_argument("--skip", nargs="*", default=[], choices=["torchft", "overlap"])
    p.add_argument("--with-none", action="store_true", help="also ours with fp32 pushes")
    args = p.parse_args(argv)
    install_signal_cleanup()
    tau = args.overlap if args.overlap is not None else args.inner_steps // 2
    variants = [Variant("ours", "int8", 0)]
    if args.with_none:
        variants.insert(0, Variant("ours", "none", 0))
    if "overlap" not in args.skip:
        variants.append(Variant("ours", "int8", tau))
    notes: list[str] = []
    why = netns.unavailable_reason() if "torchft" not in args.skip else "skipped by flag"
    if why is None:
        variants.append(Variant("torchft", "none", 0))
        if "overlap" not in args.skip:
            variants.append(Variant("torchft", "none", tau))
    else:
        notes.append(f"torchft not measured: {why}.")

    links: list[float | None] = [None, *args.rates]
    results: dict[tuple[str, float | None], dict[str, float]] = {}
    with LoadMonitor() as load, workdir(args.workdir, "bandwidth") as wd:
        for v in variants:
            for rate in links:
                name = f"{v.system}-{v.codec}-tau{v.overlap}-{rate or 'unlimited'}"
                print(f"{v.label} @ {rate or 'unlimited'} Mbit/s", flush=True)
                measure = measure_ours if v.system == "ours" else measure_torchft
                results[(v.label, rate)] = measure(args, v, rate, wd / name)
                print(f"  -> {results[(v.label, rate)]}", flush=True)

    table = Table(
        f"Compute utilisation over a rate-limited link ({args.preset}, M={args.islands}, "
        f"H={args.inner_steps}; windows of >= {args.seconds:.0f}s and >= {args.rounds} syncs)",
        ["system", "link", "compute utilisation", "vs unlimited link", "inner steps/s (all)"],
    )
    for v in variants:
        base = results[(v.label, None)]["utilisation"]
        for rate in links:
            r = results[(v.label, rate)]
            table.add(
                v.label,
                "unlimited" if rate is None else f"{rate:g} Mbit/s",
                fmt_pct(r["utilisation"]),
                fmt_ratio(ratio(r["utilisation"], base)),
                f"{r['steps_per_s']:.1f}",
            )
    plot_path = plot_file(args, "bandwidth")
    plot(results, list(args.rates), plot_path)
    notes += [
        "All sync traffic of a run shares one link of the given rate, both directions together "
        "(ours: one relay in front of the syncer with a single token bucket; torchft: tbf on the "
        "loopback of its own network namespace).",
        f"Ours' relay adds {args.latency_ms:g} ms one-way latency; torchft's link has none added "
        "(no netem in this kernel), which favours torchft slightly.",
        "Ours' traffic goes through the syncer's link: each island pushes Δ and pulls the "
        "merged weights (as encoded updates with sync.pullCompression auto, the default; full "
        "weights after a join or when a learner is too far behind), so the shared link carries "
        "M pushes + M pulls per round.",
        "τ = inner steps that keep running while a sync is in flight (ours: sync.overlapSteps; "
        "torchft: DiLoCo fragment_sync_delay).",
        "Inner steps/s (summed over islands) is context only: the runs follow each other and the "
        "machine's load, hence each run's CPU share, drifts between them.",
    ]
    report = Report(
        "bandwidth",
        "Compute utilisation (time in inner steps / wall time) of ours and torchft's DiLoCo with "
        "the sync traffic limited to 1, 10 and 100 Mbit/s.",
        tables=[table],
        notes=notes,
        plots=[plot_path],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
