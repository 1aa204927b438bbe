"""The learner inside a real job against a plain torch loop: what DiLoCo costs on the step path
once pushes, pulls and the mixing of merged fragments run beside the inner steps.

bench/learner_step times the inner step alone. This runs a real one-island job (`diloco run`: a
syncer process on the CPU, one learner on --device, int8 pushes and pulls of 2 streamed
fragments, the job defaults otherwise) and reads the learner's own progress lines, which it
writes every 20 steps, so each window holds everything the learner does between two steps:
encoding and sending pushes, receiving pulls, mixing merged fragments in. The baseline is a plain
loop (bench/learner_step's) of the same model, batch and precision in this process: plain, job,
plain, job, ..., plain (--rounds jobs), each job compared with the plain blocks either side of
it, and each pair of neighbouring plain blocks an A/A control of the same run.

Two clocks, both reported:
- wall: tokens over the learner's windows' wall time against the plain block's. It includes
  everything (waits for the syncer too), and on a machine shared with other work it also says
  how loaded the machine was at each moment (last session's A/A runs gave 0.098 and 0.875 here).
- CPU: tokens per CPU second of the learner's process (time.process_time over each window, as
  the learner logs it: its intra-op threads and the syncer link's background threads
  included; the syncer's own process, which runs elsewhere in a real job, left out) against
  tokens per CPU second of this process over a plain block. Other processes' load does not
  enter it, except through what contention costs a thread (caches, migrations); waits for the
  syncer cost no CPU, so the wall split below is what shows them.
--control puts the plain loop's own 20-step windows in the job's place (an A/A run).
--baseline windows runs each plain block over the job's own steps and reads it in the same
steady windows, so both sides cover the same step range of a freshly built model (a fresh
60-step block against a 160-step job's steps 40-140 is not); --syncer-cpus puts the job's
syncer on CPUs of its own (DILOCO_SYNCER_CPUS) and the learner and the plain loop on the rest,
as in a cluster where the syncer has a pod: on a 2-core machine its merges otherwise run on the
cores the learner steps on, which the plain loop never has beside it.
--plain-process runs each plain block in a fresh process, as the learner is in each job: built
one after another in this process, a gpt-125m plain loop on a CPU ran 6% slower each block.

The learner also splits each window's wall time (learner/step_costs.py): its inner steps, the
DiLoCo work on its training thread (the sync path), and waiting for the syncer. Those shares are
measured within the same windows, so a machine whose speed drifts between the plain loop's runs
does not move them; the merge waits are listed beside the time the τ steps before each took.

    python -m bench.learner_overlap                                  # CPU, gpt-tiny
    python -m bench.learner_overlap --preset gpt-mini --batch-size 16 --seq-len 128  # CPU
    python -m bench.learner_overlap --preset gpt-mini --batch-size 16 --seq-len 128 --control
    python -m bench.learner_overlap --preset gpt-mini --batch-size 16 --seq-len 128 \
        --outer-steps 4 --rounds 6 --baseline windows --plain-process --syncer-cpus 1  # CPU
    python -m bench.learner_overlap --device cuda --preset gpt-125m --precision bf16 \
        --batch-size 16 --seq-len 1024 --inner-steps 40 --outer-steps 8

Torch-only besides the trainer: it runs on a GPU machine with the trainer alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.api.contract import SYNCER_CPUS, format_cpu_list, parse_cpu_list

from bench.learner_step import bench_main, make_spec, model_arguments, plain_side

WINDOW = re.compile(r"\((\d+) tokens/s\)")
# The learner's split of each window (learner/step_costs.WindowCosts), and its process's CPU
# seconds over the window (absent in logs from before the learner wrote it).
COSTS = re.compile(
    r"\((\d+) tokens/s\); (\d+) steps: ([\d.]+)s training, ([\d.]+)s sync path, "
    r"([\d.]+)s waiting for the syncer(?:; ([\d.]+)s cpu)?"
)
# A blocking learner's wait for the merge of its push, and how long its τ steps since it took.
MERGE_WAIT = re.compile(
    r"waited ([\d.]+)s for fragment \d+ "
    r"\(the (\d+) overlapped steps since its push took ([\d.]+)s\)"
)


def job_yaml(args: argparse.Namespace) -> str:
    return f"""model: {{preset: {args.preset}, seed: 0}}
