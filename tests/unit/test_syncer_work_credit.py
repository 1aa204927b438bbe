"""Issue 46, partial credit in a job of two (intake/guards.py, CREDIT_RATIO): a push accepted
by the work evidence is credited the claimed steps its movement supports, 4 x its movement per
claimed step over the reference (the other island's median, at most the movement cap's share
at 0.1 x lr), at most all of them; its tokens in the same proportion. Faint noise just above
the bar earns a fraction of its claim; honest islands of one job, a 3x faster one included,
keep their full claim. Hand-derived values throughout (a job of two, H = 4, lr 1e-3, 100
elements: the step cap is 0.1 x 1.5 x 1e-3 x sqrt(100) = 0.0015)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from diloco_trainer.syncer.intake import guards

from .test_syncer import FakeClock, body, make_spec, run, started
from .test_syncer_work_evidence import PAIR, filled, join_pair, merge_log, pair_guard, stats

# A flat schedule (no stopAfter.outerSteps: no cosine, no warm-up), so the credit's reference
# is the other island's plain median per step; the schedule's own cases are further down.
NO_CAP = {
    "syncer": {"guards": {"movementFactor": 1.5, "maxDeltaNorm": 1e6}},
    "stopAfter": {"outerSteps": None, "tokens": 10**9},
}


def test_credit_constants() -> None:
    # Full credit down to the line the naming uses (1/4 of the reference per claimed step).
    assert guards.CREDIT_RATIO == guards.FAINT_RATIO == 4.0


def test_credited_work_cuts_steps_and_tokens_alike() -> None:
    assert guards.credited_work(16 * 64, 16, 1.0) == (1024, 16)
    assert guards.credited_work(16 * 64, 16, 0.25) == (256, 4)  # 4 steps of 64 tokens
    assert guards.credited_work(40 * 512, 40, 0.25) == (5120, 10)
    # at least one step of any claimed; no steps claimed: nothing to cut
    assert guards.credited_work(16 * 64, 16, 0.001) == (64, 1)
    assert guards.credited_work(0, 0, 0.1) == (0, 0)
    # whole steps: 10 x 0.33 = 3.3 -> 3 steps, 3/10 of the tokens
    assert guards.credited_work(1000, 10, 0.33) == (300, 3)


def test_faint_pushes_are_credited_the_steps_their_movement_supports() -> None:
    g = pair_guard(**NO_CAP)
    g.joined("honest", 0)
    g.joined("bad", 0)
    assert g.credit(0, "bad", 0.0015, 16) == 1.0  # no reference yet: nothing judged
    for _ in range(3):
        g.accepted(0, "honest", stats(0.01), 4)  # 0.0025 a step: the reference is the cap
    # bench faint_claims: 16 steps at 1/16 of the reference each (0.0015 in all): 4 / 16.
    assert g.credit(0, "bad", 0.0015, 16) == pytest.approx(0.25)
    # at the bar (1/32 of the reference a step): 1/8; at 1/4 and above: in full
    assert g.credit(0, "bad", 16 * 0.0015 / 32, 16) == pytest.approx(0.125)
    assert g.credit(0, "bad", 16 * 0.0015 / 4, 16) == pytest.approx(1.0)
    assert g.credit(0, "bad", 1.0, 16) == 1.0
    # The honest island is judged by the other's figure only once it has three accepted
    # pushes; before that, in full.
    assert g.credit(0, "honest", 0.01, 4) == 1.0
    # Three islands (no work evidence): every push in full.
    three = guards.make_guard(make_spec(**{**PAIR, "islands": {"count": 3}}), [100], [1.0])
    assert three.credit(0, "bad", 0.0, 16) == 1.0


def test_a_three_times_faster_honest_island_keeps_its_full_credit() -> None:
    """A hetero job of two: island 'slow' pushes H = 4 steps moving 1e-3 a step (0.004 each),
    'fast' (3x faster, H_i = 12) pushes 12 steps that add up as a random walk at worst, sqrt(3)
    x the slow island's push: 5.77e-4 a step, 0.577 of the reference; 4 x 0.577 > 1."""
    g = pair_guard(**NO_CAP)
    g.joined("slow", 0)
    g.joined("fast", 0)
    for _ in range(3):
        g.accepted(0, "slow", stats(0.004), 4)
        g.accepted(0, "fast", stats(0.004 * math.sqrt(3)), 12)
    assert g.evidence is not None
    assert g.evidence.reference(0, "fast") == pytest.approx(1e-3)
    assert g.evidence.reference(0, "slow") == pytest.approx(0.004 * math.sqrt(3) / 12)
    # a flat schedule: the credit's reference is the same figure
    assert g.evidence.credit_reference(0, "fast") == pytest.approx(1e-3)
    assert g.credit(0, "fast", 0.004 * math.sqrt(3), 12) == 1.0
    assert g.credit(0, "slow", 0.004, 4) == 1.0
    # Where it would be cut: a push moving less than 1/4 of the other's figure a step.
    assert g.credit(0, "fast", 12 * 1e-3 / 8, 12) == pytest.approx(0.5)


