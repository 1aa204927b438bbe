"""Issue 46, syncer.guards.pairCredit (intake/guards.pair_credit, core/contributions.
credited_work) with hand-derived values: in a job of two with the movement cap on, a push's
merge credits at most one round of its island's own steps (H_i + sync.overlapSteps) as work;
its vector is scaled by 1 / w for that credited w, so it still moves θ by lr·d·Δ/M, and only
the merge's work fraction φ (and so the outer momentum folds, core/outer.py) shrinks. Off by
default, never in a job of three."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_trainer.core.contributions import (
    Contributor,
    credited_tokens,
    credited_work,
    plan_merge,
)
from diloco_trainer.core.outer import OuterOptimizer
from diloco_trainer.syncer.intake import guards
from diloco_trainer.syncer.state.records import IslandRecord
from diloco_trainer.syncer.state.targets import pace_of

from .test_syncer import FakeClock, body, make_spec, run, started

# A job of two, H = 4, lr 1e-3, the movement cap on (1.5, the default), pairCredit on.
PAIR = {
    "islands": {"count": 2},
    "inner": {"steps": 4, "lr": 1e-3},
    "syncer": {"guards": {"movementFactor": 1.5, "pairCredit": True}},
}


def test_pair_credit_by_hand() -> None:
    # A round of 12 steps (H_i 10 + overlap 2): a claim of 40 (4 x H) is credited 12.
    assert guards.pair_credit(40, 12) == 12
    assert guards.pair_credit(13, 12) == 12
    assert guards.pair_credit(12, 12) is None  # a round's push: all of it
    assert guards.pair_credit(8, 12) is None


def test_credited_work_by_hand() -> None:
    assert credited_work(40, 10, 12) == pytest.approx(1.2)  # 12 / 10, not 40 / 10
    assert credited_work(40, 10) == pytest.approx(4.0)  # no cap: 40 / 10
    assert credited_work(8, 10, 12) == pytest.approx(0.8)  # under the cap: 8 / 10
    with pytest.raises(ValueError):
        credited_work(40, 10, 0)


def test_credited_tokens_by_hand() -> None:
    # 40 claimed steps of 1,024 tokens, credited a round of 12: 12 x 1,024 = 12,288 of the budget.
    assert credited_tokens(40960, 40, 12) == pytest.approx(12288.0)
    assert credited_tokens(40960, 40) == pytest.approx(40960.0)  # no credit: all of them
    assert credited_tokens(8192, 8, 12) == pytest.approx(8192.0)  # under a round: all of them
    # A streaming job's first push to its second fragment, 1.5 rounds of H 10 (15 steps of
    # 160 tokens) against a round of 12: 12 / 15 of 2,400 = 1,920 (480 its learner trains again).
    assert credited_tokens(2400, 15, 12) == pytest.approx(1920.0)
    with pytest.raises(ValueError):
        credited_tokens(40960, 40, 0)


def test_uncredited_tokens_are_out_of_the_islands_part() -> None:
    # Its learner counted 128 tokens from a base of 0 and its one push, 16 claimed steps, was
    # credited 5: merged 40, 88 counted as refused. Its part of what is done (base + count) is
    # then 0 - 88 + 128 = 40, its merged tokens, so a target gives it the 88 to train again.
    rec = IslandRecord(name="a", merged_tokens=40.0, refused_tokens=88.0)
    rec.first_report, rec.reported_tokens, rec.reported_at = (0, 0.0), 128, 10.0
    pace = pace_of(rec)
    assert pace is not None
    assert pace.base + pace.tokens == pytest.approx(40.0)
    assert pace.rate == pytest.approx(12.8)


def test_a_credited_push_moves_theta_as_much_with_a_smaller_fraction() -> None:
    # Alone, M = 2, H = 10, "mean": 40 claimed steps, credited 12.
    # Uncredited: w = 4, scale 1/4, φ = 4/2 = 2: φ x scale = 0.5 = 1/M.
    # Credited: w = 1.2, scale 1/1.2, φ = 1.2/2 = 0.6: φ x scale = 0.5 = 1/M, the same move.
    full = plan_merge([Contributor(640, 40)], rule="mean", inner_steps=10, islands=2)
    held = plan_merge(
        [Contributor(640, 40, credit_steps=12)], rule="mean", inner_steps=10, islands=2
    )
    assert (full.fraction, full.scales) == (pytest.approx(2.0), [pytest.approx(0.25)])
    assert held.fraction == pytest.approx(0.6)
    assert held.scales == [pytest.approx(1 / 1.2)]
    assert held.fraction * held.scales[0] == pytest.approx(0.5)
    # With the honest island's round (10 steps: w 1) in the same merge: ρ = w = 1 and 1.2,
    # g = (Δh / 1 x 1 + Δl / 1.2 x 1.2) / 2.2, φ = 2.2 / 2 = 1.1: φ·g = (Δh + Δl) / 2, as
    # uncredited (ρ 1 and 4, g = (Δh + 4 Δl / 4) / 5, φ = 2.5: φ·g = (Δh + Δl) / 2).
    pair = plan_merge(
        [Contributor(160, 10), Contributor(640, 40, credit_steps=12)],
        rule="mean",
        inner_steps=10,
        islands=2,
    )
    assert pair.weights == [pytest.approx(1.0), pytest.approx(1.2)]
    assert pair.fraction == pytest.approx(1.1)
    for rho, scale in zip(pair.weights, pair.scales, strict=True):
        assert pair.fraction * rho * scale / sum(pair.weights) == pytest.approx(0.5)


def test_a_credited_push_weighs_its_credited_share_under_the_tokens_rule() -> None:
    # "tokens" (the default): ρ = tokens x tokens / steps. Honest 160 tokens over 10 steps:
    # 2560; loud 640 over 40 claimed, credited 12: 640 x 16 x 12 / 40 = 3072 (10240 uncredited).
    # Σρ = 5632, φ = (1 + 1.2) / 2 = 1.1; each one's move φ x ρ_i x scale_i / Σρ:
    # honest 1.1 x 2560 / 5632 = 0.5, loud 1.1 x 3072 / 1.2 / 5632 = 0.5: Δ / M each, as
    # uncredited (2.5 x 2560 / 12800 = 0.5, 2.5 x 10240 / 4 / 12800 = 0.5). Weighting the loud
    # push by its claimed tokens while crediting its work would move θ by 0.22 Δh + 0.73 Δl.
    pair = plan_merge(
        [Contributor(160, 10), Contributor(640, 40, credit_steps=12)],
        rule="tokens",
        inner_steps=10,
        islands=2,
    )
    assert pair.weights == [pytest.approx(2560.0), pytest.approx(3072.0)]
    assert pair.fraction == pytest.approx(1.1)
    moves = [
        pair.fraction * rho * scale / sum(pair.weights)
        for rho, scale in zip(pair.weights, pair.scales, strict=True)
    ]
    assert moves == [pytest.approx(0.5), pytest.approx(0.5)]


def test_a_credited_push_folds_no_momentum_of_rounds_it_did_not_run() -> None:
    # One scalar, θ = 0, lr 1, β 0.9, Nesterov; both merges' gradient terms are φ·g = 0.5.
    # Uncredited (φ 2, g 0.25): two folds, each portion adding 1 x g = 0.25 to the buffer.
    # Fold 1: m = 0.25, θ moves by β·m = 0.225; fold 2: m = 0.9 x 0.25 + 0.25 = 0.475, θ moves
    # by 0.4275. θ = −(0.5 + 0.225 + 0.4275) = −1.1525: 0.6525 of it momentum.
    # Credited (φ 0.6, g 0.5 / 0.6): no round closes: θ = −0.5, 0.6 of a round open.
    def outer() -> tuple[OuterOptimizer, torch.Tensor]:
        theta = torch.zeros(1)
        return OuterOptimizer({"w": theta}, lr=1.0, momentum=0.9, nesterov=True), theta

    opt, theta = outer()
    assert opt.step({"w": torch.tensor([0.25])}, 2.0) == 2
    assert theta.item() == pytest.approx(-1.1525)
    opt, theta = outer()
    assert opt.step({"w": torch.tensor([0.5 / 0.6])}, 0.6) == 0
    assert theta.item() == pytest.approx(-0.5)
    assert (opt.rounds(), opt.accumulated()) == (0, pytest.approx(0.6))


def test_guard_credits_a_round_in_a_job_of_two_only_with_pair_credit() -> None:
    on = guards.make_guard(make_spec(**PAIR), [100], [1.0])
    assert on.credit_steps(16, 6) == 6  # 4 x H 4 claimed, a round of 4 + overlap 2
    assert on.credit_steps(6, 6) is None
    off = guards.make_guard(
        make_spec(**{**PAIR, "syncer": {"guards": {"movementFactor": 1.5}}}), [100], [1.0]
    )
    three = guards.make_guard(make_spec(**{**PAIR, "islands": {"count": 3}}), [100], [1.0])
    no_cap = guards.make_guard(
        make_spec(**{**PAIR, "syncer": {"guards": {"movementFactor": 0, "pairCredit": True}}}),
        [100],
        [1.0],
    )
    for g in (off, three, no_cap):
        assert g.credit_steps(16, 6) is None


def test_syncer_credits_a_loud_push_one_round(tmp_path: Path) -> None:
    """In process: island-1 pushes 16 claimed steps (4 x H 4) at 8e-3 an element; its round is
    H 4 + overlap 1 = 5 steps, so its merge records work 5 / 4 = 1.25 (16 / 4 = 4 without the
    credit), fraction 1.25 / 2 = 0.625 (2.0) and scale 1 / 1.25 = 0.8 (0.25): no round closes."""
    spec = make_spec(**PAIR, sync={"fragments": 1, "quorum": 1, "graceSeconds": 0})

    def filled(syncer: Any, value: float) -> dict[str, torch.Tensor]:
        return {n: torch.full_like(syncer.model.weights[n], value) for n in syncer.fragments[0]}

    async def scenario() -> None:
        syncer = await started(spec, tmp_path, FakeClock())
        try:
            assert syncer.gate.rounds.overlap == 1
            for island in ("island-0", "island-1"):
                await syncer.islands.join(island, 1)
            push = body(syncer, 0, "island-0", filled(syncer, 1e-3), steps=4, tokens=32)
            assert (await syncer.receive_push(0, push))["accepted"]
            await syncer.tick()
            meta = {"steps": 16, "tokens": 128, "stepTime": 0.001}
            push = body(syncer, 0, "island-1", filled(syncer, 8e-3), **meta)
            assert (await syncer.receive_push(0, push))["accepted"]
            await syncer.tick()
            merges = [json.loads(x) for x in (tmp_path / "merges.jsonl").read_text().splitlines()]
            (honest,) = merges[0]["contributors"]
            assert (honest["work"], honest["scale"], merges[0]["fraction"]) == (1.0, 1.0, 0.5)
            (loud,) = merges[-1]["contributors"]
            assert loud["island"] == "island-1" and loud["work"] == pytest.approx(1.25)
            assert loud["scale"] == pytest.approx(0.8)
            assert merges[-1]["fraction"] == pytest.approx(0.625)
        finally:
            await syncer.stop()

    run(scenario())


@pytest.mark.parametrize("credit", [True, False])
def test_syncer_counts_a_loud_push_a_round_of_the_budget(tmp_path: Path, credit: bool) -> None:
    """In process, as above: island-0's round of 4 steps and 32 tokens, then island-1's 16
    claimed steps and 128 tokens, credited 5 (H 4 + overlap 1). The budget counts 5 / 16 of its
    tokens, 40: the job's tokens 32 + 40 = 72 (160 without the credit), the merge log's entry
    40, island-1's merged tokens 40 and its refused 128 - 40 = 88 (0: its learner's count is
    its merged tokens)."""
    guard = {"movementFactor": 1.5, "pairCredit": credit}
    spec = make_spec(
        **{**PAIR, "syncer": {"guards": guard}},
        sync={"fragments": 1, "quorum": 1, "graceSeconds": 0},
    )

    def filled(syncer: Any, value: float) -> dict[str, torch.Tensor]:
        return {n: torch.full_like(syncer.model.weights[n], value) for n in syncer.fragments[0]}

    async def scenario() -> None:
        syncer = await started(spec, tmp_path, FakeClock())
        try:
            for island in ("island-0", "island-1"):
                await syncer.islands.join(island, 1)
            push = body(syncer, 0, "island-0", filled(syncer, 1e-3), steps=4, tokens=32)
            assert (await syncer.receive_push(0, push))["accepted"]
            await syncer.tick()
            assert syncer.tokens == 32
            meta = {"steps": 16, "tokens": 128, "stepTime": 0.001}
            push = body(syncer, 0, "island-1", filled(syncer, 8e-3), **meta)
            assert (await syncer.receive_push(0, push))["accepted"]
            await syncer.tick()
            merges = [json.loads(x) for x in (tmp_path / "merges.jsonl").read_text().splitlines()]
            (loud,) = merges[-1]["contributors"]
            assert loud["island"] == "island-1" and loud["tokens"] == 128  # its claim, as pushed
            rec = syncer.state.membership.islands["island-1"]
            if credit:
                assert (syncer.tokens, merges[-1]["tokens"]) == (72, 40)
                assert (rec.merged_tokens, rec.refused_tokens) == (40.0, 88.0)
            else:
                assert (syncer.tokens, merges[-1]["tokens"]) == (160, 128)
                assert (rec.merged_tokens, rec.refused_tokens) == (128.0, 0.0)
            honest = syncer.state.membership.islands["island-0"]
            assert (honest.merged_tokens, honest.refused_tokens) == (32.0, 0.0)
        finally:
            await syncer.stop()

    run(scenario())


def test_syncer_counts_the_whole_claim_on_k_equal_m_shares(tmp_path: Path) -> None:
    """K = M = 2, every round H (no stop targets: the islands drain on their 1/M shares in their
    own counts): the same two pushes in one merge, island-1's credited 5 steps as work (1.25,
    fraction (1 + 1.25) / 2 = 1.125), but the budget counts its 128 tokens whole: 32 + 128 =
    160, island-1's merged tokens 128, refused 0. Counted 40, the job's tokens stayed short of
    what the shares add up to and an honest streaming pair trained on past its budget."""
    spec = make_spec(**PAIR, sync={"fragments": 1, "quorum": 2, "graceSeconds": 0})

    def filled(syncer: Any, value: float) -> dict[str, torch.Tensor]:
        return {n: torch.full_like(syncer.model.weights[n], value) for n in syncer.fragments[0]}

    async def scenario() -> None:
        syncer = await started(spec, tmp_path, FakeClock())
        try:
            assert syncer.gate.lock_step and not syncer.gate.rounds.split
            for island in ("island-0", "island-1"):
                await syncer.islands.join(island, 1)
            push = body(syncer, 0, "island-0", filled(syncer, 1e-3), steps=4, tokens=32)
            assert (await syncer.receive_push(0, push))["accepted"]
            meta = {"steps": 16, "tokens": 128, "stepTime": 0.001}
            push = body(syncer, 0, "island-1", filled(syncer, 8e-3), **meta)
            assert (await syncer.receive_push(0, push))["accepted"]
            await syncer.tick()
            merges = [json.loads(x) for x in (tmp_path / "merges.jsonl").read_text().splitlines()]
            (merge,) = merges
            works = {c["island"]: c["work"] for c in merge["contributors"]}
            assert works == {"island-0": 1.0, "island-1": pytest.approx(1.25)}
            assert merge["fraction"] == pytest.approx(1.125)
            assert (syncer.tokens, merge["tokens"]) == (160, 160)
            rec = syncer.state.membership.islands["island-1"]
            assert (rec.merged_tokens, rec.refused_tokens) == (128.0, 0.0)
        finally:
            await syncer.stop()

    run(scenario())
