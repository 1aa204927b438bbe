"""Issue 46, the movement cap of a job of two (syncer.guards.movementFactor,
intake/guards.movement_caps, merging/global_model.py) with hand-derived values: a merge's
pseudo-gradient per round of work is clipped to movementFactor x one honest AdamW round
(inner.lr x inner.steps x sqrt(numel) / (1 - sync.mixAlpha)) when the job has fewer than three
islands; an in-process syncer's outer step then moves the weights by the clipped share of what the
same push moves them unclipped, and a push within the cap moves them the same either way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.syncer.intake import clip_scale, movement_caps
from diloco_trainer.syncer.merging.global_model import merged_norm

from .test_syncer import FakeClock, body, make_spec, run, started


def test_movement_caps_are_the_spec_round_of_adamw_in_a_job_of_two() -> None:
    on = {"guards": {"movementFactor": 1.5}}
    spec = make_spec(islands={"count": 2}, inner={"steps": 4, "lr": 1e-3}, syncer=on)
    # 1.5 x 1e-3 x 4 x sqrt(100) = 0.06; sqrt(400) = 20: 0.12.
    caps = movement_caps(spec, [100, 400])
    assert caps == pytest.approx([0.06, 0.12], rel=1e-12)
    # mixAlpha 0.5 keeps half the old deviation: twice as much, 1 / (1 - 0.5).
    mixed = make_spec(
        islands={"count": 2}, inner={"steps": 4, "lr": 1e-3}, sync={"mixAlpha": 0.5}, syncer=on
    )
    assert movement_caps(mixed, [100]) == pytest.approx([0.12], rel=1e-12)
    # Three islands: the learned bound has a majority; factor 0: off.
    assert movement_caps(make_spec(islands={"count": 3}, syncer=on), [100]) is None
    off = make_spec(islands={"count": 2}, syncer={"guards": {"movementFactor": 0}})
    assert movement_caps(off, [100]) is None


def test_movement_factor_spec_default_and_field_error() -> None:
    assert parse_spec({}).syncer.guards.movement_factor == 1.5  # docs/adversaries.md
    with pytest.raises(ValueError, match="movementFactor"):
        parse_spec({"syncer": {"guards": {"movementFactor": -1}}})


def test_clip_scale_is_cap_over_norm_above_the_cap_only() -> None:
    assert clip_scale(3.0, 6.0) == 1.0
    assert clip_scale(6.0, 6.0) == 1.0  # at the cap: kept
    assert clip_scale(12.0, 6.0) == 0.5
    assert clip_scale(0.0, 6.0) == 1.0
    assert clip_scale(math.inf, 6.0) == 0.0 and clip_scale(math.nan, 6.0) == 0.0


def test_merged_norm_divides_each_tensor_by_its_divisor() -> None:
    # [3, 4] has norm 5; divided by 2: 2.5. With [12] beside it undivided: sqrt(2.5² + 12²).
    assert merged_norm({"a": torch.tensor([3.0, 4.0])}, {}) == 5.0
    assert merged_norm({"a": torch.tensor([3.0, 4.0])}, {"a": 2.0}) == 2.5
    both = merged_norm({"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0])}, {"a": 2.0})
    assert both == pytest.approx(math.sqrt(2.5**2 + 144.0), rel=1e-12)
    # Four elements of 1e30: their fp32 sum of squares (4e60) overflows, the fp64 one does not:
    # sqrt(4 x 1e60) = 2e30 (1e30 in fp32 is 1e30 to 1e-7).
    huge = merged_norm({"a": torch.full((4,), 1e30)}, {})
    assert huge == pytest.approx(2e30, rel=1e-6)


def _movement(tmp_path: Path, *, islands: int, factor: float, value: float) -> torch.Tensor:
    """The weights' movement of one merge: island-0's push of one step (of H = 4) whose every
    element is `value`, alone at quorum 1 (its vector scaled to one round: x4)."""
    spec = make_spec(
        islands={"count": islands},
        inner={"steps": 4, "lr": 1e-3},
        sync={"quorum": 1, "graceSeconds": 0},
        syncer={"guards": {"movementFactor": factor, "warmupPushes": 1000}},
    )

    async def scenario() -> torch.Tensor:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        names = syncer.fragments[0]
        before = torch.cat([syncer.model.weights[n].flatten().clone() for n in names])
        d = {n: torch.full_like(syncer.model.weights[n], value) for n in names}
        answer = await syncer.receive_push(0, body(syncer, 0, "island-0", d, steps=1, tokens=8))
        assert answer["accepted"], answer
        await syncer.tick()
        assert syncer.state.versions[0] == 1
        after = torch.cat([syncer.model.weights[n].flatten() for n in names])
        await syncer.stop()
        return after - before

    return run(scenario())


def test_a_merge_above_the_cap_moves_the_weights_by_the_clipped_share(tmp_path: Path) -> None:
    # A push of one step at 1e-3 an element: g = 4 x 1e-3 x sqrt(n) per round, and the cap is
    # 1.5 x 1e-3 x 4 x sqrt(n): within it; at 1e-2, g = 4e-2 sqrt(n), clipped by 6e-3 / 4e-2.
    free = _movement(tmp_path / "a", islands=2, factor=0, value=1e-2)
    clipped = _movement(tmp_path / "b", islands=2, factor=1.5, value=1e-2)
    assert clipped.norm() > 0
    # The merge log says so: g's norm before the clip and the clip, 6e-3 / 4e-2 = 0.15.
    numel = int(clipped.numel())
    (entry,) = [json.loads(x) for x in (tmp_path / "b" / "merges.jsonl").read_text().splitlines()]
    assert entry["movement"] == pytest.approx(4e-2 * math.sqrt(numel), rel=1e-5)
    assert entry["clip"] == pytest.approx(0.15, rel=1e-5)
    (off,) = [json.loads(x) for x in (tmp_path / "a" / "merges.jsonl").read_text().splitlines()]
    assert (off["movement"], off["clip"]) == (None, 1.0)  # not read: the cap is off
    # The first outer step is linear in g (its momentum starts at zero).
    torch.testing.assert_close(clipped, free * (6e-3 / 4e-2), rtol=1e-4, atol=1e-9)
    # A job of three is not clipped: the same push moves the weights as unclipped.
    three = _movement(tmp_path / "c", islands=3, factor=1.5, value=1e-2)
    three_free = _movement(tmp_path / "d", islands=3, factor=0, value=1e-2)
    torch.testing.assert_close(three, three_free, rtol=0, atol=0)
    # Within the cap (1e-3 an element): not clipped.
    small = _movement(tmp_path / "e", islands=2, factor=1.5, value=1e-3)
    small_free = _movement(tmp_path / "f", islands=2, factor=0, value=1e-3)
    torch.testing.assert_close(small, small_free, rtol=0, atol=0)
    (kept,) = [json.loads(x) for x in (tmp_path / "e" / "merges.jsonl").read_text().splitlines()]
    assert kept["movement"] == pytest.approx(4e-3 * math.sqrt(numel), rel=1e-5)
    assert kept["clip"] == 1.0