def test_syncer_merges_a_faint_push_with_its_credited_work(tmp_path: Path) -> None:
    """In process, quorum 1: three honest pushes of 4 steps at 1e-3 an element (2.5e-4 x
    sqrt(n) a step, above the step cap 1.5e-4 x sqrt(n): the reference is the cap). A push of
    16 claimed steps (1024 tokens) at 1.5e-4 an element moves 1/16 of the reference a step:
    accepted, credited 4 / 16 of its claim: 4 steps, 256 tokens, work 4/4 = 1 round, fraction
    1/2 (two islands span the round); the island's merged tokens are 256, not 1024."""
    spec = make_spec(**PAIR, sync={"fragments": 1, "quorum": 1, "graceSeconds": 0})

    async def scenario() -> None:
        syncer = await started(spec, tmp_path, FakeClock())
        try:
            await join_pair(syncer)
            honest, faint = filled(syncer, 1e-3), filled(syncer, 1.5e-4)
            for _ in range(3):
                answer = await syncer.receive_push(
                    0, body(syncer, 0, "island-0", honest, steps=4, tokens=256)
                )
                assert answer["accepted"], answer
                await syncer.tick()
            answer = await syncer.receive_push(
                0, body(syncer, 0, "island-1", faint, steps=16, tokens=1024)
            )
            assert answer["accepted"], answer
            await syncer.tick()
            merges = merge_log(tmp_path)
            assert [c["credit"] for m in merges[:3] for c in m["contributors"]] == [1.0] * 3
            (last,) = merges[-1]["contributors"]
            assert last["island"] == "island-1"
            assert last["credit"] == pytest.approx(0.25, rel=1e-4)
            assert (last["steps"], last["tokens"], last["work"]) == (4, 256, pytest.approx(1.0))
            assert merges[-1]["fraction"] == pytest.approx(0.5)
            status = await syncer.status()
            assert status["islands"]["island-1"]["mergedTokens"] == 256
        finally:
            await syncer.stop()

    run(scenario())


# The credit's reference follows the schedule (issue 46, adv7): the old one, the other island's
# median movement per step over its window of 16 pushes, lagged a falling cosine and cut honest
# pushes (tests/e2e/test_convergence.py's job of two: 0.85-0.88 in its last rounds).


def test_lr_sum_and_mean_lr_add_the_schedule_over_the_claimed_steps() -> None:
    def steps_down(s: int) -> float:
        return 1.0 if s < 8 else 0.1  # 1 for steps 0-7, the floor 0.1 from step 8 on

    assert guards.lr_sum(steps_down, 0, 4) == pytest.approx(4.0)
    assert guards.lr_sum(steps_down, 6, 4) == pytest.approx(1 + 1 + 0.1 + 0.1)
    assert guards.mean_lr(steps_down, 6, 4) == pytest.approx(0.55)
    assert guards.lr_sum(steps_down, 0, 0) == 0.0
    assert guards.mean_lr(steps_down, 8, 0) == pytest.approx(0.1)  # at least one step


