"""What a learner's training thread spends between its steps, call by call, inside a real job.

The learner's progress lines split each window into training, the sync path and waiting
(learner/step_costs.py). This benchmark runs the same one-island job as bench/learner_overlap
(`diloco run`, its flags) and times, in the learner's process, each call on the path between two
inner steps: the step itself for scale, `after_step` and what it calls (the plan, the push, its
encoding and its hand-over to the syncer link, a merge's receipt), the island's control,
applying weights, and logging. Only calls on the training thread are timed; the syncer link's
threads run what they run. A call's figure includes the calls it makes (the indented rows), and
everything it waits for, the interpreter lock included: a hand-over to the link's thread wakes
it, and at the learner's 0.5 ms switch interval its Python work (an HTTP request's set-up) can
hold the training thread for that long.

How: `diloco run` starts the learner with this process's environment, so a `sitecustomize`
module on PYTHONPATH (written to a temporary folder) wraps the named methods in the learner
process only, and writes their totals as JSON when it exits. Nothing of the trainer changes;
each wrapper costs about a microsecond a call (0.9 µs measured), some 15-20 µs a step over the
rows, which the learner's own split then also counts. The job's flags are
bench/learner_overlap's (its plain-block flags, --rounds, --baseline and the like, do nothing
here).

    python -m bench.studies.learner_calls --preset gpt-tiny --batch-size 8 --seq-len 64 \
        --inner-steps 40 --outer-steps 60 --syncer-cpus 1                       # CPU
    python -m bench.studies.learner_calls --device cuda --preset gpt-mini --precision bf16 \
        --batch-size 32 --seq-len 256 --inner-steps 40 --outer-steps 24 --merge-wait nextPush
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.learner_overlap import job_windows, parse_args, split_of
from bench.learner_step import bench_main

# Where the learner writes its timers: a folder, one calls-<pid>.json per learner process.
ENV = "DILOCO_BENCH_CALL_TIMERS"
# (depth, module, class, method): the rows of the report, each under the one above it with a
# smaller depth. Every one must exist (tests/unit/test_learner_calls_bench.py).
TARGETS: tuple[tuple[int, str, str, str], ...] = (
    (0, "diloco_trainer.learner.loop", "Learner", "_timed_step"),
    (0, "diloco_trainer.learner.fragment_sync", "FragmentSync", "count"),
    (0, "diloco_trainer.learner.syncer_link", "SyncerLink", "report"),
    (0, "diloco_trainer.learner.fragment_sync", "FragmentSync", "after_step"),
    (1, "diloco_trainer.learner.fragment_sync", "FragmentSync", "_plan"),
    (2, "diloco_trainer.learner.fragment_sync", "FragmentSync", "_abandoned"),
    (2, "diloco_trainer.learner.overlap", "OverlapFit", "fit"),
    (2, "diloco_trainer.learner.fragment_sync", "FragmentSync", "push"),
    (3, "diloco_trainer.learner.fragment_state", "FragmentState", "encode_push"),
    (3, "diloco_trainer.learner.syncer_link", "SyncerLink", "submit"),
    (1, "diloco_trainer.learner.fragment_sync", "FragmentSync", "_collect_plan"),
    (1, "diloco_trainer.learner.fragment_sync", "FragmentSync", "receive"),
    (2, "diloco_trainer.learner.fragment_state", "FragmentState", "receive"),
    (1, "diloco_trainer.learner.fragment_sync", "FragmentSync", "_hold"),
    (0, "diloco_trainer.learner.loop", "Learner", "_end_commands"),
    (0, "diloco_trainer.learner.loop", "Learner", "_control"),
    (0, "diloco_trainer.learner.loop", "Learner", "_apply"),
    (0, "logging", "Logger", "info"),
)
STEP = "Learner._timed_step"


class CallTimers:
    """Seconds and calls of each wrapped method, counted on one thread only."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner: type, method: str) -> None:
        """Replace owner.method by a timed one (on self.thread; other threads call it as is)."""
        key = f"{owner.__name__}.{method}"
        inner: Callable[..., Any] = getattr(owner, method)
        self.seconds[key], self.calls[key] = 0.0, 0

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not self.thread:
                return inner(*args, **kwargs)
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - began
                self.calls[key] += 1

        setattr(owner, method, timed)

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "calls": self.calls}


