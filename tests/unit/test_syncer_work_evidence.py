"""Issue 46, the work evidence of a job of two (intake/guards.WorkEvidence) with hand-derived
values: a push whose pseudo-gradient moved less than 1/32 of the other island's median movement
per claimed step (at most the movement cap's per-step share at 0.1 x inner.lr) for the steps it
claims is refused `work_unsupported`, never counted towards a drop; eight such pushes in a row
name the island (the health problem islandWorkUnsupported, the operator's condition), and a
merge then leaves it out of the islands its round spans. An island pushing as much as the cap
allows per claimed step cannot get an honest push at the cosine's floor refused; with three
islands the rule is off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_operator.conditions import syncer_health
from diloco_trainer.api import protocol
from diloco_trainer.models.parts import MIN_LR_RATIO
from diloco_trainer.syncer.intake import guards
from diloco_trainer.syncer.state.problems import WORK_UNSUPPORTED

from .observations import syncer_view
from .test_syncer import FakeClock, body, make_spec, run, started

# A job of two, H = 4, lr 1e-3, the movement cap on (1.5, the default).
PAIR = {
    "islands": {"count": 2},
    "inner": {"steps": 4, "lr": 1e-3},
    "syncer": {"guards": {"movementFactor": 1.5}},
}


def pair_guard(**sections: dict[str, object]) -> guards.ContributionGuard:
    spec = make_spec(**{**PAIR, **sections})
    return guards.make_guard(spec, [100], [1.0])


def stats(norm: float) -> guards.DeltaStats:
    return guards.DeltaStats(norm, True)


def merge_log(state_dir: Path) -> list[dict[str, Any]]:
    """The syncer's merges.jsonl in `state_dir`, one document a merge."""
    return [json.loads(x) for x in (state_dir / "merges.jsonl").read_text().splitlines()]


async def join_pair(syncer: Any) -> None:
    for island in ("island-0", "island-1"):
        await syncer.islands.join(island, 1)


def filled(syncer: Any, value: float) -> dict[str, torch.Tensor]:
    """A Δ of fragment 0 with every element at `value`."""
    return {n: torch.full_like(syncer.model.weights[n], value) for n in syncer.fragments[0]}


def refused(g: guards.ContributionGuard, island: str, norm: float, steps: int) -> bool:
    try:
        g.check_delta(0, island, stats(norm), steps)
    except guards.ContributionRefused as err:
        assert err.code == protocol.ERROR_UNSUPPORTED_WORK
        assert not err.own_fault  # the other island set the bar: never towards a drop
        assert g.refused(island, err) is False and island not in g.streaks
        return True
    return False


def test_evidence_constants_and_step_cap() -> None:
    assert guards.EVIDENCE_RATIO == 32.0
    assert guards.MIN_LR_SHARE == MIN_LR_RATIO == 0.1  # the least a cosine reaches
    spec = make_spec(**PAIR)
    # The movement cap of a round, 1.5 x 1e-3 x 4 x sqrt(100) = 0.06; per step at 0.1 x lr:
    # 0.06 / 4 x 0.1 = 0.0015.
    caps = guards.movement_caps(spec, [100])
    assert caps is not None
    assert guards.evidence_step_caps(spec, caps) == pytest.approx([0.0015], rel=1e-12)
    # Three islands, or the cap off: no evidence rule.
    assert (
        guards.make_guard(make_spec(**{**PAIR, "islands": {"count": 3}}), [100], [1.0]).evidence
        is None
    )
    off = {"syncer": {"guards": {"movementFactor": 0}}}
    assert pair_guard(**off).evidence is None


def test_zero_pushes_claiming_work_are_refused_against_the_other_islands_movement() -> None:
    g = pair_guard(syncer={"guards": {"movementFactor": 1.5, "maxDeltaNorm": 1e6}})
    # Before the honest island has OWN_MIN (3) pushes there is nothing to judge by.
    assert not refused(g, "bad", 0.0, 16)
    for _ in range(3):
        g.check_delta(0, "honest", stats(0.01), 4)
        g.accepted(0, "honest", stats(0.01), 4)  # 0.0025 per claimed step
    ev = g.evidence
    assert ev is not None
    # Its median 0.0025, above the step cap 0.0015: the reference is 0.0015; a push of 16
    # claimed steps must move 16 x 0.0015 / 32 = 0.00075.
    assert ev.reference(0, "bad") == pytest.approx(0.0015)
    assert ev.bar(0, "bad", 16) == pytest.approx(0.00075)
    assert refused(g, "bad", 0.0, 16)  # fast claims: zeros with a round's most steps
    assert refused(g, "bad", 0.00074, 16)
    assert not refused(g, "bad", 0.00076, 16)
    assert ev.bar(0, "bad", 0) is None  # no steps claimed: nothing to support
    # The honest island is judged by the bad one's figure only once it has three accepted
    # pushes: zeros are never accepted, so never.
    assert ev.reference(0, "honest") is None


