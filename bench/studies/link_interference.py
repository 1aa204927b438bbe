"""What the syncer link's work on a learner's host slows in its inner steps, one kind at a time.

A GPU learner's link thread pulls each merged fragment, rebuilds it and hands it to the device
while the training thread steps. In a job on an H200 the inner steps ran 11% slower in windows
with a push and a pull than in those without (bench/log/2026-11-27.md, "learner_overlap in a job on
an NVIDIA H200"), and that job could not say which part of the link's work did it. This runs the
plain training loop (bench/learner_step's) in this process while a second thread repeats one kind
of that work without pause, and reports each kind's step time against the loop alone, measured
in the same run, in alternation (`--rounds`):

- `none`: nothing beside the steps (the baseline; its rounds against each other are the A/A);
- `python`: a thread running Python and nothing else (what the interpreter lock alone costs);
- `host-rebuild`: a pulled int8 update applied to the host copy of a fragment and its checksum
  (published.apply_updates, weights_checksum): the host half of the old path;
- `pageable`: the fragment's fp32 values copied from pageable host memory to the GPU on a stream
  of their own: how DeviceStager.stage copied them before 2026-11-27;
- `stage`: DeviceStager.stage now (packed into pinned memory, one copy);
- `host-path`: host-rebuild then stage, what the link does per pull with DILOCO_PULL_APPLY=host;
- `device-path`: the update's checks on the host, then DeviceStager.rebuild (int8 across, applied
  on the GPU, the result back to pinned memory by DMA) and the checksum: the link's default.

The background work runs back to back, so its share of the time is higher than in a job (about
three quarters of the link's time there). Each kind's seconds per repetition is reported too.

    python -m bench.studies.link_interference                 # CPU, gpt-tiny: the host kinds only
    python -m bench.studies.link_interference --device cuda --preset gpt-125m --precision bf16 \
        --batch-size 16 --seq-len 1024

Torch-only besides the trainer: it runs on a GPU machine with the trainer alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.core import compress, payloads
from diloco_trainer.core.published import apply_updates, check_updates, weights_checksum
from diloco_trainer.learner.device_copies import DeviceStager
from diloco_trainer.learner.loop import TRAINING_SWITCH_INTERVAL
from diloco_trainer.models.model import build_model, count_parameters

from bench.learner_step import bench_main, corpus, make_spec, model_arguments, plain_side, sync

HOST_KINDS = ("none", "python", "host-rebuild")
DEVICE_KINDS = ("pageable", "stage", "host-path", "device-path")


def fragment(values: int, tensors: int) -> dict[str, torch.Tensor]:
    """A fragment of `values` fp32 values in `tensors` tensors of about equal size."""
    gen = torch.Generator().manual_seed(0)
    each = values // tensors
    return {f"t{i:03d}": torch.randn(each, generator=gen) for i in range(tensors)}


def pulled_update(held: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """One int8 update of `held` as the link receives it: a body decoded into views of one copy."""
    delta = {n: 1e-3 * torch.ones_like(t) for n, t in held.items()}
    body = payloads.encode_update_chain([(1, compress.encode_tensors(delta, "int8", on=None))], {})
    tensors, _ = payloads.decode_body_unlocked(body)
    return payloads.split_update_chain(tensors, 0, 1)


def work_of(kind: str, held: dict[str, torch.Tensor], device: str) -> Callable[[], object]:
    """One repetition of `kind`'s background work."""
    if kind == "python":
        return lambda: sum(i * i for i in range(20000))
    update = pulled_update(held)
    if kind == "host-rebuild":
        return lambda: weights_checksum(apply_updates(held, update, "int8"))
    stager = DeviceStager(device)
    on_device = stager.stage(held)
    shapes = {n: t.shape for n, t in held.items()}

    def pageable() -> None:
        with torch.cuda.stream(stager.stream):
            for t in held.values():
                t.to(stager.device, non_blocking=True)
        stager.stream.synchronize()

    def host_path() -> None:
        rebuilt = apply_updates(held, update, "int8")
        weights_checksum(rebuilt)
        stager.stage(rebuilt)

    def device_path() -> None:
        check_updates(shapes, update, "int8")
        _, host = stager.rebuild(on_device, update, "int8")
        weights_checksum(host)

    return {
        "pageable": pageable,
        "stage": lambda: stager.stage(held),
        "host-path": host_path,
        "device-path": device_path,
    }[kind]


