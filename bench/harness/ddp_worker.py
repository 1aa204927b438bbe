"""One rank of the plain torch DDP baseline (gloo, loopback): `python -m bench.harness.ddp_worker`.

Every rank trains on its own data shard (shard = rank of M, as an island would) and DDP averages
the gradients every step: synchronous data-parallel training over real processes. A communication
hook counts the bytes of every gradient bucket handed to the all-reduce, so the bytes figure is
counted, not assumed. Rank 0 evaluates at the end and writes the result as JSON.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun sets them).
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at runtime.
import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from diloco_trainer.api.spec import load_spec
from diloco_trainer.models.parts import build_parts, evaluate, make_inner_optimizer
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from bench.harness.common import ring_allreduce_bytes
from bench.harness.peer_training import forward_backward


class CountingAllreduce:
    """DDP comm hook state: counts bucket payload bytes, then all-reduces as DDP would."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.payload_bytes = 0

    def hook(self, _state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        self.payload_bytes += buf.numel() * buf.element_size()
        return allreduce_hook(self.group, bucket)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spec", type=Path, required=True, help="job spec (JSON or YAML)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps per rank")
    p.add_argument("--out", type=Path, required=True, help="rank 0 writes its JSON result here")
    args = p.parse_args()

    torch.set_num_threads(1)
    spec = load_spec(args.spec)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    parts = build_parts(spec, shard_index=rank, num_shards=world, with_train=True)
    initial = evaluate(parts) if rank == 0 else float("nan")
    counter = CountingAllreduce(None)
    ddp = DistributedDataParallel(parts.model)
    ddp.register_comm_hook(None, counter.hook)
    optimizer = make_inner_optimizer(spec, parts.model)

    dist.barrier()
    start = time.perf_counter()
    tokens = 0
    loss = float("nan")
    for step in range(args.steps):
        loss, n = forward_backward(spec, parts, ddp, optimizer, step)
        optimizer.step()
        tokens += n
    dist.barrier()
    wall = time.perf_counter() - start

    if rank == 0:
        result: dict[str, Any] = {
            "eval_loss": evaluate(parts, parts.model),
            "initial_eval_loss": initial,
            "train_loss": loss,
            "tokens": tokens * world,
            "steps": args.steps,
            "payload_bytes_per_worker": counter.payload_bytes,
            "bytes_per_worker": ring_allreduce_bytes(counter.payload_bytes, world),
            "wall_seconds": wall,
        }
        args.out.write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
