"""Per-rank peak memory of an island's learners: ddp against fsdp (islands.parallelism), at R
ranks (gloo on the CPU, or NCCL with one GPU per rank), fp32 or bf16.

Each rank is a real `Learner` (learner/loop.py) of one island, as `diloco learner` builds it
(DDP wrapper or FSDP2 shards, AdamW, the inner step), running a few inner steps; no syncer, so
rank 0's CPU copies of the global weights (4P with ddp, 4P/R per rank with fsdp, see
docs/learner.md) are not included. Figures per rank: on the CPU the process's peak RSS and the
same less what the process held before building the model (torch itself, the corpus); on CUDA
`max_memory_allocated`. The ratio fsdp / ddp is of the peaks above the baseline.

    python -m bench.learner_memory --preset gpt-125m --ranks 2 --precision fp32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diloco_trainer.api.contract import LearnerEnv
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.learner.loop import Learner
from diloco_trainer.learner.shards import local_rows
from diloco_trainer.models.data import corpus_for


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def held_bytes(learner: Learner) -> int:
    """Bytes of what the rank keeps between steps: its parameter rows, their gradients and the
    AdamW state (exact, whatever the allocator does)."""
    tensors = []
    for p in learner.params.values():
        tensors.append(local_rows(p))
        if p.grad is not None:
            tensors.append(local_rows(p.grad))
        for value in learner.optimizer.state[p].values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors.append(local_rows(value))
    return sum(t.numel() * t.element_size() for t in tensors)


def _rank(rank: int, args: argparse.Namespace, parallelism: str, store: str, out: str) -> None:
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=args.ranks,
    )
    try:
        spec = parse_spec(
            {
                "model": {"preset": args.preset, "seed": 0},
                "data": {"evalTokens": 1024},
                "islands": {"replicas": args.ranks, "parallelism": parallelism},
                "inner": {
                    "steps": 100,
                    "batchSize": args.batch_size,
                    "seqLen": args.seq_len,
                    "precision": args.precision,
                },
                "sync": {"fragments": 1},
            }
        )
        corpus_for(spec.data)  # read before the baseline: the corpus is not the learner's cost
        before = peak_rss()
        env = LearnerEnv.offline(device=device, rank=rank, world_size=args.ranks, job_name="bench")
        learner = Learner(spec, env, device, threading.Event())
        for _ in range(args.steps):
            learner._inner_step()
        result = {
            "rank": rank,
            "baseline_bytes": before,
            "peak_bytes": peak_rss(),
            "held_bytes": held_bytes(learner),
        }
        if device == "cuda":
            result["baseline_bytes"] = 0
            result["peak_bytes"] = torch.cuda.max_memory_allocated()
        Path(out, f"{parallelism}-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace, parallelism: str) -> list[dict[str, Any]]:
    # Tensors above 128 KiB in their own mmap, returned to the system when freed: glibc's default
    # (a threshold that grows as large blocks are freed) serves them from the heap, which it
    # keeps, and the peak RSS then measures fragmentation more than tensors (FSDP2 on the CPU
    # read 3.0 GiB at gpt-125m for 1.3 GiB live).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp, "store"))
        mp.spawn(_rank, args=(args, parallelism, store, tmp), nprocs=args.ranks, join=True)
        return [
            json.loads(Path(tmp, f"{parallelism}-{r}.json").read_text()) for r in range(args.ranks)
        ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", default="gpt-mini")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result: dict[str, Any] = {
        "preset": args.preset,
        "ranks": args.ranks,
        "precision": args.precision,
        "device": args.device,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "torch": torch.__version__,
    }
    for parallelism in ("ddp", "fsdp"):
        ranks = measure(args, parallelism)
        result[parallelism] = ranks
        for r in ranks:
            above = (r["peak_bytes"] - r["baseline_bytes"]) / 2**30
            print(
                f"{args.preset} {args.precision} {parallelism} rank {r['rank']}: peak "
                f"{r['peak_bytes'] / 2**30:.2f} GiB, {above:.2f} GiB above the baseline; holds "
                f"{r['held_bytes'] / 2**30:.2f} GiB of weights, gradients and AdamW state",
                flush=True,
            )
    worst = {
        k: max(r["peak_bytes"] - r["baseline_bytes"] for r in result[k]) for k in ("ddp", "fsdp")
    }
    held = {k: max(r["held_bytes"] for r in result[k]) for k in ("ddp", "fsdp")}
    result["ratio_fsdp_to_ddp"] = worst["fsdp"] / worst["ddp"]
    result["held_ratio_fsdp_to_ddp"] = held["fsdp"] / held["ddp"]
    print(f"per-rank peak above the baseline, fsdp / ddp: {result['ratio_fsdp_to_ddp']:.3f}")
    print(f"per-rank state held, fsdp / ddp: {result['held_ratio_fsdp_to_ddp']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
