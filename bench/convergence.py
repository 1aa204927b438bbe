"""Convergence and bytes: ours against synchronous data-parallel, torch DDP and torchft's DiLoCo.

One model, data and token budget (M workers x S inner steps x batch x seqLen tokens), trained by:
(a) one process with synchronous data-parallel semantics over M simulated workers (the baseline,
    diloco_trainer.models.reference.train_synchronous);
(b) plain torch DDP, gloo, M real processes on loopback (bench.harness.ddp_worker);
(c) torchft 0.2.0's DiLoCo: lighthouse + M replica groups, same H and optimizers
    (bench.harness.torchft_worker);
(d) ours: a syncer + M islands as processes, quorum K = M and K = M-1, codecs none/int8/int4.

Reported: eval loss (same held-out batches for all) and its ratio to (a); bytes sent per worker
(ours: the syncer's bytesIn / M, i.e. what islands pushed; DDP: gradient-bucket bytes counted in a
comm hook x 2(M-1)/M for a ring; torchft: bytes handed to Manager.allreduce x 2(M-1)/M); wall time
from launch to the last process's exit (process start-up included) and its ratio to (a).

    python -m bench.convergence                       # gpt-tiny, M=4, H=100, 6 outer steps
    python -m bench.convergence --preset gpt-mini --outer-steps 20 --inner-steps 200
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.local import free_port
from diloco_trainer.models.reference import train_synchronous

from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_bytes,
    fmt_pct,
    fmt_ratio,
    install_signal_cleanup,
    plot_file,
    publish,
    ratio,
    save_figure,
    start_module,
    verdict,
    wait_all,
    workdir,
)
from bench.harness.flags import INNER_OPTIMIZER, TRAINING, inner_section
from bench.harness.ours_harness import OursRun
from bench.harness.torchft_harness import job_of_every_replica, read_result, start_job

CODECS = ("none", "int8", "int4")


def make_spec(args: Any, *, quorum: int, codec: str = "none") -> JobSpec:
    """The job every variant trains (camelCase, as a manifest would say it)."""
    return parse_spec(
        {
            "model": {"preset": args.preset, "seed": 0},
            "data": {"source": "builtin:stdlib-text", "evalTokens": args.eval_tokens, "seed": 0},
            "islands": {"count": args.islands},
            "inner": inner_section(args),
            "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
            "sync": {"quorum": quorum, "compression": codec, "merge": args.merge},
            "stopAfter": {"outerSteps": args.outer_steps},
            "syncer": {"evalEveryOuterSteps": 1},
        }
    )


def run_reference(spec: JobSpec, m: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # as every worker process of the other variants
    t0 = time.perf_counter()
    out = train_synchronous(spec, num_workers=m, total_steps=steps)
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def run_ddp(spec: JobSpec, m: int, steps: int, wd: Path) -> dict[str, Any]:
    import json

    wd.mkdir(parents=True, exist_ok=True)
    spec_file = wd / "spec.json"
    spec_file.write_text(spec.to_json())
    port = free_port()
    out = wd / "ddp.json"
    t0 = time.perf_counter()
    procs = [
        start_module(
            f"ddp-rank{r}",
            "bench.harness.ddp_worker",
            ["--spec", str(spec_file), "--steps", str(steps), "--out", str(out)],
            env={
                "RANK": str(r),
                "WORLD_SIZE": str(m),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            },
            log_file=wd / f"ddp-rank{r}.log",
        )
        for r in range(m)
    ]
    wait_all(procs, timeout=3600)
    result = json.loads(out.read_text())
    result["wall_seconds"] = time.perf_counter() - t0
    return result


def run_torchft(spec: JobSpec, m: int, wd: Path) -> dict[str, Any]:
    job = job_of_every_replica(spec, wd, m, outer_steps=spec.stop_after.outer_steps or 1)
    t0 = time.perf_counter()
    lighthouse, replicas = start_job(job)
    try:
        wait_all(replicas, timeout=3600)
    finally:
        lighthouse.kill()
    results = [read_result(job, i) for i in range(m)]
    return {
        "eval_loss": results[0]["eval_loss"],
        "bytes_per_worker": sum(float(r["bytes_per_worker"]) for r in results) / m,
        "tokens": sum(int(r["useful_tokens"]) for r in results),
        "outer_steps": results[0]["outer_steps"],
        "wall_seconds": time.perf_counter() - t0,
    }


def run_ours(spec: JobSpec, wd: Path) -> dict[str, Any]:
    run = OursRun(spec=spec, workdir=wd)
    t0 = time.perf_counter()
    run.start()
    try:
        st = run.wait_finished(timeout=3600)
        for proc in run.learners.values():
            proc.wait(120)  # learners exit 0 once they see finished=true
        wall = time.perf_counter() - t0
    finally:
        run.stop()
    m = spec.islands.count
    return {
        "eval_loss": float(st["evalLoss"]),
        "bytes_per_worker": float(st["bytesIn"]) / m,
        "bytes_pulled_per_worker": float(st["bytesOut"]) / m,
        "tokens": int(st["tokens"]),
        "outer_steps": int(st["outerStep"]),
        "wall_seconds": wall,
        "history": st.get("evalHistory", []),
    }


def plot(
    ours: dict[str, dict[str, Any]], finals: dict[str, tuple[float, float]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, r in ours.items():
        hist = r["history"]
        ax.plot([h["tokens"] for h in hist], [h["evalLoss"] for h in hist], marker=".", label=label)
    for (label, (tokens, loss)), marker in zip(finals.items(), "s^v", strict=False):
        ax.scatter([tokens], [loss], marker=marker, s=70, zorder=5, label=f"{label} (final)")
    ax.set_xlabel("tokens merged / trained")
    ax.set_ylabel("eval loss")
    ax.set_title("Eval loss against tokens (same data, model and budget)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(
        __doc__ or "",
        **TRAINING,
        **INNER_OPTIMIZER,
        islands=4,
        inner_steps=100,
        eval_tokens=8192,
    )
    p.add_argument("--outer-steps", type=int, default=6, help="rounds: S = outer x H steps")
    p.add_argument("--merge", default="tokens", choices=["tokens", "mean", "rda"])
    p.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    p.add_argument("--skip", nargs="*", default=[], choices=["ddp", "torchft", "k-1"])
    args = p.parse_args(argv)
    install_signal_cleanup()
    m = args.islands
    steps = args.inner_steps * args.outer_steps
    base_spec = make_spec(args, quorum=m)
    rows: list[tuple[str, dict[str, Any]]] = []
    ours: dict[str, dict[str, Any]] = {}

    with LoadMonitor() as load, workdir(args.workdir, "convergence") as wd:
        print(f"(a) synchronous data-parallel reference, {m} simulated workers, {steps} steps")
        ref = run_reference(base_spec, m, steps)
        rows.append(("(a) synchronous DP, 1 process (baseline)", ref))
        if "ddp" not in args.skip:
            print(f"(b) torch DDP, gloo, {m} processes")
            rows.append(
                (f"(b) torch DDP gloo, {m} processes", run_ddp(base_spec, m, steps, wd / "ddp"))
            )
        if "torchft" not in args.skip:
            print(f"(c) torchft DiLoCo, {m} replica groups")
            tft = run_torchft(base_spec, m, wd / "torchft")
            rows.append((f"(c) torchft DiLoCo, {m} replica groups", tft))
        quorums = [m] if "k-1" in args.skip or m < 2 else [m, m - 1]
        for k in quorums:
            for codec in args.codecs:
                label = f"(d) ours K={k} of M={m}, {codec}"
                print(label)
                r = run_ours(make_spec(args, quorum=k, codec=codec), wd / f"ours-k{k}-{codec}")
                rows.append((label, r))
                ours[f"ours K={k} {codec}"] = r

    ddp = next((r for label, r in rows if label.startswith("(b)")), None)
    ddp_bytes = float(ddp["bytes_per_worker"]) if ddp else float(ref["bytes_per_worker"])
    table = Table(
        f"Convergence at equal token budget ({args.preset}, M={m}, H={args.inner_steps}, "
        f"{args.outer_steps} outer steps)",
        [
            "variant",
            "eval loss",
            "loss / (a)",
            "bytes sent / worker",
            "fewer bytes than DDP",
            "tokens",
            "wall",
            "wall / (a)",
        ],
    )
    for label, r in rows:
        b = float(r["bytes_per_worker"])
        table.add(
            label,
            f"{r['eval_loss']:.4f}",
            fmt_ratio(ratio(r["eval_loss"], ref["eval_loss"]), 4),
            fmt_bytes(b),
            "—" if b == 0 else f"{ddp_bytes / b:.0f}x",
            f"{int(r['tokens']):,}",
            f"{r['wall_seconds']:.0f}s",
            fmt_ratio(ratio(r["wall_seconds"], ref["wall_seconds"]), 2),
        )

    targets = Table("Targets", ["target", "figure", "verdict"])
    km = {c: ours.get(f"ours K={m} {c}") for c in args.codecs}
    if km.get("none"):
        lr = ratio(km["none"]["eval_loss"], ref["eval_loss"])
        fewer = ddp_bytes / float(km["none"]["bytes_per_worker"])
        targets.add(
            "ours K=M (none): eval loss within 2% of (a)", fmt_ratio(lr, 4), verdict(lr <= 1.02)
        )
        targets.add(
            "ours K=M (none): >= 100x fewer bytes than DDP", f"{fewer:.0f}x", verdict(fewer >= 100)
        )
        for codec, extra_bytes in (("int8", 4), ("int4", 8)):
            r = km.get(codec)
            if not r:
                continue
            extra = ratio(r["eval_loss"], km["none"]["eval_loss"]) - 1
            shrink = float(km["none"]["bytes_per_worker"]) / float(r["bytes_per_worker"])
            targets.add(
                f"{codec} adds <= 1% eval loss (vs none, K=M)",
                fmt_pct(extra, 2),
                verdict(extra <= 0.01),
            )
            targets.add(
                f"{codec} sends >= {extra_bytes}x fewer bytes than none",
                f"{shrink:.1f}x",
                verdict(shrink >= extra_bytes),
            )

    plot_path = plot_file(args, "convergence")
    finals = {
        label.split(",")[0]: (float(r["tokens"]), float(r["eval_loss"]))
        for label, r in rows
        if not label.startswith("(d)")
    }
    plot(ours, finals, plot_path)
    notes = [
        f"Initial eval loss {ref['initial_eval_loss']:.4f}; token budget {m} x {steps} steps x "
        f"{args.batch_size} x {args.seq_len} = {int(ref['tokens']):,} tokens.",
        "Tokens for ours are the tokens merged by the syncer (token-weighted); for torchft the "
        "tokens of committed rounds. With K < M a merge may close before every island reported, so "
        "ours can stop with fewer tokens merged than the budget.",
        "Bytes for ours count only what islands push (the syncer's bytesIn); pulls of the new "
        "weights (bytesOut) are the same size again for every codec (fp32).",
        "DDP's all-reduce bytes are counted in a comm hook; the ring factor 2(M-1)/M turns payload "
        "into bytes sent per worker (gloo's actual algorithm may differ).",
        "One intra-op thread per process; every process shares this machine's cores, so wall times "
        "are only comparable within this run.",
    ]
    report = Report(
        "convergence",
        "Eval loss, bytes and wall time at an equal token budget: synchronous data-parallel "
        "(baseline), torch DDP, torchft DiLoCo and ours.",
        tables=[table, targets],
        notes=notes,
        plots=[plot_path],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