data: {{evalTokens: 2048}}
islands: {{count: 1}}
inner:
  steps: {args.inner_steps}
  batchSize: {args.batch_size}
  microBatches: {args.micro_batches}
  seqLen: {args.seq_len}
  precision: {args.precision}
  compile: {str(args.compile).lower()}
  warmupSteps: 0
sync:
  quorum: 1
  fragments: 2
  compression: int8
  mergeWait: {args.merge_wait}
  overlapMode: {args.overlap_mode}
stopAfter: {{outerSteps: {args.outer_steps}}}
syncer:
  evalEveryOuterSteps: {args.outer_steps}
  checkpoint: {{everyOuterSteps: 1000}}
"""


def job_windows(args: argparse.Namespace, workdir: Path) -> tuple[list[float], float, str]:
    """Run the job; (the learner's tokens/s windows, the job's wall seconds, its log)."""
    config = workdir / "job.yaml"
    config.write_text(job_yaml(args))
    env = dict(os.environ, DILOCO_DEVICE=args.device)
    if args.syncer_cpus:
        env[SYNCER_CPUS] = args.syncer_cpus
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "diloco_trainer.cli",
            "run",
            str(config),
            "--quiet",
            "--workdir",
            str(workdir / "run"),
        ],
        env=env,
        timeout=args.job_timeout,
        check=False,
    )
    wall = time.perf_counter() - start
    log = workdir / "run" / "logs" / "island-0-rank0.log"
    if args.logs is not None and log.exists():
        args.logs.mkdir(parents=True, exist_ok=True)
        shutil.copy(log, args.logs / f"{workdir.name}-{log.name}")  # one per round
    if done.returncode != 0:
        tail = log.read_text()[-3000:] if log.exists() else "(no learner log)"
        raise SystemExit(f"the job exited {done.returncode}; learner log tail:\n{tail}")
    text = log.read_text()
    return [float(m.group(1)) for m in WINDOW.finditer(text)], wall, text


def steady(rows: list[Any], args: argparse.Namespace) -> list[Any]:
    """The windows left after the start-up (--skip-windows: the first pull, allocator warm-up)
    and the last --drop-last (the job's end may fall in them)."""
    return rows[args.skip_windows : len(rows) - args.drop_last]


def split_of(text: str, args: argparse.Namespace) -> dict[str, Any]:
    """Where the learner's steady windows' wall time went (seconds summed over them), its CPU
    seconds over them, and each wait for a merge against the time its overlapped steps took."""
    rows = [
        tuple(float(g) if g is not None else float("nan") for g in m.groups()[1:])
        for m in COSTS.finditer(text)
    ]
    kept = steady(rows, args)
    steps, training, sync_path, waiting, cpu = (sum(r[i] for r in kept) for i in range(5))
    waits = [(float(m.group(1)), float(m.group(3))) for m in MERGE_WAIT.finditer(text)]
    return {
        "steps": int(steps),
        "training_s": training,
        "sync_path_s": sync_path,
        "waiting_s": waiting,
        "cpu_s": cpu,
        # Shares of the learner's own wall time, both sides measured in the same windows.
        "training_share": training / max(training + sync_path + waiting, 1e-9),
        "step_path_share": training / max(training + sync_path, 1e-9),
        "merge_waits_s": [w for w, _ in waits],
        "overlap_s": [o for _, o in waits],
    }


def timed(step: Any, steps: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) for `steps` calls of `step`."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return time.perf_counter() - wall, time.process_time() - cpu


@contextlib.contextmanager
def plain_cpus(args: argparse.Namespace) -> Iterator[None]:
    """With --syncer-cpus: this process on the learner's CPUs (every other one) and, on a CPU,
    with as many intra-op threads, as `diloco run` gives its one learner; else as it is."""
    if not args.syncer_cpus:
        yield
        return
    mine, threads = frozenset(os.sched_getaffinity(0)), torch.get_num_threads()
    learner = mine - parse_cpu_list(args.syncer_cpus, SYNCER_CPUS)
    if not learner:
        raise SystemExit(
            f"--syncer-cpus {args.syncer_cpus} leaves no CPU of {format_cpu_list(mine)}"
        )
    os.sched_setaffinity(0, learner)
    if args.device == "cpu":
        torch.set_num_threads(len(learner))
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(threads)


def plain_block(args: argparse.Namespace) -> dict[str, float]:
    """The plain loop, freshly built: tokens/s over wall time and tokens per CPU second of this
    process (every thread of it) over --plain-steps steps after --warmup untimed ones."""
    spec = make_spec(args)
    with plain_cpus(args):
        step = plain_side(spec, args.device)
        for _ in range(args.warmup):
            step()
        wall, cpu = timed(step, args.plain_steps)
        del step
    tokens = args.plain_steps * spec.inner.tokens_per_step
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu,
    }


