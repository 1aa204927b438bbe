"""bench/hetero's readings of an eval history: time to a target loss and loss at equal tokens,
interpolated between evaluations, and the K = M merges' waits for each island (hand-derived
values)."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.harness.merge_waits import pushes_in, waits_alone
from bench.hetero import (
    all_or_none,
    fast_utilisation,
    loss_at,
    mean_reached,
    parse_mix,
    plan_runs,
    time_to,
)

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


def test_merge_waits_are_the_last_push_less_the_second_last() -> None:
    """Three islands, three merges (fragment, base version) with every island's push; the first
    merge (the earliest to complete) is left out. Merge (0, 1): a at 10.0, b at 10.5, c at 12.0:
    waited 1.5 s for c alone. Merge (1, 1): c 13.0, a 13.25, b 14.0: 0.75 s for b. Merge (0, 0),
    complete at 5.0, is the first: left out. (1, 0) lacks c's push: not a merge of all."""
    pushes = {
        "a": {(0, 0): 4.0, (0, 1): 10.0, (1, 1): 13.25, (1, 0): 6.0},
        "b": {(0, 0): 4.5, (0, 1): 10.5, (1, 1): 14.0, (1, 0): 7.0},
        "c": {(0, 0): 5.0, (0, 1): 12.0, (1, 1): 13.0},
    }
    assert waits_alone(pushes) == {"a": 0.0, "b": 0.75, "c": 1.5}
    assert waits_alone({"a": {(0, 0): 1.0}}) == {"a": 0.0}


def test_pushes_are_read_from_a_learners_log_lines() -> None:
    text = (
        "2026-11-29 11:09:07,448 INFO island-0/0 diloco.learner: step 20: fragment 0 pushed "
        "(base version 0, 278528 bytes none, 10240 tokens in 20 steps; 0.006s on the training "
        "thread)\n"
        "2026-11-29 11:09:07,496 INFO island-0/0 diloco.learner: step 21: fragment 0 applied "
        "version 1 (merged, 0.04s after the push)\n"
        "2026-11-29 11:09:07,774 INFO island-0/0 diloco.learner: step 30: fragment 1 pushed "
        "(base version 0, 269312 bytes none, 15360 tokens in 30 steps)\n"
    )
    got = pushes_in(text)
    assert list(got) == [(0, 0), (1, 0)]
    assert got[(1, 0)] - got[(0, 0)] == pytest.approx(0.326)


def test_repeats_interleave_baselines_and_mixed_runs() -> None:
    """--repeats 2, one mix at K = 4 and 1, auto only: baseline, the fast islands alone, the
    mixed runs, then all of them again; the 1,1,1,3 mix's fast islands alone are 3, and every
    repeat of a configuration shares its key."""
    args = argparse.Namespace(
        repeats=2,
        quorums=[4, 1],
        no_fixed=True,
        preset="gpt-tiny",
        seed=0,
        eval_tokens=4096,
        inner_steps=20,
        batch_size=4,
        seq_len=64,
    )
    runs = plan_runs(args, [parse_mix("1,1,1,3")], budget=1000, extra=1500)
    assert [(name, key) for name, key, _, _ in runs] == [
        ("equal speeds, K=4 #1", "equal speeds, K=4"),
        ("3 fast islands alone, K=3 #1", "3 fast islands alone, K=3"),
        ("1,1,1,3 auto, K=4 #1", "1,1,1,3 auto, K=4"),
        ("1,1,1,3 auto, K=1 #1", "1,1,1,3 auto, K=1"),
        ("equal speeds, K=4 #2", "equal speeds, K=4"),
        ("3 fast islands alone, K=3 #2", "3 fast islands alone, K=3"),
        ("1,1,1,3 auto, K=4 #2", "1,1,1,3 auto, K=4"),
        ("1,1,1,3 auto, K=1 #2", "1,1,1,3 auto, K=1"),
    ]
    equal, alone, mixed = runs[0], runs[1], runs[3]
    assert equal[2] == [1.0] * 4 and equal[3].stop_after.tokens == 1000
    assert equal[3].sync.quorum == 4 and equal[3].inner.steps_per_island == "fixed"
    assert alone[3].islands.count == 3 and alone[3].stop_after.tokens == 1500
    assert mixed[2] == [1.0, 1.0, 1.0, 3.0] and mixed[3].sync.quorum == 1
    assert mixed[3].inner.steps_per_island == "auto"
    args.repeats = 1  # the default: names carry no number
    names = [name for name, *_ in plan_runs(args, [[1.0, 1.0, 1.0, 3.0]], 1000, 1500)]
    assert names[:3] == ["equal speeds, K=4", "3 fast islands alone, K=3", "1,1,1,3 auto, K=4"]


def test_fast_utilisation_and_verdicts_over_repeats() -> None:
    run = {"utilisation": {"a": 0.9, "b": 0.8, "c": 0.2}}
    assert fast_utilisation(run, [1, 1, 3]) == pytest.approx(0.85)  # the slowed island left out
    assert all_or_none([True, True]) == "met"
    assert all_or_none([False, False]) == "MISSED"
    assert all_or_none([True, False, True]) == "met in 2 of 3"
    assert mean_reached([30.0, None, 40.0]) == 35.0  # a run that never reached it is left out
    assert mean_reached([None]) is None
