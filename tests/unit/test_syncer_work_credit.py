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

NO_CAP = {"syncer": {"guards": {"movementFactor": 1.5, "maxDeltaNorm": 1e6}}}


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
    for _ in range(3):
        g.accepted(0, "slow", stats(0.004), 4)
        g.accepted(0, "fast", stats(0.004 * math.sqrt(3)), 12)
    assert g.evidence is not None
    assert g.evidence.reference(0, "fast") == pytest.approx(1e-3)
    assert g.evidence.reference(0, "slow") == pytest.approx(0.004 * math.sqrt(3) / 12)
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
