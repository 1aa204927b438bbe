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


def test_faint_merged_names_an_island_only_when_its_faint_pushes_were_merged() -> None:
    """faint_merged (what a job of two ends for): the last eight judged pushes all below 1/4 of
    the reference per claimed step, at least one at or above the bar (1/32: merged). Reference
    0.0015 per step (the cap's share), 16 claimed steps: bar 0.00075, naming below 0.006."""
    g = pair_guard()
    for _ in range(3):
        g.accepted(0, "honest", stats(0.01), 4)
    # Eight zero pushes: all refused (figure 0), named faint and unsupported, never merged.
    for _ in range(guards.AT_BOUND_PUSHES):
        assert refused(g, "zero", 0.0, 16)
    assert list(g.faint()) == ["zero"] and g.faint_merged() == {}
    # Seven refused and one merged at 1/16 (0.0015 / 0.024 = 0.0625 >= 1/32): merged, named.
    g.check_delta(0, "zero", stats(0.0015), 16)
    named = g.faint_merged()
    assert list(named) == ["zero"] and "merged" in named["zero"]
    # Seven pushes at 1/16 are not eight: nothing; the eighth names it.
    for i in range(guards.AT_BOUND_PUSHES - 1):
        assert not refused(g, "faint", 0.0015, 16), i
        assert list(g.faint_merged()) == ["zero"]
    assert not refused(g, "faint", 0.0015, 16)
    assert list(g.faint_merged()) == ["faint", "zero"]
    # A push at 1/4 of the reference (0.006 over 16 steps): no longer all below it.
    assert not refused(g, "faint", 0.006, 16)
    assert list(g.faint_merged()) == ["zero"]


def test_faint_end_is_a_job_of_twos_only() -> None:
    """Gate.faint_end: the message names the island and the end at the best; with three islands
    there is no work evidence (the learned bound over a majority holds a minority), so never."""
    from diloco_trainer.syncer.intake.gate import Gate
    from diloco_trainer.syncer.state import SyncerMetrics

    spec = make_spec(**PAIR)
    g = guards.make_guard(spec, [100], [1.0])
    gate = Gate(spec, guard=g, metrics=SyncerMetrics())
    for _ in range(3):
        g.accepted(0, "honest", stats(0.01), 4)
    for _ in range(guards.AT_BOUND_PUSHES):
        g.check_delta(0, "bad", stats(0.0015), 16)
    message = gate.faint_end()
    assert message is not None and "island bad's last 8 pushes" in message
    assert "best-evaluated checkpoint" in message
    three = make_spec(**{**PAIR, "islands": {"count": 3}})
    g3 = guards.make_guard(three, [100], [1.0])
    assert g3.evidence is None
    assert Gate(three, guard=g3, metrics=SyncerMetrics()).faint_end() is None


def _faint_spec(end_on_faint: bool = True, **quality: object) -> Any:
    return make_spec(
        islands={"count": 2},
        inner={"steps": 4, "lr": 1e-3},
        sync={"fragments": 1, "quorum": 1, "graceSeconds": 0},
        syncer={
            "guards": {
                "movementFactor": 1.5,
                "maxDeltaNorm": 1e6,
                "warmupPushes": 1000,
                "maxRefusals": 0,
                "endOnFaint": end_on_faint,
            },
            "qualityGuard": {"margin": 0.25, "patience": 5, "warmupOuterSteps": 0, **quality},
            "evalEveryOuterSteps": 1,
            "checkpoint": {"everyOuterSteps": 100, "keep": 1},
        },
    )


