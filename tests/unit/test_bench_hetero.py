"""bench/hetero's readings of an eval history: time to a target loss and loss at equal tokens,
interpolated between evaluations (hand-derived values)."""

from __future__ import annotations

import math

from bench.hetero import loss_at, parse_mix, time_to

EVALS = [
    {"tokens": 0, "evalLoss": 4.0, "time": 100.0},
    {"tokens": 1000, "evalLoss": 3.0, "time": 110.0},
    {"tokens": 2000, "evalLoss": 2.0, "time": 130.0},
]


def test_time_to_a_target_interpolates_between_evaluations() -> None:
    # 2.5 lies halfway from 3.0 (t = 110) to 2.0 (t = 130): t = 120, 20 s after the start at 100
    assert time_to(EVALS, 2.5, started=100.0) == 20.0
    assert time_to(EVALS, 4.0, started=90.0) == 10.0  # the first evaluation already meets it
    assert time_to(EVALS, 1.0, started=100.0) is None  # never reached


def test_loss_at_equal_tokens_interpolates_over_tokens() -> None:
    assert loss_at(EVALS, 1500) == 2.5
    assert loss_at(EVALS, 1000) == 3.0
    assert math.isnan(loss_at(EVALS, 5000))


def test_parse_mix() -> None:
    assert parse_mix("1,1,2,4") == [1.0, 1.0, 2.0, 4.0]
