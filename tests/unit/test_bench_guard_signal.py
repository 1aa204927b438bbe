"""bench.studies.guard_signal replays syncer.qualityGuard's rule on a run's evaluations: the
largest margin that trips it, where it trips and which checkpoint it keeps, and each
evaluation's honest tokens from the merge log. Expected values derived by hand below."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.studies.guard_signal import (
    Evaluation,
    Replay,
    Setting,
    read_run,
    replay,
    separation,
    trip_margin,
)

# Outer steps 0 (the initial weights) to 5.
LOSSES = [5.0, 3.0, 3.3, 3.6, 3.15, 2.9]
STEPS = [0, 1, 2, 3, 4, 5]


def test_trip_margin_is_the_largest_window_minimum_over_the_best_before_it() -> None:
    # Patience 1: each loss over the least before it: 3.3 / 3.0 = 1.1, 3.6 / 3.0 = 1.2 (the
    # most, at index 3), 3.15 / 3.0 = 1.05, 2.9 / 3.0 < 1.
    margin, where = trip_margin(LOSSES, STEPS, patience=1, warmup=0)
    assert margin == pytest.approx(0.2) and where == 3
    # Patience 2: windows (3.3, 3.6) -> 3.3 / 3.0 = 1.1 (index 3), (3.6, 3.15) -> 1.05.
    margin, where = trip_margin(LOSSES, STEPS, patience=2, warmup=0)
    assert margin == pytest.approx(0.1) and where == 3
    # Warm-up 3: only steps 4 and 5 are judged: (3.15, 2.9) -> 2.9 / 3.0 - 1 = -1/30.
    margin, where = trip_margin(LOSSES, STEPS, patience=2, warmup=3)
    assert margin == pytest.approx(-1 / 30) and where == 5
    # More patience than evaluations after the first: no window.
    assert trip_margin(LOSSES, STEPS, patience=6, warmup=0) == (-math.inf, None)


def test_replay_trips_below_that_margin_and_not_at_it() -> None:
    # Just under 10%: 3.3 and 3.6 are both above 1.099 x 3.0 = 3.297: trips at index 3; the
    # best at step 1 was checkpointed at once (no best on disk yet).
    assert replay(LOSSES, STEPS, Setting(0.099, 2, 0)) == Replay(trip=3, kept=1)
    # At 10% exactly 3.3 is no rise (strict): no trip; the best of step 5 is checkpointed (a
    # checkpoint is due there: 5 % 5 == 0).
    assert replay(LOSSES, STEPS, Setting(0.1, 2, 0)) == Replay(trip=None, kept=5)
    # The warm-up keeps steps 2 and 3 from counting: (3.15, 2.9) never trips.
    assert replay(LOSSES, STEPS, Setting(0.01, 2, 3)) == Replay(trip=None, kept=5)


def test_replay_keeps_a_best_within_the_margin_of_the_best_evaluation() -> None:
    # Bests at steps 1, 2 and 3 (4.0, 3.0, 2.0), none at a multiple of CHECKPOINT_EVERY (5) nor
    # an interval after the kept one: step 1's is written at once (none kept yet); step 2's
    # because the kept 4.0 is above 1.1 x 3.0 = 3.3; step 3's because 3.0 is above
    # 1.1 x 2.0 = 2.2 (state/quality.best_due). 2.5 and 2.6 are above 2.2: the trip at index 5
    # keeps step 3's checkpoint, the best evaluation itself.
    losses = [5.0, 4.0, 3.0, 2.0, 2.5, 2.6]
    assert replay(losses, STEPS, Setting(0.1, 2, 0)) == Replay(trip=5, kept=3)
    # At a margin of 0.5 step 2's is not written (the kept 4.0 is not above 1.5 x 3.0 = 4.5),
    # step 3's is (4.0 is above 1.5 x 2.0 = 3.0). 2.5 and 2.6 are under 3.0: no trip.
    assert replay(losses, STEPS, Setting(0.5, 2, 0)) == Replay(trip=None, kept=3)


def test_read_run_gives_each_evaluation_the_honest_tokens_merged_up_to_its_step(
    tmp_path: Path,
) -> None:
    run = tmp_path / "faint_claims-0"
    (run / "syncer").mkdir(parents=True)
    merges = [
        {"outerStep": 1, "contributors": [{"island": "island-0", "tokens": 5120}]},
        {
            "outerStep": 3,
            "contributors": [
                {"island": "island-0", "tokens": 10240},
                {"island": "island-1", "tokens": 20480},
            ],
        },
        {"outerStep": 5, "contributors": [{"island": "island-1", "tokens": 20480}]},
    ]
    (run / "syncer" / "merges.jsonl").write_text("".join(json.dumps(m) + "\n" for m in merges))
    (run / "syncer.0.log").write_text(
        "2026-11-30 INFO diloco.syncer: fresh start: 1 fragments, initial eval loss 5.5\n"
        "2026-11-30 INFO diloco.syncer: eval at outer step 1 (5120 tokens): loss 4.4442\n"
        "2026-11-30 INFO diloco.syncer: merged fragment 0 -> version 2 (outer step 3, ...)\n"
        "2026-11-30 INFO diloco.syncer: eval at outer step 3 (35840 tokens): loss 3.2\n"
        "2026-11-30 INFO diloco.syncer: final eval at outer step 5 (56320 tokens): loss 3.4\n"
    )
    # Honest tokens: island-0's only: 5120 at step 1, 5120 + 10240 = 15360 at 3 and at 5.
    assert read_run(run, ["island-0"]) == [
        Evaluation(0, 0, 5.5),
        Evaluation(1, 5120, 4.4442),
        Evaluation(3, 15360, 3.2),
        Evaluation(5, 15360, 3.4),
    ]
    # Every island honest (a `diloco run` folder's reading): all tokens.
    assert [e.honest for e in read_run(run, None)] == [0, 5120, 35840, 56320]


def test_separation_needs_every_attack_above_every_honest_run() -> None:
    # Honest runs trip at up to 8.0% (run b), attacks at 8.6% and up: any margin in
    # [8.0%, 8.6%) trips every attack and no honest run.
    honest = [(0.02, "a"), (0.08, "b")]
    assert separation(honest, [(0.13, "d"), (0.086, "c")]) == ((0.08, "b"), (0.086, "c"), True)
    # One honest run at 20.9%: no margin trips the 8.6% attack and spares it.
    assert separation([*honest, (0.209, "e")], [(0.086, "c")])[2] is False
    # Equal is not apart: the rule's strict comparison trips both or neither.
    assert separation([(0.05, "a")], [(0.05, "c")])[2] is False
