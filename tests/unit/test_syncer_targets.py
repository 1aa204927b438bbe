"""Stop targets at K < M (syncer/state/targets.py), by hand: what is left of the budget split among
the active islands by pace once it is near, each target rounded down to a whole step of its
island."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_trainer.api.documents import HeartbeatAnswer
from diloco_trainer.api.sharding import merge_heartbeat
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.syncer.state.records import IslandRecord
from diloco_trainer.syncer.state.targets import (
    CountBound,
    Pace,
    budget_tokens,
    count_refused,
    done_range,
    drained_at_budget,
    horizon_seconds,
    lock_step_weights,
    merged_elsewhere,
    outer_steps_tokens,
    pace_of,
    pace_span_seconds,
    pace_wait_seconds,
    ready_to_split,
    running_islands,
    split_among,
    stop_targets,
)


def spec_of(**stop: Any) -> Any:
    return parse_spec(
        {
            "model": {"preset": "gpt-tiny"},
            "islands": {"count": 4},
            "inner": {"steps": 30, "batchSize": 8, "seqLen": 64},
            "sync": {"quorum": 2},
            "stopAfter": stop,
        }
    )


def test_targets_only_for_a_token_budget_that_ends_the_job() -> None:
    assert budget_tokens(spec_of(tokens=1_228_800)) == 1_228_800
    assert budget_tokens(spec_of(outerSteps=20)) is None  # rounds of work: no targets
    # 20 rounds x 4 islands x 30 steps x 512 tokens a step = 1,228,800: 21 rounds come after
    # the token budget, 10 before it.
    assert budget_tokens(spec_of(outerSteps=21, tokens=1_228_800)) == 1_228_800
    assert budget_tokens(spec_of(outerSteps=10, tokens=1_228_800)) is None


def test_targets_horizon_is_three_learner_heartbeats() -> None:
    assert horizon_seconds(60.0) == 15.0  # every 5 s
    assert horizon_seconds(10.0) == 7.5  # every 10 / 4 s


def test_targets_pace_from_the_first_and_latest_report() -> None:
    rec = IslandRecord(name="a", count_base=100.0)
    assert pace_of(rec) is None
    rec.first_report, rec.reported_tokens, rec.reported_at = (512, 10.0), 512, 10.0
    assert pace_of(rec) is None  # one report: no pace yet
    rec.reported_tokens, rec.reported_at = 5632, 20.0
    assert pace_of(rec) == Pace(base=100.0, tokens=5632, at=20.0, rate=512.0)


def test_targets_pace_needs_reports_half_a_heartbeat_interval_apart() -> None:
    """A learner reports its first steps' times at once: reports milliseconds apart, whose rate
    is noise. At a 5 s interval (timeout 60 s) a pace needs its reports more than 2.5 s apart;
    at 1 s (timeout 4 s), 0.5 s."""
    assert pace_span_seconds(60.0) == 2.5 and pace_span_seconds(4.0) == 0.5
    rec = IslandRecord(name="a")
    rec.first_report, rec.reported_tokens, rec.reported_at = (0, 10.0), 128, 10.01
    assert pace_of(rec) == Pace(base=0.0, tokens=128, at=10.01, rate=pytest.approx(12_800.0))
    assert pace_of(rec, 0.5) is None  # 10 ms: two steps' reports, no pace
    rec.reported_tokens, rec.reported_at = 3_000, 12.5
    assert pace_of(rec, 2.5) is None  # exactly 2.5 s: not more
    rec.reported_tokens, rec.reported_at = 3_120, 12.6  # 3,120 tokens over 2.6 s
    assert pace_of(rec, 2.5) == Pace(base=0.0, tokens=3_120, at=12.6, rate=pytest.approx(1_200.0))


def test_targets_wait_until_the_budget_is_within_the_horizon() -> None:
    # Two islands at 1000 and 500 tokens/s, 10,000 + 5,000 done: 15,000 of 30,000 left take
    # 10 s at 1500 tokens/s, more than a horizon of 9 s.
    paces = {"a": Pace(0.0, 10_000, 100.0, 1000.0), "b": Pace(0.0, 5_000, 100.0, 500.0)}
    args: dict[str, Any] = {
        "done_elsewhere": 0.0,
        "budget": 30_000,
        "step_tokens": {"a": 100, "b": 100},
        "horizon": 9.0,
    }
    assert stop_targets(paces, now=100.0, **args) is None
    # 1 s later each is projected on at its rate (11,000 and 5,500): 13,500 left, 9 s.
    # Split by pace: a 11,000 + 9,000 = 20,000, b 5,500 + 4,500 = 10,000.
    assert stop_targets(paces, now=101.0, **args) == {"a": 20_000, "b": 10_000}


def test_targets_count_from_the_join_round_up_to_a_step_and_leave_out_the_dropped() -> None:
    # a rejoined with 2,000 tokens merged before: its count is 2,000 behind what it did. A
    # dropped island's 3,000 merged count too. 30,000 - (2,000 + 10,000 + 5,000 + 3,000) =
    # 10,000 left, a's two thirds 6,666.7 -> 16,666.7 -> down to 16,600 (steps of 100); b's
    # 3,333.3 -> 8,333.3 -> 8,200 (steps of 200).
    paces = {"a": Pace(2_000.0, 10_000, 50.0, 1000.0), "b": Pace(0.0, 5_000, 50.0, 500.0)}
    targets = stop_targets(
        paces,
        done_elsewhere=3_000.0,
        budget=30_000,
        step_tokens={"a": 100, "b": 200},
        now=50.0,
        horizon=60.0,
    )
    assert targets == {"a": 16_600, "b": 8_200}


def test_targets_past_the_budget_drain_at_once() -> None:
    paces = {"a": Pace(0.0, 40_000, 10.0, 1000.0)}
    targets = stop_targets(
        paces, done_elsewhere=0.0, budget=30_000, step_tokens={"a": 100}, now=10.0, horizon=1.0
    )
    assert targets == {"a": 40_000}


def test_targets_merged_elsewhere_counts_inactive_islands_only() -> None:
    records = [IslandRecord(name="a", merged_tokens=5.0), IslandRecord(name="b", merged_tokens=7.0)]
    assert merged_elsewhere(records, {"a"}) == pytest.approx(7.0)


def test_targets_shards_answers_keep_the_lowest_target() -> None:
    answers = [
        HeartbeatAnswer(state="active", finished=False, versions=[1, 0], stop_at=900),
        HeartbeatAnswer(state="active", finished=False, versions=[0, 2], stop_at=800),
    ]
    assert merge_heartbeat(answers).stop_at == 800
    answers[1] = answers[1].model_copy(update={"stop_at": None})
    assert merge_heartbeat(answers).stop_at == 900


def test_targets_at_k_equal_m_split_by_tokens_per_round() -> None:
    """K = M, inner.stepsPerIsland: H = 20, 512 tokens a step, island d on H_i = 6. Tokens per
    round: a, b, c 20 x 512 = 10,240, d 6 x 512 = 3,072; 33,792 a round in all."""
    weights = lock_step_weights({"a": 20, "b": 20, "c": 20, "d": 6}, dict.fromkeys("abcd", 512))
    assert weights == {"a": 10_240.0, "b": 10_240.0, "c": 10_240.0, "d": 3_072.0}
    # After 10 rounds: a, b, c at 102,400, d at 30,720; 337,920 done. A budget of 422,400
    # leaves 84,480 = 2.5 rounds: a, b, c 102,400 + 25,600 = 128,000 (250 steps), d 30,720 +
    # 7,680 = 38,400 (75 steps); together the budget exactly. The measured paces (equal here,
    # as noise could make them) decide only when; by them d would get a quarter of 84,480.
    paces = {n: Pace(0.0, 102_400, 50.0, 1000.0) for n in "abc"}
    paces["d"] = Pace(0.0, 30_720, 50.0, 1000.0)
    targets = stop_targets(
        paces,
        done_elsewhere=0.0,
        budget=422_400,
        step_tokens=dict.fromkeys("abcd", 512),
        now=50.0,
        horizon=600.0,
        weights=weights,
    )
    assert targets == {"a": 128_000, "b": 128_000, "c": 128_000, "d": 38_400}
    # The old share, 1/M each counted in rounds of H: 422,400 / (4 x 512) = 206 steps of H,
    # 10.3 rounds for every island, 10.3 x 33,792 = 348,058 merged: 74,342 short.


def test_targets_leave_out_drained_islands_and_wait_for_the_running_to_hear_the_split() -> None:
    a, b, c = (IslandRecord(name=n) for n in "abc")
    c.drained = True
    assert [r.name for r in running_islands([a, b, c])] == ["a", "b"]
    assert ready_to_split([a, b], {"a", "b"})
    assert not ready_to_split([a, b], {"a"})  # b may still drain on its share of 1/M
    assert ready_to_split([a], {"a"})  # c drained before it heard: final, not waited for


def test_targets_at_k_equal_m_count_a_drained_islands_tokens_as_final() -> None:
    """The schedule of bench/log/2026-11-29.md's stalled run, K = M = 4, H = 30, 512 tokens a
    step, stopAfter 614,400 tokens: a share of 1/M is 614,400 / (4 x 512) = 300 steps. Island d
    is resized to 18-step rounds; b and c drained on their share (300 steps, 153,600 tokens)
    before they heard the split. What is left is split among a (H = 30) and d (H = 18) only."""
    paces = {"a": Pace(0.0, 148_480, 50.0, 5000.0), "d": Pace(0.0, 140_800, 50.0, 4000.0)}
    weights = lock_step_weights({"a": 30, "d": 18}, {"a": 512, "d": 512})
    targets = stop_targets(
        paces,
        done_elsewhere=2 * 153_600.0,  # b and c: merged_elsewhere of the islands not running
        budget=614_400,
        step_tokens={"a": 512, "d": 512},
        now=50.0,
        horizon=15.0,
        weights=weights,
    )
    # Left: 614,400 - 307,200 - 148,480 - 140,800 = 17,920; a 30/48 of it = 11,200 -> 159,680
    # (311.9 steps, down to 311 = 159,232), d 18/48 = 6,720 -> 147,520 (288.1 steps, 288 =
    # 147,456). Merged at the drain: 307,200 + 159,232 + 147,456 = 613,888, 512 short: one
    # step, within drained_at_budget's slack (a step of each active island, 2,048).
    assert targets == {"a": 159_232, "d": 147_456}
    # Split over all four as if b and c trained on (at K = M on main): 30/108 of 17,920 each
    # for a, b, c -> b and c 153,600 + 4,977.8 -> 309 steps (158,208); they drained at their
    # share, 300 steps: 2 x 4,608 undone, more than the slack, and the job stalled at the drain.
    everyone = {
        **paces,
        "b": Pace(0.0, 153_600, 50.0, 5000.0),
        "c": Pace(0.0, 153_600, 50.0, 5000.0),
    }
    old = stop_targets(
        everyone,
        done_elsewhere=0.0,
        budget=614_400,
        step_tokens=dict.fromkeys("abcd", 512),
        now=50.0,
        horizon=15.0,
        weights=lock_step_weights({"a": 30, "b": 30, "c": 30, "d": 18}, dict.fromkeys("abcd", 512)),
    )
    assert old is not None and old["b"] == old["c"] == 158_208
    assert 614_400 - (old["a"] + old["d"] + 2 * 153_600) > 4 * 512


def test_targets_wait_for_an_unknown_pace_three_heartbeats_after_the_join() -> None:
    assert pace_wait_seconds(60.0) == 15.0  # learners beat every 5 s: 3 of them
    assert pace_wait_seconds(4.0) == 3.0  # every 4 / 4 = 1 s


def test_targets_split_leaves_out_an_island_silent_past_the_wait() -> None:
    """Issue 46: a and b report their counts (a pace each); c joined at 100 s and never sends
    one (no heartbeat, or one whose count never grows). With a wait of 3 s, c holds the split
    until 103 s (its learner's first heartbeats would measure it), then is left out: the split
    is a and b's, c gets no target. On main the split waited for c for ever."""
    a, b, c = (IslandRecord(name=n, pace_since=100.0) for n in "abc")
    for rec, tokens in ((a, 6_400), (b, 3_200)):
        rec.first_report, rec.reported_tokens, rec.reported_at = (0, 100.5), tokens, 101.5
    c.first_report, c.reported_tokens, c.reported_at = (0, 100.5), 0, 101.5  # no growth
    assert pace_of(a) is not None and pace_of(b) is not None and pace_of(c) is None
    assert split_among([a, b, c], now=102.9, wait=3.0) is None  # c may still report
    assert [r.name for r in split_among([a, b, c], now=103.0, wait=3.0) or []] == ["a", "b"]
    # A record restored by a restarted syncer waits from the restore (pace_since) as from a
    # join; one whose wait start is not known is not waited for.
    c.pace_since = None
    assert [r.name for r in split_among([a, b, c], now=101.5, wait=3.0) or []] == ["a", "b"]
    # Nobody with a pace: an empty split (no targets), not a wait.
    assert split_among([c], now=200.0, wait=3.0) == []


def test_targets_left_out_island_counts_as_done() -> None:
    """The split of the test above, budget 20,000 tokens, steps of 64: a at (6,400 - 0) /
    (101.5 - 100.5) = 6,400 tokens/s, b at 3,200; c merged 1,000 before (done elsewhere).
    Projected to 103 s: a 6,400 + 1.5 x 6,400 = 16,000, b 3,200 + 1.5 x 3,200 = 8,000; done
    1,000 + 24,000 = 25,000, past the budget by 5,000: each drains at its projected count, down
    to a step: a 16,000 (250 steps), b 8,000 (125 steps). At 101.5 s (their reports' time):
    done 1,000 + 9,600, 9,400 left, 0.98 s at 9,600/s, within a horizon of 3 s: a 6,400 +
    9,400 x 2/3 = 12,666.7 -> 197 steps = 12,608; b 3,200 + 3,133.3 = 6,333.3 -> 98 steps =
    6,272."""
    a, b, c = (IslandRecord(name=n, pace_since=100.0) for n in "abc")
    for rec, tokens in ((a, 6_400), (b, 3_200)):
        rec.first_report, rec.reported_tokens, rec.reported_at = (0, 100.5), tokens, 101.5
    c.merged_tokens = 1_000.0
    split = split_among([a, b, c], now=103.0, wait=3.0) or []
    paces = {r.name: p for r in split if (p := pace_of(r)) is not None}
    args: dict[str, Any] = {
        "done_elsewhere": merged_elsewhere([a, b, c], set(paces)),
        "budget": 20_000,
        "step_tokens": {"a": 64, "b": 64},
        "horizon": 3.0,
    }
    assert args["done_elsewhere"] == 1_000.0
    assert stop_targets(paces, now=103.0, **args) == {"a": 16_000, "b": 8_000}
    targets = stop_targets(paces, now=101.5, **args)
    assert targets == {"a": 12_608, "b": 6_272}


# Issue 46 (adv15): a heartbeat's count is the island's own word. An honest island of these tests
# claims a step time of 0.2 s at 128 tokens a step (640 tokens/s) and H = 10, τ = 0: its count may
# grow at 1.5 x 128 / 0.2 = 960 tokens/s, plus a capped push's 4 x 10 = 40 steps (5,120 tokens).
BOUND = CountBound(rate=960.0, ahead=5_120.0)


def reported(name: str, first: tuple[int, float], tokens: int, at: float) -> IslandRecord:
    rec = IslandRecord(name=name, pace_since=first[1])
    rec.first_report, rec.reported_tokens, rec.reported_at = first, tokens, at
    return rec


def test_targets_count_growing_faster_than_the_island_could_is_refused() -> None:
    """Growth since the first report within 960 tokens/s x the time + 5,120 is taken: over 5 s,
    4,800 + 5,120 = 9,920. One token more is not; nor a count 1,000 x an honest one's 640
    tokens/s (640,000 over 5 s), nor 2^50 in a second."""
    honest = reported("a", (0, 100.0), 3_200, 105.0)  # 640 tokens/s
    assert count_refused(honest, pace_of(honest) or Pace(0, 0, 0, 0), BOUND) is None
    edge = reported("b", (0, 100.0), 9_920, 105.0)
    assert count_refused(edge, pace_of(edge) or Pace(0, 0, 0, 0), BOUND) is None
    for tokens, at in ((9_921, 105.0), (640_000, 105.0), (2**50, 101.0)):
        rec = reported("c", (0, 100.0), tokens, at)
        why = count_refused(rec, pace_of(rec) or Pace(0, 0, 0, 0), BOUND)
        assert why is not None and "tokens" in why, (tokens, why)


def test_targets_a_count_of_two_to_the_fifty_moves_no_other_target() -> None:
    """adv15's reproduction, in the pure functions: a and b report 0 at 100 s and 640 a second
    later (640 tokens/s each); c reports 0, then 2^50. Budget 2,000, steps of 128, horizon 3 s.

    Main: c is in the split; done 1,280 + 2^50, left < 0: each drains at its projected count,
    a and b at 640 (5 steps into the job). Now: c's count grew by 2^50 in 1 s, beyond
    960 + 5,120: it is left out at once (not waited for), and a and b split 2,000 - 1,280 =
    720 left (0.56 s at 1,280/s, within 3 s): 640 + 360 = 1,000 -> 7 steps = 896 each, as a
    job of a and b alone."""
    a, b = (reported(n, (0, 100.0), 640, 101.0) for n in "ab")
    c = reported("c", (0, 100.0), 2**50, 101.0)
    bounds = {n: BOUND for n in "abc"}
    args: dict[str, Any] = {"budget": 2_000, "step_tokens": dict.fromkeys("abc", 128)}
    main = split_among([a, b, c], now=101.0, wait=3.0) or []
    assert [r.name for r in main] == ["a", "b", "c"]
    paces = {r.name: p for r in main if (p := pace_of(r)) is not None}
    got = stop_targets(paces, done_elsewhere=0.0, now=101.0, horizon=3.0, **args)
    assert got == {"a": 640, "b": 640, "c": 2**50}  # main's
    split = split_among([a, b, c], now=101.0, wait=3.0, bounds=bounds) or []
    assert [r.name for r in split] == ["a", "b"]
    paces = {r.name: p for r in split if (p := pace_of(r)) is not None}
    ranges = {r.name: done_range(r, BOUND) for r in split}
    got = stop_targets(
        paces, done_elsewhere=0.0, now=101.0, horizon=3.0, done_ranges=ranges, **args
    )
    assert got == {"a": 896, "b": 896}
    alone = {n: paces[n] for n in "ab"}
    assert got == stop_targets(alone, done_elsewhere=0.0, now=101.0, horizon=3.0, **args)


def test_targets_count_within_the_rate_counts_as_done_within_its_record() -> None:
    """A count that starts at 2^50 and then grows at 640 tokens/s is within the rate bound, but
    its part of what is done is held to its merged tokens (0) + 5,120: a, b at 640 each and c
    held to 5,120: done 6,400 of a budget of 9,000, 2,600 left (1.35 s at 1,920/s): a and b
    640 + 866.7 = 1,506.7 -> 11 steps = 1,408; c, from its part as held, 5,120 + 866.7 =
    5,986.7 -> 46 steps = 5,888 (below its count: it drains at once). On main (no ranges)
    left < 0 and a and b drained at 640. A count below its merged tokens counts as them, in
    `done` and in its own target alike (so that they add up to the budget): d, merged 3,000,
    reports 640: its part is 3,000, not 640."""
    a, b = (reported(n, (0, 100.0), 640, 101.0) for n in "ab")
    c = reported("c", (2**50 - 640, 100.0), 2**50, 101.0)
    assert count_refused(c, pace_of(c) or Pace(0, 0, 0, 0), BOUND) is None
    paces = {r.name: p for r in (a, b, c) if (p := pace_of(r)) is not None}
    args: dict[str, Any] = {
        "budget": 9_000,
        "step_tokens": dict.fromkeys("abcd", 128),
        "done_elsewhere": 0.0,
        "now": 101.0,
        "horizon": 3.0,
    }
    assert stop_targets(paces, **args) == {"a": 640, "b": 640, "c": 2**50}  # main's
    ranges = {r.name: done_range(r, BOUND) for r in (a, b, c)}
    got = stop_targets(paces, done_ranges=ranges, **args)
    assert got == {"a": 1_408, "b": 1_408, "c": 5_888}
    # d: budget 9,000, a and d at 640/s; done 640 + 3,000, 5,360 left (4.2 s at 1,280/s:
    # horizon 5 s): each 2,680 more: a 3,320 -> 25 steps = 3,200, d 3,000 + 2,680 = 5,680 ->
    # 44 steps = 5,632 (from its count as 640 + 2,680 it would drain 2,360 short of the budget:
    # the K = M drain of tests/e2e/test_island_rounds.py that trained on past it).
    d = reported("d", (0, 100.0), 640, 101.0)
    d.merged_tokens = 3_000.0
    assert done_range(d, BOUND) == (3_000.0, 8_120.0)
    paces = {r.name: p for r in (a, d) if (p := pace_of(r)) is not None}
    ranges = {r.name: done_range(r, BOUND) for r in (a, d)}
    args["horizon"] = 5.0
    assert stop_targets(paces, done_ranges=ranges, **args) == {"a": 3_200, "d": 5_632}


def test_targets_refused_pushes_keep_an_honest_islands_target() -> None:
    """An honest count runs ahead of its merged tokens by its refused pushes' tokens for good
    (not trained again). a merged 1,000 and counts 8,000, 2,560 of them refused (4,440
    pending); b merged 7,000 of its 8,000. A capped push 5,120 (a's bound's ahead 7,680 with
    the refused). Budget 20,000, 640 tokens/s each, horizon 10 s.

    Now (adv17): a's part is its count less the refused, 5,440, within [1,000, 6,120]; done
    13,440, 6,560 left, 3,280 each: a 5,440 + 2,560 + 3,280 = 11,280 -> 88 steps = 11,264 in
    its count, b 11,280 -> 11,264. What merges: a 1,000 + 4,440 + 3,264 = 8,704, b 8,000 +
    3,264 = 11,264: 19,968, the budget but for the rounding. Main (adv16: the refused in its
    part, the range 7,680 wide): done 16,000, 2,000 each, 9,984 each: merges 1,000 + 4,440 +
    1,984 + 9,984 = 17,408, short by the refused 2,560 (and the rounding): every island
    drained short and waited in vain (tests/e2e/test_drain.py's restart, a push refused as
    too stale)."""
    a = reported("a", (7_360, 100.0), 8_000, 101.0)
    a.merged_tokens, a.refused_tokens = 1_000.0, 2_560.0
    b = reported("b", (7_360, 100.0), 8_000, 101.0)
    b.merged_tokens = 7_000.0
    refused = CountBound(rate=960.0, ahead=5_120.0 + 2_560.0)
    paces = {r.name: p for r in (a, b) if (p := pace_of(r)) is not None}
    assert paces["a"].base == -2_560.0
    args: dict[str, Any] = {
        "budget": 20_000,
        "step_tokens": {"a": 128, "b": 128},
        "done_elsewhere": 0.0,
        "now": 101.0,
        "horizon": 10.0,
    }
    ranges = {"a": done_range(a, refused), "b": done_range(b, BOUND)}
    assert ranges == {"a": (1_000.0, 6_120.0), "b": (7_000.0, 12_120.0)}
    got = stop_targets(paces, done_ranges=ranges, **args)
    assert got == {"a": 11_264, "b": 11_264}
    merges = 1_000 + 4_440 + (got["a"] - 8_000) + 8_000 + (got["b"] - 8_000)
    assert merges == 19_968


def test_targets_pushes_lost_at_the_edge_leave_an_honest_island_in_the_split() -> None:
    """adv17 (issue 46): a push refused at the edge before its metadata is read (413 too big,
    408 too slow, 400 cut short: not retried; 503 is, for 600 s) or given up after the
    client's retries is lost to its learner, and the syncer cannot count it (no island is
    known then). Island a merged 1,000 and counts 8,000 (base 0): 4,440 pending and 2,560 lost
    so, 7,000 ahead of its merged tokens, past a capped push (5,120). b merged 7,000 of its
    8,000. 640 tokens/s each, budget 20,000, horizon 10 s.

    a grew by 640 in 1 s since its first report (within 960 + 5,120): it stays in the split;
    the loss is no growth. Its part of what is done is held to 1,000 + 5,120 = 6,120: done
    14,120, 5,880 left, 2,940 each: a 6,120 + 2,940 = 9,060 -> 70 steps (8,960), b 10,940 -> 85
    steps (10,880). What merges: a 1,000 + 4,440 + 960 = 6,400, b 8,000 + 2,880 = 10,880:
    17,280, the budget short by 2,720 (a's 2,560 lost, and the rounding), not overshot: the
    islands drain, wait out their wait (learner/drain.py) and train on until a merge reaches
    it. Counted at its count (no range, as before adv16) it is as short: done 16,000, 2,000
    each, a 9,984 (merges 1,000 + 4,440 + 1,984 = 7,424), b 9,984: 17,408."""
    a = reported("a", (7_360, 100.0), 8_000, 101.0)
    a.merged_tokens = 1_000.0
    b = reported("b", (7_360, 100.0), 8_000, 101.0)
    b.merged_tokens = 7_000.0
    bounds = {"a": BOUND, "b": BOUND}
    assert split_among([a, b], now=101.0, wait=3.0, bounds=bounds) == [a, b]
    paces = {r.name: p for r in (a, b) if (p := pace_of(r)) is not None}
    args: dict[str, Any] = {
        "budget": 20_000,
        "step_tokens": {"a": 128, "b": 128},
        "done_elsewhere": 0.0,
        "now": 101.0,
        "horizon": 10.0,
    }
    ranges = {n: done_range(r, BOUND) for n, r in (("a", a), ("b", b))}
    assert ranges == {"a": (1_000.0, 6_120.0), "b": (7_000.0, 12_120.0)}
    held = stop_targets(paces, done_ranges=ranges, **args)
    assert held == {"a": 8_960, "b": 10_880}
    # what merges: a's 1,000 + its 4,440 pending + what it trains to its target; b's likewise
    merges = 1_000 + 4_440 + (held["a"] - 8_000) + 8_000 + (held["b"] - 8_000)
    assert merges == 17_280 < 20_000
    assert stop_targets(paces, **args) == {"a": 9_984, "b": 9_984}


def test_drained_at_budget_counts_outer_steps_in_tokens_where_islands_keep_shares() -> None:
    # 20 rounds x 4 islands x 30 steps x 512 tokens a step (8 x 64) = 1,228,800; the slack is
    # a step of each active island: 4 x 512 = 2,048.
    active = [IslandRecord(name=n) for n in "abcd"]
    rounds = spec_of(outerSteps=20)
    assert outer_steps_tokens(rounds) == 1_228_800
    assert drained_at_budget(rounds, 1_226_752, active, shares_kept=True)
    assert not drained_at_budget(rounds, 1_226_751, active, shares_kept=True)
    # A made-up merge counted once as a fold leaves the outer steps short, not the tokens.
    assert drained_at_budget(rounds, 1_500_000, active, shares_kept=True)
    # K < M, or rounds that differ: no share of outerSteps, so only a token budget counts.
    assert not drained_at_budget(rounds, 1_500_000, active)
    both = spec_of(outerSteps=20, tokens=614_400)  # the fewer of the two
    assert drained_at_budget(both, 612_352, active, shares_kept=True)
    assert not drained_at_budget(both, 612_351, active, shares_kept=True)
    assert drained_at_budget(both, 612_352, active)
    assert outer_steps_tokens(spec_of(tokens=614_400)) is None
