"""The guards' direction check (issue 22): a push pointing against the other islands' recent
pushes is refused, one vote per island, never counted towards a drop; hand-derived cosines."""

from __future__ import annotations

import math

import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.syncer.intake import guards
from diloco_trainer.syncer.intake.direction import Directions, consensus, cosine, direction_sample

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
    code = refusal_code(g.check_delta, 0, "island-0", pushed(-1, 0))  # -0.707 < -0.5
    assert code == protocol.ERROR_NORM_OUTLIER
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
