"""The learner's inner step against a plain torch training loop: what DiLoCo's learner costs on
the step path.

Both sides train the same model (same preset, seed and initial weights), on batches of the same
shape from the same kind of stream, with the same AdamW, clipping, precision and gradient
accumulation, in the same process, one after the other and alternating (`--rounds`), so a noisy
machine affects both alike. The learner side is `Learner._timed_step` (learner/loop.py: the
schedule's learning rate, learner/inner_step.py's step, the step-time measurement); the plain side
is the loop a user would write: forward under autocast, backward, clip, step, `loss.item()` once
per step (the learner reads each step's loss too: it is pushed with the pseudo-gradient). No
syncer: pushes and pulls run on another thread and are measured by the other benchmarks.

Figures: steps/s, tokens/s, the ratio learner / plain (1.0 = free), peak memory of each side
(CUDA: `max_memory_allocated`, each side measured alone; CPU: the process's peak RSS, both sides
together), and the data stream's own tokens/s (batches drawn, nothing trained).

    python -m bench.learner_step                      # CPU, gpt-mini
    python -m bench.learner_step --device cuda --preset gpt-125m --precision bf16 \
        --batch-size 16 --seq-len 1024

Torch-only and self-contained (no bench.harness): it runs on a GPU machine with the trainer alone.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diloco_trainer.api.contract import LearnerEnv
from diloco_trainer.api.spec import DataSpec, JobSpec, parse_spec
from diloco_trainer.learner.inner_step import autocast_for, compiled
from diloco_trainer.learner.loop import Learner
from diloco_trainer.models.data import Corpus, TokenStream, corpus_for
from diloco_trainer.models.model import PRESETS, build_model, count_parameters
from diloco_trainer.models.parts import inner_lr, make_inner_optimizer, set_lr


@functools.cache
def corpus(data: str) -> Corpus:
    """The corpus of the spec's data section (JSON), read once per run."""
    return corpus_for(DataSpec.model_validate_json(data))


def make_spec(args: argparse.Namespace) -> JobSpec:
    return parse_spec(
        {
            "model": {
                "preset": args.preset,
                "seed": 0,
                "activationCheckpointing": args.checkpointing,
            },
            "data": {"evalTokens": 1024},
            "inner": {
                "steps": 1000,
                "batchSize": args.batch_size,
                "microBatches": args.micro_batches,
                "seqLen": args.seq_len,
                "precision": args.precision,
                "compile": args.compile,
                "warmupSteps": 0,
            },
            "islands": {"count": 1},
            "sync": {"fragments": 1},
        }
    )


def learner_env(device: str) -> LearnerEnv:
    return LearnerEnv.offline(device=device, job_name="bench")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def learner_side(spec: JobSpec, device: str) -> Callable[[], None]:
    learner = Learner(spec, learner_env(device), device, threading.Event())

    def step() -> None:
        learner._timed_step()

    return step


def plain_side(spec: JobSpec, device: str) -> Callable[[], None]:
    """The loop a user would write, from the same corpus, seed and optimizer settings."""
    words = corpus(spec.data.model_dump_json())
    torch.manual_seed(spec.model.seed)
    model = build_model(
        spec.model.preset,
        spec.inner.seq_len,
        words.vocab_size,
        activation_checkpointing=spec.model.activation_checkpointing,
    ).to(device)
    model.train()
    stream = TokenStream(
        words.train,
        shard_index=0,
        num_shards=1,
        batch_size=spec.inner.batch_size,
        seq_len=spec.inner.seq_len,
        device=device,
    )
    optimizer = make_inner_optimizer(spec, model)
    forward = compiled(model, spec.inner.compile)
    scaler = torch.amp.GradScaler("cuda") if spec.inner.precision == "fp16" else None
    micro = spec.inner.micro_batches
    steps = [0]

    def step() -> None:
        set_lr(optimizer, inner_lr(spec, steps[0]))
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for _ in range(micro):
            batch = stream.next_batch()
            with autocast_for(spec.inner.precision, device):
                logits = forward(batch.inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()) / micro
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach()
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.inner.grad_clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        total.item()
        steps[0] += 1

    return step


@contextlib.contextmanager
def peak_memory(device: str, out: dict[str, float]) -> Iterator[None]:
    """Peak bytes while the block runs: CUDA allocations of this block alone, or the process's
    peak RSS so far on CPU (which includes everything before)."""
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    out["peak_bytes"] = max(out.get("peak_bytes", 0.0), float(peak))


