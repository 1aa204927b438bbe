"""islands.parallelism fsdp, with two real gloo processes on the CPU: FSDP2 trains to the same
weights as DDP, each rank holds half of every parameter, and the DiLoCo fragment state moves
through rank 0 one whole fragment at a time (push: Δ gathered; arrival: rows scattered and mixed
with the overlap rule on each rank)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diloco_trainer.api.contract import LearnerEnv
from diloco_trainer.api.spec import ConfigError, parse_spec
from diloco_trainer.learner.loop import Learner
from diloco_trainer.learner.shards import local_rows
from diloco_trainer.models.model import build_model

WORLD = 2


def make_spec(parallelism: str) -> dict[str, Any]:
    return {
        "model": {"preset": "gpt-tiny", "seed": 1},
        "data": {"evalTokens": 2048},
        "islands": {"replicas": WORLD, "parallelism": parallelism},
        "inner": {"steps": 4, "batchSize": 2, "microBatches": 2, "seqLen": 16, "lr": 1e-3},
        "sync": {"fragments": 2},
    }


def make_learner(rank: int, parallelism: str) -> Learner:
    env = LearnerEnv.offline(device="cpu", rank=rank, world_size=WORLD, job_name="t")
    return Learner(parse_spec(make_spec(parallelism)), env, "cpu", threading.Event())


def full(lrn: Learner) -> dict[str, torch.Tensor]:
    """Every parameter's whole tensor (a collective under fsdp: every rank calls it)."""
    out = {}
    for n, p in lrn.params.items():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = t.detach().clone()
    return out


def _worker(rank: int, store: str, parallelism: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        lrn = make_learner(rank, parallelism)
        result: dict[str, Any] = {
            "local_numel": sum(local_rows(p).numel() for p in lrn.params.values()),
        }
        for _ in range(3):
            lrn._inner_step()
        result["trained"] = full(lrn)
        if parallelism == "fsdp":
            result.update(_fragment_round_trip(lrn, rank))
        torch.save(result, f"{out_dir}/{parallelism}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _fragment_round_trip(lrn: Learner, rank: int) -> dict[str, Any]:
    """Join with given global weights, train, push fragment 0, train one overlapped step,
    receive a merged fragment 0: what every rank holds at each point."""
    from diloco_trainer.learner.shards import FragmentShards

    names = list(lrn.params)
    layout = [names[: len(names) // 2], names[len(names) // 2 :]]
    shards = FragmentShards(lrn.params, layout, rank=rank, world_size=WORLD, comm_device="cpu")
    torch.manual_seed(11)
    globals_ = {n: t.detach() for n, t in build_model("gpt-tiny", 16).named_parameters()}
    merged = {n: t + 0.5 for n, t in globals_.items()}
    out: dict[str, Any] = {}
    if rank == 0:
        for f, frag in enumerate(layout):
            shards.joined(f, {n: globals_[n] for n in frag})
        shards.done()
    else:
        shards.serve()
    out["joined"] = full(lrn)
    lrn._inner_step()
    out["at_push"] = full(lrn)
    if rank == 0:
        out["delta"] = shards.gather_pseudo_gradient(0)
        shards.done()
    else:
        shards.serve()
    lrn._inner_step()  # an overlapped step: kept when the merge arrives
    out["before_receive"] = full(lrn)
    if rank == 0:
        shards.receive(0, {n: merged[n] for n in layout[0]})
        shards.done()
    else:
        shards.serve()
    out["received"] = full(lrn)
    out["globals"], out["merged"], out["layout"] = globals_, merged, layout
    return out


def _spawn(tmp_path: Path, parallelism: str) -> list[dict[str, Any]]:
    store = tmp_path / f"store-{parallelism}"
    mp.spawn(_worker, args=(str(store), parallelism, str(tmp_path)), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"{parallelism}-{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("fsdp")
    return {p: _spawn(tmp, p) for p in ("ddp", "fsdp")}


def test_fsdp_trains_to_ddps_weights(runs: dict[str, list[dict[str, Any]]]) -> None:
    ddp, fsdp = runs["ddp"][0]["trained"], runs["fsdp"][0]["trained"]
    assert set(ddp) == set(fsdp)
    for n, t in ddp.items():
        torch.testing.assert_close(fsdp[n], t, rtol=1e-4, atol=1e-6)
    # Both ranks of the fsdp island see the same whole weights.
    for n, t in fsdp.items():
        assert torch.equal(runs["fsdp"][1]["trained"][n], t)


def test_fsdp_rank_holds_half_of_the_parameters(runs: dict[str, list[dict[str, Any]]]) -> None:
    total = runs["ddp"][0]["local_numel"]
    assert total == 2 * (12 * 64**2 + 13 * 64) + 2 * 256 * 64 + 16 * 64 + 2 * 64
    halves = [r["local_numel"] for r in runs["fsdp"]]
    assert sum(halves) == total
    # Dim-0 splits of 64- and 256-row tensors (and 16 positions) are even: exactly half each.
    assert halves == [total // 2, total // 2]


def test_fsdp_fragments_join_push_and_receive_on_shards(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    r0 = runs["fsdp"][0]
    globals_, merged, layout = r0["globals"], r0["merged"], r0["layout"]
    for n, t in globals_.items():
        torch.testing.assert_close(r0["joined"][n], t)  # every rank took its rows of θ_global
    # Δ_0 = θ_global − θ_at_push, whole, on rank 0, for fragment 0's names only.
    assert set(r0["delta"]) == set(layout[0])
    for n in layout[0]:
        torch.testing.assert_close(r0["delta"][n], globals_[n] - r0["at_push"][n])
    assert "delta" not in runs["fsdp"][1]
    # Arrival: θ ← merged + (θ_now − θ_at_push) on fragment 0; fragment 1 untouched.
    for n in layout[0]:
        expected = merged[n] + (r0["before_receive"][n] - r0["at_push"][n])
        torch.testing.assert_close(r0["received"][n], expected, rtol=1e-5, atol=1e-6)
    for n in layout[1]:
        assert torch.equal(r0["received"][n], r0["before_receive"][n])


def test_fsdp_spec_field_refused_with_its_name() -> None:
    with pytest.raises(ConfigError, match=r"^spec\.islands\.parallelism:"):
        parse_spec({"islands": {"parallelism": "zero3"}})
    assert parse_spec({}).islands.parallelism == "ddp"
