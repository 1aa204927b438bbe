"""The guards' direction check (issue 22): a push pointing against the other islands' recent
pushes is refused, one vote per island, never counted towards a drop; hand-derived cosines."""

from __future__ import annotations

import math

import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.syncer.intake import guards
from diloco_trainer.syncer.intake.direction import (
    Directions,
    DirectionVerdict,
    consensus,
    cosine,
    direction_sample,
)

from .test_syncer_guards import guard, refusal_code


def v(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def pushed(*xs: float) -> guards.DeltaStats:
    """The stats of a push whose sample is `xs` (its norm far inside every bound)."""
    return guards.DeltaStats(1e-3, True, v(*xs))


def test_direction_sample_takes_fixed_positions_in_name_order() -> None:
    payload = {"b": torch.ones(3), "a": torch.arange(10.0)}
    # 13 elements, 5 wanted: stride ceil(13 / 5) = 3; a[::3] = 0 3 6 9, then b[::3] = 1.
    assert direction_sample(payload, size=5).tolist() == [0.0, 3.0, 6.0, 9.0, 1.0]
    assert direction_sample(payload, size=100).numel() == 13  # small: every element
    assert direction_sample({}).numel() == 0
    assert guards.delta_stats(payload).sample is not None  # computed with the norm


def test_direction_cosine_and_consensus_hand_derived() -> None:
    assert cosine(v(1, 0), v(0, 1)) == 0.0
    assert cosine(v(1, 1), v(-1, -1)) == pytest.approx(-1.0)
    assert cosine(v(3, 4), v(4, 3)) == pytest.approx(24 / 25)
    assert cosine(v(0, 0), v(1, 1)) == 0.0  # a zero push has no direction
    # One vote each: (2, 0) and (0, 5) count as (1, 0) + (0, 1).
    assert consensus([v(2, 0), v(0, 5), v(0, 0)]).tolist() == [1.0, 1.0]


def test_direction_against_others_needs_two_recent_other_islands() -> None:
    d = Directions(fragments=1)
    d.record(0, "island-1", v(1, 0))
    assert d.against_others(0, "island-0", v(-1, -1)) is None  # one other island: no check
    d.record(0, "island-0", v(-1, -1))  # its own pushes are never its reference
    assert d.against_others(0, "island-0", v(-1, -1)) is None
    d.record(0, "island-2", v(0, 1))
    # Against (1, 0) + (0, 1): (-1, -1) -> -1; (-1, 0) -> -1/sqrt 2; (-1, 0.5) -> -0.5 / (1.118
    # x 1.414) = -0.316; (1, -1) -> 0.
    assert d.against_others(0, "island-0", v(-1, -1)) == pytest.approx(-1.0)
    assert d.against_others(0, "island-0", v(-1, 0)) == pytest.approx(-1 / math.sqrt(2))
    assert d.against_others(0, "island-0", v(-1, 0.5)) == pytest.approx(-0.5 / math.sqrt(2.5))
    assert d.against_others(0, "island-0", v(1, -1)) == pytest.approx(0.0)
    for _ in range(100):  # island-2 pushing again and again: still one vote
        d.record(0, "island-2", v(0, 1))
    assert d.against_others(0, "island-0", v(-1, -1)) == pytest.approx(-1.0)


def test_guards_direction_check_refuses_against_the_others_never_counts() -> None:
    g = guard(maxDeltaNorm=1e6, maxRefusals=2)
    g.accepted(0, "island-1", pushed(1, 0))
    g.accepted(0, "island-2", pushed(0, 1))
    g.check_delta(0, "island-0", pushed(-1, 0.5))  # -0.316: a different view, accepted
    g.check_delta(0, "island-0", pushed(1, -1))  # 0: orthogonal, accepted
    # Against (1, 0) and (0, 1) each (one vote's threshold -0.5 / sqrt 2 = -0.354) and their
    # sum: (-1, -0.5) -> -1/1.118 = -0.894 and -0.5/1.118 = -0.447, both below; sum
    # -1.5 / (1.118 x 1.414) = -0.949 < -0.5: refused.
    code = refusal_code(g.check_delta, 0, "island-0", pushed(-1, -0.5))
    assert code == protocol.ERROR_NORM_OUTLIER
    # (-1, 0) is -0.707 against the sum, but against one of the two only (-1 and 0): that one
    # may be an adversary pushing against an honest island (issue 46), accepted. It was refused
    # before; this is the rule the issue changes.
    g.check_delta(0, "island-0", pushed(-1, 0))
    with pytest.raises(guards.ContributionRefused) as err:
        g.check_delta(0, "island-0", pushed(-1, -1))
    assert err.value.own_fault is False
    assert [g.refused("island-0", err.value) for _ in range(5)] == [False] * 5  # never dropped
    g.check_delta(1, "island-0", pushed(-1, -1))  # fragment 1 has no other pushes
    g.check_delta(0, "island-0", guards.DeltaStats(1e-3, True))  # no sample: no check


def test_guards_direction_one_island_flooding_has_one_vote() -> None:
    """An island pushing again and again in its own direction cannot make the honest ones'
    pushes point 'against' the reference: its latest push is one vote of three."""
    g = guard(maxDeltaNorm=1e6)
    g.accepted(0, "island-1", pushed(1, 1))
    for _ in range(100):
        g.accepted(0, "island-2", pushed(-1, -1.2))  # the adversary's direction
    g.accepted(0, "island-3", pushed(1, 0.8))
    # island-0 (honest, along island-1 and island-3) against (1,1)/1.414 + (-1,-1.2)/1.562 +
    # (1,0.8)/1.281 = (0.848, 0.564): cosine with (1, 1) is +0.98.
    assert g.directions.against_others(0, "island-0", v(1, 1)) == pytest.approx(0.9803, abs=1e-4)
    g.check_delta(0, "island-0", pushed(1, 1))


def test_direction_verdict_needs_a_majority_of_the_others_each_against() -> None:
    """Issue 46: an island knowing an honest island's direction pushes against it; its one vote
    must not get the honest island's pushes refused. Hand-derived, n others, one vote's
    threshold -0.5 / sqrt(n)."""
    d = Directions(fragments=1)
    d.record(0, "honest-b", v(0, 1))
    # The adversary: (-1, 0.3) against honest-a's (1, 0); against the others' sum (1, 0) + (0, 1)
    # it is (-1 + 0.3) / (1.044 x 1.414) = -0.474, above -0.5: accepted itself.
    d.record(0, "adversary", v(-1, 0.3))
    verdict = d.judge(0, "honest-a", v(1, 0))
    assert verdict is not None
    # honest-a against (0, 1) + (-1, 0.3)/1.044 = (-0.958, 1.287): -0.958 / 1.605 = -0.597 <
    # -0.5 (the old rule refused it), but only the adversary (-0.958) is below -0.354; honest-b
    # is at 0: 1 of 2 is no majority.
    assert verdict.cosine == pytest.approx(-0.958 / 1.6045, abs=1e-3)
    assert (verdict.against, verdict.others, verdict.refused) == (1, 2, False)
    assert verdict.one_against == pytest.approx(-0.5 / math.sqrt(2))
    # The sign flip of both honest islands is still refused: against (1, 0) and (0, 1),
    # (-1, -1) is -0.707 each, -1 against the sum.
    d.record(0, "honest-a", v(1, 0))
    flip = d.judge(0, "adversary", v(-1, -1))
    assert flip is not None and (flip.against, flip.others, flip.refused) == (2, 2, True)
    # Four others, threshold -0.25: a flip of three orthogonal honest votes (1,0,0), (0,1,0),
    # (0,0,1) is -1/sqrt 3 = -0.577 against each; a fourth vote (the adversary's accomplice)
    # along it is +1. Sum (1,1,1) + (-1,-1,-1)/1.732 = 0.423 x (1,1,1): cosine -1. 3 of 4: refused.
    e = Directions(fragments=1)
    for name, s in [("a", v(1, 0, 0)), ("b", v(0, 1, 0)), ("c", v(0, 0, 1)), ("x", v(-1, -1, -1))]:
        e.record(0, name, s)
    four = e.judge(0, "y", v(-1, -1, -1))
    assert four is not None and (four.against, four.others, four.refused) == (3, 4, True)
    assert four.cosine == pytest.approx(-1.0)
    # Two adversaries of five (f < M/2) against honest "a": others b, c (honest, orthogonal to a)
    # and x, y at (-1, 0, 0): sum (0, 1, 1) + 2 x (-1, 0, 0) = (-2, 1, 1), cosine -2 / 2.449 =
    # -0.816 < -0.5, but 2 of 4 each below -0.25 is no strict majority: accepted.
    e.record(0, "x", v(-1, 0, 0))
    e.record(0, "y", v(-1, 0, 0))
    honest = e.judge(0, "a", v(1, 0, 0))
    assert honest is not None and honest.cosine == pytest.approx(-2 / math.sqrt(6))
    assert (honest.against, honest.others, honest.refused) == (2, 4, False)
    assert (
        DirectionVerdict(cosine=-0.49, against=4, others=4).refused is False
    )  # the sum's rule too
