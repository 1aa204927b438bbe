"""The syncer engine with Delayed Nesterov: merges carry fractions of a round, outer steps count
rounds of work, stale work is merged with a discount, and a checkpoint keeps the open round."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.storage import checkpoint as ckpt

T = TypeVar("T")
H = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_spec(**sync: Any) -> JobSpec:
    return parse_spec(
        {
            "model": {"preset": "gpt-tiny"},
            "data": {"evalTokens": 1024},
            "islands": {"count": 3},
            "inner": {"steps": H, "batchSize": 2, "seqLen": 16},
            "sync": {"quorum": 1, "graceSeconds": 0, "fragments": 1, **sync},
            "syncer": {"checkpoint": {"everyOuterSteps": 1}},
        }
    )


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def push(syncer: Syncer, island: str, *, steps: int = H, base: int | None = None) -> None:
    g = torch.Generator().manual_seed(len(syncer.merge_log.recent) + hash(island) % 1000)
    d = {
        n: 1e-2 * torch.randn(syncer.model.weights[n].shape, generator=g)
        for n in syncer.fragments[0]
    }
    meta = protocol.PushMeta(
        island=island,
        base_version=syncer.state.versions[0] if base is None else base,
        tokens=8 * steps,
        steps=steps,
        loss=3.0,
        step_time=0.01,
        codec=syncer.codec,
    )
    await syncer.receive_push(
        0, payloads.encode_body(encode_tensors(d, syncer.codec), meta.to_metadata())
    )
    await syncer.tick()


def test_syncer_one_island_merges_count_a_round_per_m_merges(tmp_path: Path) -> None:
    async def scenario() -> Syncer:
        syncer = Syncer(make_spec(), job_name="unit", state_dir=tmp_path, clock=FakeClock())
        await syncer.start()
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        for i in range(3):
            await push(syncer, f"island-{i}")
            assert syncer.state.outer_step == (1 if i == 2 else 0)
        await syncer.stop()  # the evaluations run in the background
        return syncer

    syncer = run(scenario())
    fractions = [e.fraction for e in syncer.merge_log.recent]
    assert fractions == pytest.approx([1 / 3] * 3)
    assert syncer.state.versions == [3] and syncer.outer_step == 1
    assert [e.rounds for e in syncer.merge_log.recent] == [0, 0, 1]
    assert [e.complete for e in syncer.merge_log.recent] == [False] * 3
    assert [e["outerStep"] for e in syncer.jobs.evaluations.history] == [0, 1]


def test_syncer_a_merge_of_every_island_closes_the_round_whatever_its_work(
    tmp_path: Path,
) -> None:
    """Quorum 3 of 3, each island pushing after 3 of H = 4 steps: the merge carries
    φ = 3 x (3/4) / 3 = 0.75 of a round by work, but it holds every island's push, so it closes
    the round (one fold; counting work alone it would stay open at 0.75)."""

    async def scenario() -> Syncer:
        spec = make_spec(quorum=3)
        syncer = Syncer(spec, job_name="unit", state_dir=tmp_path, clock=FakeClock())
        await syncer.start()
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        for i in range(3):
            await push(syncer, f"island-{i}", steps=3)
        await syncer.stop()
        return syncer

    syncer = run(scenario())
    (record,) = syncer.merge_log.recent
    entry = record.to_json()
    assert entry["fraction"] == pytest.approx(0.75)
    assert entry["complete"] is True
    assert entry["rounds"] == 1 and syncer.outer_step == 1
    assert syncer.model.outer.accumulated(0) == 0.0


def test_syncer_merges_stale_work_with_a_discount(tmp_path: Path) -> None:
    """A push 5 versions old (refused by the old default bound of 4) is merged; it lags 2.5
    rounds of work (5 merges of half a round), so its discount is (1 + 1.5)^-1/2."""

    async def scenario() -> Syncer:
        syncer = Syncer(make_spec(), job_name="unit", state_dir=tmp_path, clock=FakeClock())
        await syncer.start()
        for i in range(2):
            await syncer.islands.join(f"island-{i}", 1)
        for _ in range(5):
            await push(syncer, "island-0")
        await push(syncer, "island-1", base=0)
        await syncer.stop()
        return syncer

    syncer = run(scenario())
    assert syncer.state.policy.max_staleness == 12  # auto: 4 x 3 islands
    entry = syncer.merge_log.recent[-1].to_json()
    (stale,) = entry["contributors"]
    assert (stale["island"], stale["lag"]) == ("island-1", 5)
    assert stale["discount"] == pytest.approx(2.5**-0.5)
    assert stale["weight"] == 1.0  # alone in its merge, but not renormalised away:
    assert entry["fraction"] == pytest.approx(0.5 * 2.5**-0.5)
    # It feeds the outer momentum only (1 + 2.5)^-2 = 1/12.25 of its Δ (core/contributions.
    # momentum_share); island-0's fresh pushes all of theirs.
    assert entry["momentum"] == pytest.approx(1 / 12.25)
    assert all(r.momentum == 1.0 for r in list(syncer.merge_log.recent)[:-1])


def test_syncer_checkpoint_keeps_the_open_round(tmp_path: Path) -> None:
    """Two pushes of two rounds each (φ = 2/3 each among 3 islands): one round folded and 1/3
    carried. A restart keeps the buffer (in the digest), the carried fraction, the rounds and
    the work clocks."""
    spec = make_spec()

    async def first() -> Syncer:
        syncer = Syncer(spec, job_name="unit", state_dir=tmp_path, clock=FakeClock())
        await syncer.start()
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        await push(syncer, "island-0", steps=2 * H)
        await push(syncer, "island-1", steps=2 * H)
        await syncer.stop()
        return syncer

    before = run(first())
    assert before.outer_step == 1
    assert before.model.outer.accumulated(0) == pytest.approx(1 / 3)
    assert any(k.startswith("buffer/") for k in before.model.outer.state_tensors())

    after = Syncer(spec, job_name="unit", state_dir=tmp_path, clock=FakeClock())
    assert after.digest() == before.digest()
    assert after.outer_step == 1 and after.state.versions == [2]
    assert after.model.outer.accumulated(0) == pytest.approx(1 / 3)
    assert after.state.lag_rounds(0, 1) == pytest.approx(2 / 3)


def test_syncer_resumes_an_older_checkpoint_counting_a_round_per_merge(tmp_path: Path) -> None:
    spec = make_spec()

    async def first() -> None:
        syncer = Syncer(spec, job_name="unit", state_dir=tmp_path, clock=FakeClock())
        await syncer.start()
        await syncer.islands.join("island-0", 1)
        for _ in range(2):
            await push(syncer, "island-0")  # alone: φ = 1, a round each
        await syncer.stop()

    run(first())
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None
    manifest = {k: v for k, v in loaded.manifest.items() if k not in ("outerStep", "formatVersion")}
    for key in ("outerProgress", "workClocks"):
        del manifest[key]  # what a syncer before rounds of work wrote
    manifest["versions"] = [5]
    ckpt.save_checkpoint(
        tmp_path,
        outer_step=5,
        weights=loaded.weights,
        momentum=loaded.momentum,
        manifest=manifest,
        keep=1,
    )
    resumed = Syncer(spec, job_name="unit", state_dir=tmp_path, clock=FakeClock())
    assert resumed.outer_step == 5 and resumed.model.outer.rounds(0) == 5
