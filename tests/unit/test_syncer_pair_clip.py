"""Issue 46, syncer.guards.pairClip (intake/guards.pair_clip, pair_reference) with hand-derived
values: in a job of two with the movement cap on, a push whose pseudo-gradient's norm is above
pairClip x what the other island moves in the steps it claims (its recent median movement per
claimed step x those steps, counting at most one round of the island: H_i + overlap) is
shortened to that in its merge (its vector's scale is clip / w); off (0) by default, and never
in a job of three."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_trainer.core.contributions import Contributor, plan_merge
from diloco_trainer.syncer.intake import guards
from diloco_trainer.syncer.state import RoundSizes

from .test_syncer import FakeClock, body, make_spec, run, started

# A job of two, H = 4, lr 1e-3, the movement cap on (1.5, the default), pairClip 1.
PAIR = {
    "islands": {"count": 2},
    "inner": {"steps": 4, "lr": 1e-3},
    "syncer": {"guards": {"movementFactor": 1.5, "pairClip": 1.0}},
}


def stats(norm: float) -> guards.DeltaStats:
    return guards.DeltaStats(norm, True)


def test_pair_clip_by_hand() -> None:
    # Against a reference (the other island's median norm) of 2.0 at factor 1: at most 2.0.
    assert guards.pair_clip(8.0, 2.0, 1.0) == pytest.approx(0.25)  # 2 / 8
    assert guards.pair_clip(2.0, 2.0, 1.0) == 1.0  # exactly at it: kept
    assert guards.pair_clip(1.0, 2.0, 1.0) == 1.0
    assert guards.pair_clip(3.0, 2.0, 2.0) == 1.0  # factor 2: at most 4.0
    assert guards.pair_clip(5.0, 2.0, 2.0) == pytest.approx(0.8)  # 4 / 5
    # Nothing judges it: off, no reference yet, nothing moved, a norm that is not finite (the
    # guard refuses such a push before).
    assert guards.pair_clip(8.0, 2.0, 0.0) == 1.0
    assert guards.pair_clip(8.0, None, 1.0) == 1.0
    assert guards.pair_clip(0.0, 2.0, 1.0) == 1.0
    assert guards.pair_clip(math.nan, 2.0, 1.0) == 1.0


def test_pair_reference_is_the_others_movement_in_the_claimed_steps_a_round_at_most() -> None:
    # 0.1 a step from the other island; a round of 12 steps (H_i 10 + overlap 2).
    assert guards.pair_reference(0.1, 8, 12) == pytest.approx(0.8)  # 8 steps: 0.8
    assert guards.pair_reference(0.1, 40, 12) == pytest.approx(1.2)  # 4 x H claimed: one round
    assert guards.pair_reference(None, 40, 12) is None  # no figure yet
    assert guards.pair_reference(0.1, 0, 12) is None  # no steps claimed


def test_a_rounds_push_is_h_i_and_the_overlap() -> None:
    # H 4 + sync.overlapSteps 3: 7 (STEP_ROUNDS x 4 + 3 = 19 is the most a push may claim).
    sizes = RoundSizes(make_spec(**PAIR, sync={"overlapSteps": 3}))
    assert sizes.round_push_steps(None, "island-0") == 7
    assert sizes.max_push_steps(None, "island-0") == 19


def test_guard_clips_against_the_other_islands_movement_in_a_round() -> None:
    g = guards.make_guard(make_spec(**PAIR), [100], [1.0])
    assert g.pair_factor == 1.0
    # Before the honest island has OWN_MIN (3) pushes nothing is clipped.
    assert g.contribution_clip(0, "loud", 1.2, 16, 6) == 1.0
    # The honest island: 0.04, 0.08, 0.06 over 4 steps: 0.01, 0.02, 0.015 a step, median 0.015
    # (ten times the evidence's step cap, 1.5 x 1e-3 x 4 x sqrt(100) / 4 x 0.1 = 0.0015: the
    # clip's figure is not capped, so an honest island's own movement is what it holds to).
    for norm in (0.04, 0.08, 0.06):
        g.accepted(0, "honest", stats(norm), 4)
    assert g.evidence is not None and g.evidence.others(0, "loud") == pytest.approx(0.015)
    # 1.2 claiming 16 steps (4 x H) with a round of 6 (H 4 + overlap 2): held to 0.015 x 6.
    assert g.contribution_clip(0, "loud", 1.2, 16, 6) == pytest.approx(0.075)  # 0.09 / 1.2
    assert g.contribution_clip(0, "loud", 1.2, 4, 6) == pytest.approx(0.05)  # 0.06 / 1.2
    assert g.contribution_clip(0, "loud", 0.06, 4, 6) == 1.0
    # The honest island has no reference until the other has three pushes of its own.
    assert g.contribution_clip(0, "honest", 0.06, 4, 6) == 1.0
    for norm in (1.2, 1.6, 0.8):  # 0.075, 0.1, 0.05 a step over 16: median 0.075
        g.accepted(0, "loud", stats(norm), 16)
    assert g.contribution_clip(0, "honest", 0.06, 4, 6) == 1.0  # under 0.3
    assert g.contribution_clip(0, "honest", 0.6, 4, 6) == pytest.approx(0.5)  # 0.3 / 0.6


def test_pair_clip_is_off_by_default_and_in_a_job_of_three() -> None:
    off = guards.make_guard(
        make_spec(**{**PAIR, "syncer": {"guards": {"movementFactor": 1.5}}}), [100], [1.0]
    )
    assert off.pair_factor == 0.0
    three = guards.make_guard(make_spec(**{**PAIR, "islands": {"count": 3}}), [100], [1.0])
    for g in (off, three):
        for norm in (0.04, 0.08, 0.06):
            g.accepted(0, "honest", stats(norm), 4)
        assert g.contribution_clip(0, "loud", 1.2, 16, 6) == 1.0
    assert three.evidence is None  # no work evidence with a majority to learn bounds from


def test_plan_scales_a_clipped_contribution() -> None:
    # "mean": weights are the work, 16 / 4 = 4 and 4 / 4 = 1; scales clip / w: 0.5 / 4 and 1.
    plan = plan_merge(
        [Contributor(32, 16, 0.0, clip=0.5), Contributor(32, 4)],
        rule="mean",
        inner_steps=4,
        islands=2,
    )
    assert plan.weights == [4.0, 1.0]
    assert plan.scales == [0.125, 1.0]
    assert plan.fraction == pytest.approx(2.5)  # (4 + 1) / 2: the clip moves no work


def test_syncer_merges_a_loud_push_held_to_the_honest_islands_figure(tmp_path: Path) -> None:
    """In process: the honest island's pushes of 4 steps (H) at 1e-3 an element (2.5e-4 x
    sqrt(n) a step), then the other's push of 16 claimed steps at 8e-3 an element: held to the
    honest figure x one round, H 4 + overlap 1 = 5 steps, 1.25e-3 x sqrt(n), so merged with
    scale clip / w = (1.25e-3 / 8e-3) / 4 = 0.0390625."""
    spec = make_spec(**PAIR, sync={"fragments": 1, "quorum": 1, "graceSeconds": 0})

    def filled(syncer: Any, value: float) -> dict[str, torch.Tensor]:
        return {n: torch.full_like(syncer.model.weights[n], value) for n in syncer.fragments[0]}

    async def scenario() -> None:
        syncer = await started(spec, tmp_path, FakeClock())
        try:
            assert syncer.gate.rounds.overlap == 1  # sync.overlapSteps: a round's push 4 + 1
            for island in ("island-0", "island-1"):
                await syncer.islands.join(island, 1)
            for _ in range(3):
                push = body(syncer, 0, "island-0", filled(syncer, 1e-3), steps=4, tokens=32)
                assert (await syncer.receive_push(0, push))["accepted"]
                await syncer.tick()
            meta = {"steps": 16, "tokens": 128, "stepTime": 0.001}
            push = body(syncer, 0, "island-1", filled(syncer, 8e-3), **meta)
            assert (await syncer.receive_push(0, push))["accepted"]
            await syncer.tick()
            merges = [json.loads(x) for x in (tmp_path / "merges.jsonl").read_text().splitlines()]
            honest = [c["scale"] for m in merges[:3] for c in m["contributors"]]
            assert honest == [1.0, 1.0, 1.0]  # nothing to judge them by: kept whole
            (loud,) = merges[-1]["contributors"]
            assert loud["island"] == "island-1" and loud["work"] == 4.0
            assert loud["scale"] == pytest.approx(0.0390625, rel=1e-5)  # 0.25 unclipped
        finally:
            await syncer.stop()

    run(scenario())
