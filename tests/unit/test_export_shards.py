"""`diloco export` of a sharded syncer's state dir: each fragment from the newest checkpoint of
the shard that owns it (two real in-process shards that merged and checkpointed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diloco_trainer.api.sharding import shard_dirs, shard_state_dir
from diloco_trainer.export import (
    ExportError,
    final_weights_note,
    find_checkpoint,
    from_checkpoint,
)
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.storage.checkpoint import load_checkpoint

from .test_syncer import FakeClock, body, delta, make_spec, run


def test_shard_state_dirs_named_and_found_in_order(tmp_path: Path) -> None:
    assert shard_state_dir(tmp_path, 0, 1) == tmp_path
    assert shard_state_dir(tmp_path, 1, 2) == tmp_path / "shard-1"
    for i in (1, 0):
        (tmp_path / f"shard-{i}").mkdir()
    (tmp_path / "shard-x").mkdir()  # not a shard's
    assert shard_dirs(tmp_path) == [tmp_path / "shard-0", tmp_path / "shard-1"]
    (tmp_path / "shard-3").mkdir()
    with pytest.raises(ValueError, match=r"shard dirs \[0, 1, 3\], not 0\.\.2"):
        shard_dirs(tmp_path)
    with pytest.raises(ExportError, match=r"not 0\.\.2"):
        from_checkpoint(tmp_path)


def test_export_assembles_each_fragment_from_its_shard(tmp_path: Path) -> None:
    spec = make_spec(
        islands={"count": 1},
        sync={"quorum": 1, "graceSeconds": 0, "fragments": 2},
        syncer={"shards": 2, "checkpoint": {"everyOuterSteps": 1}},
    )
    state = tmp_path / "syncer"
    shards = [
        Syncer(
            spec,
            job_name="unit",
            state_dir=shard_state_dir(state, i, 2),
            clock=FakeClock(),
            shard=i,
        )
        for i in range(2)
    ]

    async def merge_and_stop(syncer: Syncer, fragment: int, rounds: int) -> None:
        await syncer.start()
        await syncer.islands.join("island-0", 1)
        for r in range(rounds):
            d = delta(syncer, fragment, 10 * fragment + r)
            await syncer.receive_push(fragment, body(syncer, fragment, "island-0", d))
            await syncer.tick()
        await syncer.stop()  # writes a checkpoint of what was merged

    run(merge_and_stop(shards[0], 0, rounds=2))
    run(merge_and_stop(shards[1], 1, rounds=1))
    weights, meta = from_checkpoint(state)
    owners = {0: shards[0], 1: shards[1]}
    for f, owner in owners.items():
        other = shards[1 - f]
        for name in owner.fragments[f]:
            assert torch.equal(weights[name], owner.model.weights[name])
            # The other shard holds none of it, in memory or in its checkpoint.
            assert name not in other.model.weights
        saved = load_checkpoint(find_checkpoint(shard_state_dir(state, f, 2)))
        assert set(saved.weights) == set(owner.fragments[f]) == set(owner.model.weights)
        assert set(saved.momentum) == set(owner.fragments[f])
    assert set(weights) == {n for names in shards[0].fragments for n in names}
    assert meta["versions"] == "[2, 1]"
    assert meta["outerStep"] == "1"  # the least-merged fragment's
    assert meta["shards"] == "2"
    note = final_weights_note(state)
    assert note is not None and f"diloco export {state}" in note
