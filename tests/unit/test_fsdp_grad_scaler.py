"""What fp16 with fsdp relies on (docs/learner-design.md, "fp16 and fsdp"): torch.amp.GradScaler on
FSDP2's sharded (DTensor) gradients agrees across an island's ranks whether a step overflowed.

Each rank checks only its own rows of every gradient, so an inf on one rank must skip the
optimizer step and halve the loss scale on every rank, or the ranks' shards would drift apart.
DTensor reduces the scaler's found-inf flag over the mesh (a max). fp16 itself is CUDA-only in the
learner; the scaler's CPU kernel and two gloo processes check the same code path here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

WORLD = 2
INIT_SCALE = 1024.0


def _one_step(rank: int, inf_on_rank: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    first = next(iter(model.parameters()))
    assert isinstance(first.grad, DTensor)
    if rank == inf_on_rank:  # an overflow in this rank's rows only
        first.grad.to_local()[0, 0] = float("inf")
    before = [p.to_local().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    scaler.unscale_(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    scaler.step(optimizer)
    scaler.update()
    after = [p.to_local() for p in model.parameters()]  # type: ignore[attr-defined]
    return {
        "found_inf": sum(v.item() for v in found.values()),
        "stepped": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "scale": scaler.get_scale(),
    }


def _worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        result = {"clean": _one_step(rank, None), "overflow": _one_step(rank, 1)}
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    for rank in ranks:
        # No overflow: both step, the scale stays (growth waits 2000 clean steps).
        assert rank["clean"] == {"found_inf": 0.0, "stepped": True, "scale": INIT_SCALE}
        # Rank 1's rows overflowed, rank 0's did not: both skip and both halve the scale.
        assert rank["overflow"] == {"found_inf": 1.0, "stepped": False, "scale": INIT_SCALE / 2}