def test_followed_reference_and_push_credit() -> None:
    # median of the per-lr figures (2, 3, 10) is 3; the next steps' mean lr 0.1: 0.3 a step
    assert guards.followed_reference([2.0, 10.0, 3.0], 0.1) == pytest.approx(0.3)
    # 4 x (0.6 / 8 a step) / 0.3 = 1: in full at exactly 1/4 of the reference per step
    assert guards.push_credit(0.6, 8, 0.3) == pytest.approx(1.0)
    assert guards.push_credit(0.3, 8, 0.3) == pytest.approx(0.5)
    assert guards.push_credit(6.0, 8, 0.3) == 1.0  # at most all of its claim
    assert guards.push_credit(0.0, 8, None) == 1.0  # nothing judged
    assert guards.push_credit(0.0, 8, 0.0) == 1.0
    assert guards.push_credit(0.0, 0, 0.3) == 1.0


def test_a_step_down_in_the_lr_cuts_nothing_the_old_median_would_cut() -> None:
    """lr 1 for steps 0-7, 0.1 from step 8 (a cosine's floor, reached at once). Both islands
    move c = 2 per unit of lr: a push of 2 steps at lr 1 has norm 4 (2 a step), at lr 0.1 norm
    0.4 (0.2 a step). 'b' pushes steps 0-1, 2-3, 4-5, 6-7 (per-lr 2 each; its next steps 8-9 at
    0.1); 'a' pushes steps 8-9: 0.2 a step. Old reference: b's median per step, 2: credit
    4 x 0.2 / 2 = 0.4 (cut). New: 2 x 0.1 = 0.2 a step: credit 4 x 0.2 / 0.2 = 4 -> 1."""

    def steps_down(s: int) -> float:
        return 1.0 if s < 8 else 0.1

    ev = guards.WorkEvidence([1e9], steps_down)
    ev.joined("a", 0)
    ev.joined("b", 0)
    for _ in range(4):
        ev.record(0, "b", 4.0, 2)
    assert ev.places[0]["b"] == (8, 2)
    ev.joined("b", 4)  # a join never moves an island back in the schedule ...
    assert ev.places[0]["b"] == (8, 2)
    ev.joined("c", 6)  # ... and places a new one at the job's outer step x H
    assert ev.places[0]["c"] == (6, 0)
    assert ev.reference(0, "a") == pytest.approx(2.0)
    assert ev.credit_reference(0, "a") == pytest.approx(0.2)
    assert guards.push_credit(0.4, 2, ev.reference(0, "a")) == pytest.approx(0.4)  # old: cut
    assert ev.credit(0, "a", 0.4, 2) == 1.0
    # what it still cuts: the bench's faint noise (a fixed norm per claimed step, whatever the
    # lr): 8 claimed steps of 0.0125 each = 0.1 in all, 1/16 of 0.2: credited 4/16
    assert ev.credit(0, "a", 0.1, 8) == pytest.approx(0.25)
    # the reference's island judged by 'a' (no figures yet: nothing judged)
    assert ev.credit(0, "b", 0.0, 2) == 1.0


def test_an_island_without_a_place_in_the_schedule_sets_no_credit_reference() -> None:
    ev = guards.WorkEvidence([1e9])
    for _ in range(3):
        ev.record(0, "b", 4.0, 2)  # never joined: its place is unknown
    assert ev.reference(0, "a") == pytest.approx(2.0)  # the bar still reads it
    assert ev.credit_reference(0, "a") is None
    assert ev.credit(0, "a", 0.0, 2) == 1.0


CONVERGENCE_SCHEDULE = {
    **PAIR,
    **NO_CAP,
    # tests/e2e/test_convergence.py's schedule: H = 10, warm-up 10, a cosine over 10 rounds
    "inner": {"steps": 10, "lr": 1e-3, "warmupSteps": 10},
    "stopAfter": {"outerSteps": 10},
}
# Each round's mean lr over inner.lr (hand-derived: (s + 1) / 10 for s < 10, then 0.1 + 0.45 x
# (1 + cos(pi (s - 10) / 90)), flat at 0.1 from step 100): rounds 0-11.
ROUND_LR = [0.55, 0.9922, 0.9416, 0.8437, 0.7105, 0.5578, 0.4042, 0.2682, 0.1662, 0.1105, 0.1, 0.1]


def test_the_schedule_s_rounds_mean_lr() -> None:
    spec = make_spec(**CONVERGENCE_SCHEDULE)
    ev = guards.make_guard(spec, [100], [1.0]).evidence
    assert ev is not None
    got = [guards.mean_lr(ev.lr_at, 10 * k, 10) / 1e-3 for k in range(12)]
    assert got == pytest.approx(ROUND_LR, abs=1e-4)