def timed_beside(
    step: Callable[[], None], work: Callable[[], object] | None, steps: int, device: str
) -> tuple[list[float], float]:
    """Each of `steps` steps' seconds while `work` repeats on another thread; and the seconds
    per repetition of `work` (0 for none)."""
    stop, done = threading.Event(), [0, 0.0]

    def background(work: Callable[[], object]) -> None:
        began = time.perf_counter()
        while not stop.is_set():
            work()
            done[0] += 1
        done[1] = time.perf_counter() - began

    thread = None
    if work is not None:
        thread = threading.Thread(target=background, args=(work,), daemon=True)
        thread.start()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - began)
    stop.set()
    if thread is not None:
        thread.join()
    return times, done[1] / max(done[0], 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # As in a learner: at Python's default 5 ms, a thread running Python holds each of the
    # training thread's ~1500 lock hand-overs a step for up to that long.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(TRAINING_SWITCH_INTERVAL)
    try:
        return measure(args)
    finally:
        sys.setswitchinterval(previous)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """run's work, at the learner's switch interval."""
    spec = make_spec(args)
    step = plain_side(spec, args.device)
    for _ in range(args.warmup):
        step()
    sync(args.device)
    kinds = HOST_KINDS + (DEVICE_KINDS if args.device.startswith("cuda") else ())
    kinds = tuple(k for k in kinds if k in args.kinds.split(",")) if args.kinds else kinds
    values = args.fragment_values or spec_values(args) // 2  # one of the job's 2 fragments
    held = fragment(values, args.tensors)
    works = {k: work_of(k, held, args.device) if k != "none" else None for k in kinds}
    for work in works.values():
        if work is not None:
            work()  # allocations and first-use costs out of the timing
    steps: dict[str, list[float]] = {k: [] for k in kinds}
    per_op: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in kinds:
            times, op = timed_beside(step, works[k], args.steps, args.device)
            steps[k] += times[1:]  # the first step overlaps the thread's start
            per_op[k].append(op)
            print(
                f"  {k}: step median {statistics.median(times[1:]) * 1e3:.1f} ms, "
                f"work {op * 1e3:.1f} ms per op",
                file=sys.stderr,
                flush=True,
            )
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = statistics.median(steps["none"])
    return {
        "device": args.device,
        "preset": args.preset,
        "precision": args.precision,
        "batch": [args.batch_size, args.seq_len],
        "fragment_values": values,
        "tensors": args.tensors,
        "kinds": {
            k: {
                "step_s_median": statistics.median(steps[k]),
                "ratio": statistics.median(steps[k]) / base,
                "work_s_per_op": statistics.median(per_op[k]),
            }
            for k in kinds
        },
    }


def spec_values(args: argparse.Namespace) -> int:
    """The preset's parameter count (built on the meta device: no memory)."""
    spec = make_spec(args)
    words = corpus(spec.data.model_dump_json())
    with torch.device("meta"):
        model = build_model(spec.model.preset, spec.inner.seq_len, words.vocab_size)
    return count_parameters(model)


def report(r: dict[str, Any]) -> str:
    lines = [
        f"link_interference: {r['preset']} {r['precision']} batch {r['batch'][0]} x "
        f"{r['batch'][1]} on {r['device']}; background fragment {r['fragment_values']:,} values "
        f"in {r['tensors']} tensors",
        f"{'kind':<14} {'step (median)':>14} {'vs none':>8} {'work per op':>12}",
    ]
    for k, v in r["kinds"].items():
        lines.append(
            f"{k:<14} {v['step_s_median'] * 1e3:>11.1f} ms {v['ratio']:>8.3f} "
            f"{v['work_s_per_op'] * 1e3:>9.1f} ms"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p, preset="gpt-tiny", seq_len=64)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=12, help="timed steps per kind and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--fragment-values",
        type=int,
        default=0,
        help="values in the background fragment (default: half the preset's parameters)",
    )
    p.add_argument("--tensors", type=int, default=75, help="tensors in that fragment")
    p.add_argument("--kinds", default="", help="comma-separated kinds to run (default: all)")
    p.add_argument("--json", type=Path, help="also write the result here as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return bench_main(parse_args(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
