"""The learner inside a real job against a plain torch loop: what DiLoCo costs on the step path
once pushes, pulls and the mixing of merged fragments run beside the inner steps.

bench/learner_step times the inner step alone. This runs a real one-island job (`diloco run`: a
syncer process on the CPU, one learner on --device, int8 pushes and pulls of 2 streamed
fragments, the job defaults otherwise) and reads the learner's own tokens/s, which it logs every
20 steps over wall time, so each window holds everything the learner does between two steps:
encoding and sending pushes, receiving pulls, mixing merged fragments in. The baseline is a plain
loop (bench/learner_step's) of the same model, batch and precision in this process, timed before
and after the job so a machine that drifts affects both sides alike; --control puts the plain
loop's own 20-step windows in the job's place (an A/A run: the ratio's noise floor).

The learner also splits each window's wall time (learner/step_costs.py): its inner steps, the
DiLoCo work on its training thread (the sync path), and waiting for the syncer. Those shares are
measured within the same windows, so a machine whose speed drifts between the plain loop's runs
does not move them; the merge waits are listed beside the time the τ steps before each took.

    python -m bench.learner_overlap                                  # CPU, gpt-tiny
    python -m bench.learner_overlap --preset gpt-mini --batch-size 16 --seq-len 128  # CPU
    python -m bench.learner_overlap --preset gpt-mini --batch-size 16 --seq-len 128 --control
    python -m bench.learner_overlap --device cuda --preset gpt-125m --precision bf16 \
        --batch-size 16 --seq-len 1024 --inner-steps 40 --outer-steps 8

Torch-only besides the trainer: it runs on a GPU machine with the trainer alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.learner_step import make_spec, plain_side, time_side

WINDOW = re.compile(r"\((\d+) tokens/s\)")
# The learner's split of each window (learner/step_costs.WindowCosts).
COSTS = re.compile(
    r"\((\d+) tokens/s\); (\d+) steps: ([\d.]+)s training, ([\d.]+)s sync path, "
    r"([\d.]+)s waiting for the syncer"
)
# A blocking learner's wait for the merge of its push, and how long its τ steps since it took.
MERGE_WAIT = re.compile(
    r"waited ([\d.]+)s for fragment \d+ "
    r"\(the (\d+) overlapped steps since its push took ([\d.]+)s\)"
)
SKIP_WINDOWS = 2  # start-up: the first pull, allocator and autocast warm-up


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
  warmupSteps: 0
sync: {{quorum: 1, fragments: 2, compression: int8}}
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
        shutil.copy(log, args.logs / log.name)
    if done.returncode != 0:
        tail = log.read_text()[-3000:] if log.exists() else "(no learner log)"
        raise SystemExit(f"the job exited {done.returncode}; learner log tail:\n{tail}")
    text = log.read_text()
    return [float(m.group(1)) for m in WINDOW.finditer(text)], wall, text


def split_of(text: str) -> dict[str, Any]:
    """Where the learner's steady windows' wall time went (seconds summed over them), and each
    wait for a merge against the time its overlapped steps took."""
    rows = [tuple(float(g) for g in m.groups()[1:]) for m in COSTS.finditer(text)]
    steady = rows[SKIP_WINDOWS:-1]
    steps, training, sync_path, waiting = (sum(r[i] for r in steady) for i in range(4))
    waits = [(float(m.group(1)), float(m.group(3))) for m in MERGE_WAIT.finditer(text)]
    return {
        "steps": int(steps),
        "training_s": training,
        "sync_path_s": sync_path,
        "waiting_s": waiting,
        # Shares of the learner's own wall time, both sides measured in the same windows.
        "training_share": training / max(training + sync_path + waiting, 1e-9),
        "step_path_share": training / max(training + sync_path, 1e-9),
        "merge_waits_s": [w for w, _ in waits],
        "overlap_s": [o for _, o in waits],
    }


def plain_windows(args: argparse.Namespace, count: int) -> list[float]:
    """--control: the plain loop's tokens/s over `count` windows of 20 steps, the statistic the
    job's windows give, so its distance from 1 is the ratio's noise floor on this machine."""
    spec = make_spec(args)
    side = plain_side(spec, args.device)
    for _ in range(args.warmup):
        side()
    out = []
    for _ in range(count):
        start = time.perf_counter()
        for _ in range(20):
            side()
        out.append(20 * spec.inner.tokens_per_step / (time.perf_counter() - start))
    return out


def plain_rate(args: argparse.Namespace) -> float:
    """Tokens/s of the plain loop over --plain-steps steps after a warm-up."""
    spec = make_spec(args)
    seconds = time_side(
        plain_side, spec, args.device, warmup=args.warmup, steps=args.plain_steps, memory={}
    )
    return args.plain_steps * spec.inner.tokens_per_step / seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="learner-overlap-") as tmp:
        before = plain_rate(args)
        if args.control:
            count = args.inner_steps * args.outer_steps // 20
            windows, wall, text = plain_windows(args, count), 0.0, ""
        else:
            windows, wall, text = job_windows(args, Path(tmp))
        after = plain_rate(args)
    steady = windows[SKIP_WINDOWS:-1]  # the last window may hold the job's end
    if not steady:
        raise SystemExit(
            f"only {len(windows)} tokens/s windows in the learner's log: raise --outer-steps or "
            "--inner-steps (a window is 20 steps)"
        )
    plain = (before + after) / 2
    return {
        "preset": args.preset,
        "device": args.device,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "micro_batches": args.micro_batches,
        "seq_len": args.seq_len,
        "inner_steps": args.inner_steps,
        "outer_steps": args.outer_steps,
        "plain_tokens_per_s": [before, after],
        "learner_windows_tokens_per_s": windows,
        "learner_steady_median": statistics.median(steady),
        "learner_steady_mean": statistics.fmean(steady),
        "ratio_median": statistics.median(steady) / plain,
        "ratio_mean": statistics.fmean(steady) / plain,
        "job_wall_seconds": wall,
        "control": args.control,
        "split": split_of(text) if text else None,
    }


def report(r: dict[str, Any]) -> str:
    windows = ", ".join(f"{w:.0f}" for w in r["learner_windows_tokens_per_s"])
    before, after = r["plain_tokens_per_s"]
    return "\n".join(
        [
            f"{r['preset']} on {r['device']}, {r['precision']}, batch {r['batch_size']} x "
            f"{r['micro_batches']} x {r['seq_len']}, H {r['inner_steps']}, "
            f"{r['outer_steps']} outer steps, 2 fragments, int8",
            f"plain loop tokens/s: {before:.0f} before the job, {after:.0f} after",
            f"learner tokens/s windows (20 steps each; first {SKIP_WINDOWS} and last left out): "
            f"{windows}",
            f"learner in a job / plain: {r['ratio_median']:.3f} (median window), "
            f"{r['ratio_mean']:.3f} (mean); job wall {r['job_wall_seconds']:.0f} s"
            + (CONTROL_NOTE if r["control"] else ""),
            *split_lines(r["split"]),
        ]
    )


CONTROL_NOTE = " (control: the plain loop's own 20-step windows in place of the job)"


def split_lines(split: dict[str, Any] | None) -> list[str]:
    if not split:
        return []
    waits = ", ".join(
        f"{w:.2f}s ({o:.2f}s overlapped)"
        for w, o in zip(split["merge_waits_s"], split["overlap_s"], strict=True)
    )
    return [
        f"learner's own split of its steady windows ({split['steps']} steps): "
        f"{split['training_s']:.2f}s training, {split['sync_path_s']:.2f}s sync path, "
        f"{split['waiting_s']:.2f}s waiting for the syncer",
        f"training / all: {split['training_share']:.3f}; training / (training + sync path): "
        f"{split['step_path_share']:.3f}",
        f"merge waits: {waits or 'none'}",
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--preset", default="gpt-tiny")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--inner-steps", type=int, default=40, help="H of the job")
    p.add_argument("--outer-steps", type=int, default=4, help="the job's stopAfter.outerSteps")
    p.add_argument("--plain-steps", type=int, default=40, help="timed steps of the plain loop")
    p.add_argument("--warmup", type=int, default=3, help="untimed plain steps first")
    p.add_argument("--job-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, help="also write the result here as JSON")
    p.add_argument("--logs", type=Path, help="keep a copy of the learner's log in this folder")
    p.add_argument(
        "--control",
        action="store_true",
        help="A/A: time the plain loop in 20-step windows in place of the job (the noise floor)",
    )
    args = p.parse_args(argv)
    # make_spec (bench.learner_step) reads these too.
    args.checkpointing, args.compile = False, False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(report(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