def test_honest_push_at_the_cosine_floor_survives_an_island_at_the_cap() -> None:
    g = pair_guard(syncer={"guards": {"movementFactor": 1.5, "maxDeltaNorm": 1e6}})
    for _ in range(3):  # the adversary pushes one claimed step of 1.0: far above any physics
        g.accepted(0, "bad", stats(1.0), 1)
    ev = g.evidence
    assert ev is not None
    # Its figure 1.0 is capped at 0.0015: the bar of an honest push of H = 4 steps is
    # 4 x 0.0015 / 32 = 0.0001875. An honest step at the cosine's floor (0.1 x lr) moving each
    # element a tenth of that lr: 4 x 0.1 x 0.1 x 1e-3 x sqrt(100) = 0.0004, twice the bar.
    assert ev.reference(0, "honest") == pytest.approx(0.0015)
    assert not refused(g, "honest", 4 * 0.1 * 0.1 * 1e-3 * 10, 4)
    # Two honest islands within 32x of each other's figure never refuse each other.
    h = pair_guard(syncer={"guards": {"movementFactor": 1.5, "maxDeltaNorm": 1e6}})
    for _ in range(3):
        h.accepted(0, "a", stats(4e-4), 4)  # 1e-4 per step
    assert h.evidence is not None and h.evidence.bar(0, "b", 4) == pytest.approx(1.25e-5)
    assert not refused(h, "b", 4e-4 / 31, 4)
    assert refused(h, "b", 4e-4 / 33, 4)


def test_eight_unsupported_pushes_name_the_island_and_the_operator_condition() -> None:
    g = pair_guard()
    for _ in range(3):
        g.accepted(0, "honest", stats(0.01), 4)
    for i in range(guards.AT_BOUND_PUSHES):
        assert g.unsupported() == {}, i
        assert refused(g, "bad", 0.0, 16)
    named = g.unsupported()
    assert list(named) == ["bad"] and "1/32" in named["bad"]
    # One push that carries its steps: no longer all of the last eight.
    g.check_delta(0, "bad", stats(0.01), 4)
    assert g.unsupported() == {}
    # The syncer's problem kind is the operator's condition reason.
    view = syncer_view(
        {
            "health": {
                "healthy": False,
                "problems": [{"kind": WORK_UNSUPPORTED, "message": "x", "count": 1}],
            }
        }
    )
    healthy, reason, _ = syncer_health(view)
    assert (healthy, reason) == (False, "IslandWorkUnsupported")


def test_faint_pushes_above_the_bar_are_merged_but_named() -> None:
    g = pair_guard()
    for _ in range(3):
        g.accepted(0, "honest", stats(0.01), 4)  # reference 0.0015 per step (the cap share)
    assert guards.FAINT_RATIO == 4.0
    # 16 claimed steps: refused below 16 x 0.0015 / 32 = 0.00075, named below 16 x 0.0015 / 4
    # = 0.006. Pushes at 0.0015 (1/16 of the reference per step, bench faint_claims' twice the
    # bar) are accepted, and eight in a row name the island without leaving it out of rounds.
    for i in range(guards.AT_BOUND_PUSHES):
        assert g.faint() == {}, i
        assert not refused(g, "bad", 0.0015, 16)
    assert list(g.faint()) == ["bad"] and "1/4" in g.faint()["bad"]
    assert g.unsupported() == {}  # none was refused: it still spans the rounds it pushes to
    assert not refused(g, "bad", 0.0061, 16)  # one push carrying more than 1/4: no longer
    assert g.faint() == {}
    g.forget("bad")  # dropped or gone: its detection starts again
    assert (0, "bad") not in g.carried


def test_syncer_refuses_zero_claims_and_leaves_the_island_out_of_the_round(
    tmp_path: Path,
) -> None:
    """In process: the honest island's pushes of 4 steps (H) at 1e-3 an element merge alone at
    quorum 1 with work fraction 1/2 (two islands span the round); after eight zero pushes of 4
    claimed steps (each refused work_unsupported, none merged, no token credited) the adversary
    is idle to the merges: the honest push alone is the round, fraction 1, complete."""
    spec = make_spec(
        **PAIR,
        sync={"fragments": 1, "quorum": 1, "graceSeconds": 0},
    )

    async def scenario() -> None:
        syncer = await started(spec, tmp_path, FakeClock())
        try:
            await join_pair(syncer)
            honest, zero = filled(syncer, 1e-3), filled(syncer, 0.0)
            for _ in range(3):
                meta = {"steps": 4, "tokens": 32}
                answer = await syncer.receive_push(0, body(syncer, 0, "island-0", honest, **meta))
                assert answer["accepted"], answer
                await syncer.tick()
            assert [e["fraction"] for e in merge_log(tmp_path)] == [pytest.approx(0.5)] * 3
            assert not any(e["complete"] for e in merge_log(tmp_path))  # island-1 is awaited
            for _ in range(guards.AT_BOUND_PUSHES):
                with pytest.raises(guards.ContributionRefused) as err:
                    meta = {"steps": 4, "tokens": 32, "stepTime": 0.001}
                    await syncer.receive_push(0, body(syncer, 0, "island-1", zero, **meta))
                assert err.value.code == protocol.ERROR_UNSUPPORTED_WORK
            assert syncer.gate.unsupported_islands() == {"island-1"}
            assert syncer.gate.refusals_json() == {"island-1": {"work_unsupported": 8}}
            assert syncer.state.membership.islands["island-1"].state == protocol.STATE_ACTIVE
            answer = await syncer.receive_push(
                0, body(syncer, 0, "island-0", honest, steps=4, tokens=32)
            )
            await syncer.tick()
            last = merge_log(tmp_path)[-1]
            assert last["fraction"] == pytest.approx(1.0) and last["complete"] is True
            problems = {p["kind"] for p in syncer.health.to_json()["problems"]}
            assert WORK_UNSUPPORTED in problems
        finally:
            await syncer.stop()

    run(scenario())