def time_side(
    build: Callable[[JobSpec, str], Callable[[], None]],
    spec: JobSpec,
    device: str,
    *,
    warmup: int,
    steps: int,
    memory: dict[str, float],
    cpu: dict[str, float] | None = None,
) -> float:
    """Seconds for `steps` steps after `warmup` untimed ones, on a freshly built side; `cpu`
    accumulates this process's CPU seconds over them ("seconds": every thread of the process, so
    other processes' load enters only through what contention costs a thread)."""
    with peak_memory(device, memory):
        step = build(spec, device)
        for _ in range(warmup):
            step()
        sync(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        sync(device)
        elapsed = time.perf_counter() - start
        if cpu is not None:
            cpu["seconds"] = cpu.get("seconds", 0.0) + time.process_time() - cpu_start
        del step
    return elapsed


def data_rate(spec: JobSpec, batches: int) -> float:
    """Tokens/s of the train stream alone (CPU tensors: the host side of the data path)."""
    stream = TokenStream(
        corpus(spec.data.model_dump_json()).train,
        shard_index=0,
        num_shards=1,
        batch_size=spec.inner.batch_size,
        seq_len=spec.inner.seq_len,
    )
    start = time.perf_counter()
    for _ in range(batches):
        stream.next_batch()
    return batches * spec.inner.batch_size * spec.inner.seq_len / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = make_spec(args)
    device = args.device
    tokens_per_step = spec.inner.tokens_per_step
    seconds = {"learner": 0.0, "plain": 0.0}
    memory: dict[str, dict[str, float]] = {"learner": {}, "plain": {}}
    cpu: dict[str, dict[str, float]] = {"learner": {}, "plain": {}}
    # --control: the "learner" side is a second plain loop (an A/A run), so the printed ratio is
    # how far two identical loops differ on this machine: the noise floor of the real ratio.
    sides = {"learner": plain_side if args.control else learner_side, "plain": plain_side}
    for r in range(args.rounds):
        # Alternate which side goes first, so a machine that speeds up or slows down over the
        # run does not favour one side.
        order = ["plain", "learner"] if r % 2 == 0 else ["learner", "plain"]
        for name in order:
            seconds[name] += time_side(
                sides[name],
                spec,
                device,
                warmup=args.warmup,
                steps=args.steps,
                memory=memory[name],
                cpu=cpu[name],
            )
    with torch.device("meta"):
        params = count_parameters(build_model(spec.model.preset, spec.inner.seq_len))
    total_steps = args.rounds * args.steps
    result: dict[str, Any] = {
        "preset": spec.model.preset,
        "parameters": params,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "precision": spec.inner.precision,
        "batch_size": spec.inner.batch_size,
        "micro_batches": spec.inner.micro_batches,
        "seq_len": spec.inner.seq_len,
        "compile": spec.inner.compile,
        "control": args.control,
        "activation_checkpointing": spec.model.activation_checkpointing,
        "steps_timed": total_steps,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "data_tokens_per_s": data_rate(spec, args.data_batches),
    }
    cfg = PRESETS[spec.model.preset]
    # Training FLOPs per token (PaLM's estimate, as nanoGPT): 6 per parameter plus attention's
    # 12 x layers x width x sequence length.
    flops_per_token = 6 * params + 12 * cfg.n_layer * cfg.n_embd * spec.inner.seq_len
    for name in ("plain", "learner"):
        tokens_per_s = total_steps * tokens_per_step / seconds[name]
        result[name] = {
            "steps_per_s": total_steps / seconds[name],
            "tokens_per_s": tokens_per_s,
            "model_tflops": tokens_per_s * flops_per_token / 1e12,
            "peak_memory_gib": memory[name]["peak_bytes"] / 2**30,
            "tokens_per_cpu_s": total_steps * tokens_per_step / cpu[name]["seconds"],
        }
    result["ratio_learner_to_plain"] = (
        result["learner"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
    )
    result["ratio_cpu_learner_to_plain"] = (
        result["learner"]["tokens_per_cpu_s"] / result["plain"]["tokens_per_cpu_s"]
    )
    return result


CONTROL_NOTE = " (control: both sides are the plain loop)"


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['preset']} ({result['parameters'] / 1e6:.1f}M) on {result['device_name']}, "
        f"{result['precision']}, batch {result['batch_size']} x {result['micro_batches']} x "
        f"{result['seq_len']}, compile {result['compile']}, checkpointing "
        f"{result['activation_checkpointing']}, {result['steps_timed']} steps per side, torch "
        f"{result['torch']}{CONTROL_NOTE if result['control'] else ''}",
        f"{'side':8} {'steps/s':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'peak GiB':>9}",
    ]
    for name in ("plain", "learner"):
        side = result[name]
        lines.append(
            f"{name:8} {side['steps_per_s']:9.3f} {side['tokens_per_s']:11.0f} "
            f"{side['model_tflops']:8.2f} {side['peak_memory_gib']:9.2f}"
        )
    lines.append(f"learner / plain tokens/s: {result['ratio_learner_to_plain']:.3f}")
    lines.append(
        f"learner / plain tokens per CPU-s: {result['ratio_cpu_learner_to_plain']:.3f} "
        f"({result['learner']['tokens_per_cpu_s']:.0f} against "
        f"{result['plain']['tokens_per_cpu_s']:.0f})"
    )
    lines.append(f"data stream alone: {result['data_tokens_per_s']:.0f} tokens/s")
    return "\n".join(lines)


def model_arguments(
    p: argparse.ArgumentParser, *, preset: str, seq_len: int
) -> argparse.ArgumentParser:
    """The options the learner benchmarks share: device, model, precision and batch shape."""
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--preset", default=preset)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=seq_len)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p, preset="gpt-mini", seq_len=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each timing")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two sides")
    p.add_argument("--compile", action="store_true", help="inner.compile on both sides")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument(
        "--control",
        action="store_true",
        help="time the plain loop against itself (A/A): the ratio's noise floor on this machine",
    )
    p.add_argument("--data-batches", type=int, default=200)
    p.add_argument("--json", type=Path, help="also write the result here as JSON")
    return p.parse_args(argv)


def bench_main(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
) -> int:
    """The learner benchmarks' `main`: exit 2 for --device cuda without CUDA, else run, print
    the report and write the result to --json when given."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available", file=sys.stderr)
        return 2
    result = run(args)
    print(report(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(parse_args(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