@pytest.mark.parametrize("ahead", [0, 1])
def test_honest_pushes_keep_full_credit_through_warm_up_cosine_and_floor(ahead: int) -> None:
    """Two honest islands of test_convergence's schedule, each push one round of 10 steps
    whose norm is c x its lr summed (AdamW's update scales with lr; c = 1 per unit of lr,
    below the step cap, 1.5 x inner.lr a step for 100 elements, at every round).
    Island 'a' pushes round k after 'b' has pushed rounds 0..k-1 (ahead 0) or 0..k-2 (ahead 1:
    'a' one round ahead of 'b'). The credit's reference is c x b's next round's mean lr:
    ahead 0, a's own figure: 4 x 1 -> 1; ahead 1, at worst round 8 over round 7: 4 x 0.1662 /
    0.2682 = 2.48 -> 1. The old median: b's median over rounds 0..k-1 (k = 9: 0.5578;
    10: 0.5539; 11: 0.55), credit 4 x ROUND_LR[k] / that: 0.792, 0.722, 0.727 at ahead 0."""
    c = 1.0
    g = guards.make_guard(make_spec(**CONVERGENCE_SCHEDULE), [100], [1.0])
    ev = g.evidence
    assert ev is not None
    g.joined("a", 0)
    g.joined("b", 0)
    old: list[float] = []
    margins: list[float] = []  # CREDIT_RATIO x a's movement a step over the credit's reference
    for k in range(12):
        lr_round = ROUND_LR[k] * 1e-3 * 10  # the lr summed over round k
        norm = c * lr_round
        if k - 1 - ahead >= 0:
            # b's push of round k - 1 - ahead, recorded before a's round k is judged
            ev.record(0, "b", c * ROUND_LR[k - 1 - ahead] * 1e-3 * 10, 10)
        if k >= guards.OWN_MIN + ahead:
            assert g.credit(0, "a", norm, 10) == 1.0, k
            margins.append(4 * norm / 10 / ev.credit_reference(0, "a"))  # type: ignore[operator]
            old.append(guards.push_credit(norm, 10, ev.reference(0, "a")))
        ev.record(0, "a", norm, 10)
    if ahead == 0:
        # rounds 3-11 judged: the old rule cut rounds 9, 10 and 11
        assert old[-3:] == pytest.approx([0.7923, 0.7221, 0.7273], abs=1e-3)
        assert old[:6] == [1.0] * 6
    # the least margin: 4 at one pace; one round ahead, round 8 over round 7's lr
    assert min(margins) == pytest.approx(4.0 if ahead == 0 else 4 * 0.1662 / 0.2682, rel=1e-3)


def test_a_syncer_restart_keeps_the_places_and_an_older_checkpoint_judges_nothing() -> None:
    g = guards.make_guard(make_spec(**CONVERGENCE_SCHEDULE), [100], [1.0])
    g.joined("a", 0)
    g.joined("b", 0)
    for k in range(4):
        g.accepted(0, "b", stats(ROUND_LR[k] * 1e-2), 10)
    saved = g.saved()
    assert saved.places == [{"a": [0, 0], "b": [40, 10]}]
    # ROUND_LR is rounded to 4 places: each figure is 1 to that
    assert saved.per_lr == [{"b": [pytest.approx(1.0, rel=1e-3)] * 4}]
    again = guards.make_guard(make_spec(**CONVERGENCE_SCHEDULE), [100], [1.0])
    again.restore(saved, {"a", "b"})
    assert again.evidence is not None
    # b's next round is round 4: 1 x 0.7105e-3 a step
    assert again.evidence.credit_reference(0, "a") == pytest.approx(0.7105e-3, rel=1e-3)
    # a checkpoint without places (before this rule): the figures judge nothing until b joins
    older = saved.model_copy(update={"places": [], "per_lr": []})
    fresh = guards.make_guard(make_spec(**CONVERGENCE_SCHEDULE), [100], [1.0])
    fresh.restore(older, {"a", "b"})
    assert fresh.evidence is not None
    assert fresh.evidence.reference(0, "a") is not None  # the bar reads the plain figures
    assert fresh.evidence.credit_reference(0, "a") is None
    assert fresh.credit(0, "a", 0.0, 10) == 1.0