def control_windows(args: argparse.Namespace) -> dict[str, Any]:
    """--control: the plain loop's own 20-step windows in the job's place, read as the job's
    are (an A/A run: the ratio's noise floor on this machine)."""
    spec = make_spec(args)
    with plain_cpus(args):
        step = plain_side(spec, args.device)
        for _ in range(args.warmup):
            step()
        rows = [timed(step, 20) for _ in range(args.inner_steps * args.outer_steps // 20)]
    tokens = 20 * spec.inner.tokens_per_step
    kept = steady(rows, args)
    return {
        "windows_tokens_per_s": [tokens / wall for wall, _ in rows],
        "tokens_per_s": len(kept) * tokens / sum(w for w, _ in kept),
        "tokens_per_cpu_s": len(kept) * tokens / sum(c for _, c in kept),
        "wall_s": 0.0,
        "split": None,
    }


def baseline_block(args: argparse.Namespace) -> dict[str, Any]:
    """One plain block of the kind --baseline names, in this process."""
    return plain_block(args) if args.baseline == "block" else control_windows(args)


def plain_side_block(args: argparse.Namespace) -> dict[str, Any]:
    """One plain block: in this process, or with --plain-process in a fresh one, as the
    learner is in each job (a gpt-125m plain loop on a CPU slowed 6% a block over four blocks
    built in one long-lived process)."""
    if not args.plain_process:
        return baseline_block(args)
    with tempfile.TemporaryDirectory(prefix="learner-overlap-plain-") as tmp:
        out = Path(tmp) / "plain.json"
        argv = [a for a in args.argv if a != "--plain-process"]
        cmd = [sys.executable, "-m", "bench.learner_overlap", *argv, "--plain-block-json", str(out)]
        done = subprocess.run(cmd, timeout=args.job_timeout, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the plain block's process exited {done.returncode}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def job_side(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The learner inside a real job, over its steady windows: tokens/s over wall time, tokens
    per CPU second of the learner's process, and its own split of the wall time."""
    windows, wall, text = job_windows(args, workdir)
    split = split_of(text, args)
    if not split["steps"]:
        raise SystemExit(
            f"only {len(windows)} progress windows in the learner's log: raise --outer-steps or "
            "--inner-steps, or lower --skip-windows / --drop-last (a window is 20 steps)"
        )
    tokens = split["steps"] * make_spec(args).inner.tokens_per_step
    wall_s = split["training_s"] + split["sync_path_s"] + split["waiting_s"]
    return {
        "windows_tokens_per_s": windows,
        "tokens_per_s": tokens / wall_s,
        "tokens_per_cpu_s": tokens / split["cpu_s"],
        "wall_s": wall,
        "split": split,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Plain, job, plain, job, ..., plain (--rounds jobs): each job is compared with the plain
    blocks either side of it, on both clocks, and each pair of neighbouring plain blocks is an
    A/A control of the same run (how far the machine moved between them)."""
    plains, jobs = [plain_side_block(args)], []
    with tempfile.TemporaryDirectory(prefix="learner-overlap-") as tmp:
        for r in range(args.rounds):
            if args.control:
                jobs.append(control_windows(args))
            else:
                workdir = Path(tmp) / f"round-{r}"
                workdir.mkdir()
                jobs.append(job_side(args, workdir))
            plains.append(plain_side_block(args))
    rounds = []
    for r, job in enumerate(jobs):
        before, after = plains[r], plains[r + 1]
        row: dict[str, Any] = {"job": job, "plain_before": before, "plain_after": after}
        for clock in ("tokens_per_s", "tokens_per_cpu_s"):
            row[f"ratio_{clock}"] = job[clock] / ((before[clock] + after[clock]) / 2)
            row[f"aa_{clock}"] = after[clock] / before[clock]
        rounds.append(row)
    return {
        "summary": summary(plains, jobs, rounds),
        "preset": args.preset,
        "device": args.device,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "micro_batches": args.micro_batches,
        "seq_len": args.seq_len,
        "inner_steps": args.inner_steps,
        "outer_steps": args.outer_steps,
        "plain_steps": args.plain_steps,
        "merge_wait": args.merge_wait,
        "overlap_mode": args.overlap_mode,
        "control": args.control,
        "syncer_cpus": args.syncer_cpus,
        "baseline": args.baseline,
        "plain_process": args.plain_process,
        "plains": plains,
        "rounds": rounds,
    }


def summary(
    plains: list[dict[str, float]], jobs: list[dict[str, Any]], rounds: list[dict[str, Any]]
) -> dict[str, float]:
    """Across rounds (wall clock): the median of the rounds' ratios and of their A/A controls,
    and the jobs' mean tokens/s over the mean of every plain block. On a machine whose plain
    loop drifts between blocks (an H200 moved 52-68 ms a step within minutes), one round's
    ratio is as much the drift as the learner; several rounds and their median are the figure."""
    ratios = sorted(r["ratio_tokens_per_s"] for r in rounds)
    controls = sorted(r["aa_tokens_per_s"] for r in rounds)
    plain = statistics.fmean(p["tokens_per_s"] for p in plains)
    return {
        "median_ratio": statistics.median(ratios),
        "min_ratio": ratios[0],
        "max_ratio": ratios[-1],
        "median_aa": statistics.median(controls),
        "min_aa": controls[0],
        "max_aa": controls[-1],
        "pooled_ratio": statistics.fmean(j["tokens_per_s"] for j in jobs) / plain,
    }


def report(r: dict[str, Any]) -> str:
    lines = [
        f"{r['preset']} on {r['device']}, {r['precision']}, batch {r['batch_size']} x "
        f"{r['micro_batches']} x {r['seq_len']}, H {r['inner_steps']}, "
        f"{r['outer_steps']} outer steps, 2 fragments, int8, mergeWait {r['merge_wait']}, "
        f"overlapMode {r['overlap_mode']}; "
        + (
            "plain blocks: the job's steps, read in its steady windows"
            if r.get("baseline") == "windows"
            else f"plain blocks of {r['plain_steps']} steps"
        )
        + (CONTROL_NOTE if r["control"] else "")
        + ("; each plain block in a fresh process" if r.get("plain_process") else "")
        + (
            f"; syncer on CPUs {r['syncer_cpus']}, learner and plain loop on the rest"
            if r.get("syncer_cpus")
            else ""
        )
    ]
    for i, row in enumerate(r["rounds"]):
        job, before, after = row["job"], row["plain_before"], row["plain_after"]
        windows = ", ".join(f"{w:.0f}" for w in job["windows_tokens_per_s"])
        lines += [
            f"round {i}: learner windows tokens/s {windows} (job wall {job['wall_s']:.0f} s)",
            f"  wall: plain {before['tokens_per_s']:.0f} before, {after['tokens_per_s']:.0f} "
            f"after; learner {job['tokens_per_s']:.0f} tokens/s; learner / plain "
            f"{row['ratio_tokens_per_s']:.3f}; A/A (plain after / before) "
            f"{row['aa_tokens_per_s']:.3f}",
            f"  cpu:  plain {before['tokens_per_cpu_s']:.1f} before, "
            f"{after['tokens_per_cpu_s']:.1f} after; learner {job['tokens_per_cpu_s']:.1f} "
            f"tokens per CPU-s; learner / plain {row['ratio_tokens_per_cpu_s']:.3f}; "
            f"A/A (plain after / before) {row['aa_tokens_per_cpu_s']:.3f}",
            *split_lines(job["split"]),
        ]
    if len(r["rounds"]) > 1:
        m = r["summary"]
        lines.append(
            f"over {len(r['rounds'])} rounds (wall): learner / plain median "
            f"{m['median_ratio']:.3f} "
            f"({m['min_ratio']:.3f}-{m['max_ratio']:.3f}); A/A median {m['median_aa']:.3f} "
            f"({m['min_aa']:.3f}-{m['max_aa']:.3f}); the jobs' mean over every plain block's "
            f"{m['pooled_ratio']:.3f}"
        )
    return "\n".join(lines)


CONTROL_NOTE = " (control: the plain loop's own 20-step windows in place of the job)"


def split_lines(split: dict[str, Any] | None) -> list[str]:
    if not split:
        return []
    waits = ", ".join(
        f"{w:.2f}s ({o:.2f}s overlapped)"
        for w, o in zip(split["merge_waits_s"], split["overlap_s"], strict=True)
    )
    return [
        f"  learner's own split of its steady windows ({split['steps']} steps): "
        f"{split['training_s']:.3f}s training, {split['sync_path_s']:.3f}s sync path, "
        f"{split['waiting_s']:.3f}s waiting for the syncer; {split['cpu_s']:.2f} CPU-s",
        f"  training / all: {split['training_share']:.3f}; training / (training + sync path): "
        f"{split['step_path_share']:.3f}",
        f"  merge waits: {waits or 'none'}",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p, preset="gpt-tiny", seq_len=64)
    p.add_argument("--inner-steps", type=int, default=40, help="H of the job")
    p.add_argument("--outer-steps", type=int, default=4, help="the job's stopAfter.outerSteps")
    p.add_argument("--plain-steps", type=int, default=40, help="timed steps per plain block")
    p.add_argument("--rounds", type=int, default=1, help="jobs, each between two plain blocks")
    p.add_argument(
        "--skip-windows", type=int, default=2, help="the learner's first windows left out"
    )
    p.add_argument("--drop-last", type=int, default=1, help="the learner's last windows left out")
    p.add_argument("--warmup", type=int, default=3, help="untimed plain steps first")
    p.add_argument(
        "--merge-wait",
        default="overlap",
        choices=["overlap", "nextPush"],
        help="the job's sync.mergeWait (default overlap, the product's default)",
    )
    p.add_argument(
        "--overlap-mode",
        default="auto",
        choices=["auto", "fixed"],
        help="the job's sync.overlapMode (default auto, the product's default)",
    )
    p.add_argument("--job-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, help="also write the result here as JSON")
    p.add_argument("--logs", type=Path, help="keep a copy of the learner's log in this folder")
    p.add_argument(
        "--control",
        action="store_true",
        help="A/A: time the plain loop in 20-step windows in place of the job (the noise floor)",
    )
    p.add_argument(
        "--baseline",
        default="block",
        choices=["block", "windows"],
        help="block: the plain loop's --plain-steps steps after --warmup, freshly built; "
        "windows: the plain loop over the job's own steps (inner x outer), freshly built, read "
        "in the same steady 20-step windows as the learner's (the same step range on both sides)",
    )
    p.add_argument(
        "--plain-process",
        action="store_true",
        help="each plain block in a fresh process of its own, as the learner is in each job",
    )
    p.add_argument("--plain-block-json", type=Path, help=argparse.SUPPRESS)  # one block, then exit
    p.add_argument(
        "--syncer-cpus",
        default="",
        help="the job's syncer on these CPUs (DILOCO_SYNCER_CPUS, e.g. 1) and its learner, and "
        "the plain loop, on the rest: the learner timed without the syncer's merges on its "
        "cores, as in a cluster where the syncer has a pod of its own",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="inner.compile on both sides (torch.compile of the model's forward)",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for --plain-process's blocks
    # make_spec (bench.learner_step) reads this too.
    args.checkpointing = False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plain_block_json is not None:  # a --plain-process block
        args.plain_block_json.write_text(json.dumps({**baseline_block(args), "pid": os.getpid()}))
        return 0
    return bench_main(args, run, report)


if __name__ == "__main__":
    sys.exit(main())