def _faint_scenario(tmp_path: Path, spec: Any) -> list[dict[str, Any]]:
    """island-0 shrinks the weights three times (8 claimed steps each: an outer step of two
    islands, evaluated; the shrink lowers the eval loss at the random start), then island-1
    pushes faint noise: 4 claimed steps at 3.75e-5 an element, 1/16 of the reference per step
    (island-0's movement per step is far above the cap's share 1.5 x 0.1 x lr 1e-3 = 1.5e-4 an
    element, so the reference is that share), eight times. The statuses after each push."""

    async def scenario() -> list[dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        await join_pair(syncer)
        names = syncer.fragments[0]
        seen = []
        for _ in range(3):
            shrink = {n: 0.2 * syncer.model.weights[n].clone() for n in names}
            meta = {"steps": 8, "tokens": 200}
            await syncer.receive_push(0, body(syncer, 0, "island-0", shrink, **meta))
            await syncer.tick()
            seen.append(await syncer.status())
        faint = filled(syncer, 4 * 1.5e-4 / 16)
        for _ in range(guards.AT_BOUND_PUSHES):
            meta = {"steps": 4, "tokens": 32, "stepTime": 0.001}
            await syncer.receive_push(0, body(syncer, 0, "island-1", faint, **meta))
            await syncer.tick()
            seen.append(await syncer.status())
        await syncer.stop()
        return seen

    return run(scenario())


def test_faint_claims_end_a_job_of_two_at_its_best_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 46's faint claims, in process: the eighth faint push names island-1 with seven of
    them merged, and the next scheduler pass ends the job instead of merging it: finished, the
    health problem faintIslandEnded (never cleared), the final checkpoint the best-evaluated one
    the quality guard kept, and the end on disk (quality-guard-end.json, kind faintNamed), so a
    restart stays finished. The operator: Succeeded with its own message, SyncerHealthy False
    (FaintIslandEnded), one Warning Event."""
    from diloco_operator.phase import FAINT_ENDED, decide_phase
    from diloco_operator.refusals import FAINT_ENDED as EVENT
    from diloco_operator.refusals import FAINT_ENDED_MESSAGE, post_refusal_events
    from diloco_trainer.syncer.state.problems import FAINT_ENDED as KIND
    from diloco_trainer.syncer.storage.guard_end import FAINT_NAMED, read_guard_end

    from .observations import observation
    from .test_operator_refusals import JOB, OWN, _posted
    from .test_syncer_quality_guard import _restarted

    seen = _faint_scenario(tmp_path, _faint_spec())
    losses = [e["evalLoss"] for e in seen[2]["evalHistory"]]
    assert losses[1] < losses[0]  # the shrink lowered the loss: outer step 1 is a best, kept
    assert seen[2]["checkpoint"]["outerStep"] == 1
    *merging, ending = seen[3:]
    assert len(merging) == guards.AT_BOUND_PUSHES - 1
    assert not any(s["finished"] for s in merging)
    assert ending["finished"]
    kinds = {p["kind"]: p["message"] for p in ending["health"]["problems"]}
    assert "island island-1's last 8 pushes" in kinds[KIND]
    assert WORK_UNSUPPORTED in kinds  # the naming itself
    log = merge_log(tmp_path)
    faint_merges = [e for e in log if e["contributors"][0]["island"] == "island-1"]
    assert len(faint_merges) == guards.AT_BOUND_PUSHES - 1  # the eighth was never merged
    assert ending["versions"] == merging[-1]["versions"]
    assert ending["checkpoint"] == seen[2]["checkpoint"]  # the best, not the faint merges
    end = read_guard_end(tmp_path)
    assert end is not None and (end.kind, end.best_step) == (FAINT_NAMED, 1)
    # The operator: Succeeded saying why, SyncerHealthy's reason, one Event.
    verdict = decide_phase(observation(syncer=ending), None)
    assert (verdict.phase, verdict.message) == ("Succeeded", FAINT_ENDED)
    healthy, reason, message = syncer_health(syncer_view(ending))
    # the naming came first (its problem first), the end second: both in the condition
    assert (healthy, reason) == (False, "IslandWorkUnsupported")
    assert message == "syncer health problems: IslandWorkUnsupported, FaintIslandEnded"
    caplog.set_level("INFO", logger="diloco_operator")
    notes: dict[str, str] = {}
    for _ in range(2):
        post_refusal_events(JOB, syncer_view(ending), OWN, {}, notes)
    assert [m for m in _posted(caplog) if m.startswith(EVENT)] == [f"{EVENT} {FAINT_ENDED_MESSAGE}"]
    # A restart on the state dir stays finished, at the same checkpoint, with the same problem.
    status, answer = _restarted(tmp_path, _faint_spec())
    assert status["finished"] and status["checkpoint"] == ending["checkpoint"]
    assert [(p["kind"], p["message"]) for p in status["health"]["problems"]] == [
        (KIND, kinds[KIND])
    ]
    assert answer["finished"] and not answer["accepted"]


@pytest.mark.parametrize(
    ("end_on_faint", "patience"),
    [(False, 5), (True, 0)],
    ids=["endOnFaint off (the default)", "no best kept (the quality guard off)"],
)
def test_faint_claims_only_named_by_default_or_without_a_kept_best(
    tmp_path: Path, end_on_faint: bool, patience: int
) -> None:
    """syncer.guards.endOnFaint is off by default (an honest island of unequal speed far down
    its cosine is named too: bench/studies/faint_naming.py); with it on but the quality guard
    off (patience 0) no best is kept to end at, and ending would throw away the honest island's
    work. Either way the naming stays a naming, and all eight faint pushes are merged."""
    assert make_spec(**PAIR).syncer.guards.end_on_faint is False
    seen = _faint_scenario(tmp_path, _faint_spec(end_on_faint, patience=patience))
    assert not any(s["finished"] for s in seen)
    kinds = {p["kind"] for p in seen[-1]["health"]["problems"]}
    assert WORK_UNSUPPORTED in kinds and "faintIslandEnded" not in kinds
    log = merge_log(tmp_path)
    assert sum(e["contributors"][0]["island"] == "island-1" for e in log) == 8