def install(targets: tuple[tuple[int, str, str, str], ...] = TARGETS) -> CallTimers:
    """Wrap every target on this process's main thread (the learner's training thread)."""
    timers = CallTimers(threading.main_thread())
    for _, module, owner, method in targets:
        timers.wrap(getattr(importlib.import_module(module), owner), method)
    return timers


def hook_from_env() -> None:
    """What the sitecustomize calls in every process of the job: in a learner, with ENV set,
    install the timers and write them to ENV/calls-<pid>.json at exit."""
    folder = os.environ.get(ENV)
    if not folder or "learner" not in sys.orig_argv:
        return
    timers = install()
    out = Path(folder) / f"calls-{os.getpid()}.json"
    atexit.register(lambda: out.write_text(json.dumps(timers.to_json())))


SITECUSTOMIZE = "from bench.studies.learner_calls import hook_from_env\nhook_from_env()\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One job with the timers in its learner: their totals and the learner's own split."""
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="learner-calls-") as tmp:
        hook, timers, workdir = Path(tmp, "hook"), Path(tmp, "timers"), Path(tmp, "job")
        for folder in (hook, timers, workdir):
            folder.mkdir()
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
        saved = dict(os.environ)
        path = [str(hook), str(root), os.environ.get("PYTHONPATH", "")]
        os.environ.update({ENV: str(timers), "PYTHONPATH": os.pathsep.join(p for p in path if p)})
        try:
            _, wall, text = job_windows(args, workdir)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        found = sorted(timers.glob("calls-*.json"))
        if len(found) != 1:
            raise SystemExit(f"expected the timers of one learner process, found {len(found)}")
        calls = json.loads(found[0].read_text())
    return {
        "preset": args.preset,
        "device": args.device,
        "precision": args.precision,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "inner_steps": args.inner_steps,
        "outer_steps": args.outer_steps,
        "merge_wait": args.merge_wait,
        "syncer_cpus": args.syncer_cpus,
        "job_wall_s": wall,
        "calls": calls,
        "split": split_of(text, args),
    }


def rows(calls: dict[str, Any]) -> list[tuple[int, str, float, int]]:
    """(depth, name, seconds, calls) in TARGETS' order."""
    return [
        (depth, f"{owner}.{method}", calls["seconds"][key], calls["calls"][key])
        for depth, _, owner, method in TARGETS
        for key in [f"{owner}.{method}"]
    ]


def report(r: dict[str, Any]) -> str:
    steps = max(1, r["calls"]["calls"][STEP])
    split = r["split"]
    lines = [
        f"{r['preset']} on {r['device']}, {r['precision']}, batch {r['batch_size']} x "
        f"{r['seq_len']}, H {r['inner_steps']}, {r['outer_steps']} outer steps, mergeWait "
        f"{r['merge_wait']}"
        + (f", syncer on CPUs {r['syncer_cpus']}" if r["syncer_cpus"] else "")
        + f"; {steps} inner steps, the job's wall {r['job_wall_s']:.0f} s",
        f"{'call on the training thread':<40} {'seconds':>9} {'calls':>7} {'us a call':>10} "
        f"{'us a step':>10}",
    ]
    for depth, name, seconds, calls in rows(r["calls"]):
        per_call = 1e6 * seconds / calls if calls else 0.0
        lines.append(
            f"{'  ' * depth + name:<40} {seconds:9.3f} {calls:7d} {per_call:10.1f} "
            f"{1e6 * seconds / steps:10.1f}"
        )
    if split["steps"]:
        lines.append(
            f"the learner's own split of its steady windows ({split['steps']} steps): sync path "
            f"{1e6 * split['sync_path_s'] / split['steps']:.1f} us a step, training / (training "
            f"+ sync path) {split['step_path_share']:.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return bench_main(parse_args(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
