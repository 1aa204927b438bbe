"""bench/hetero's readings of an eval history: time to a target loss and loss at equal tokens,
interpolated between evaluations, and the K = M merges' waits for each island (hand-derived
values), and its emulated-accelerator option (--emulate-step-ms) in a smoke run."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from bench.harness.common import Table
from bench.harness.hetero_figures import round_paths
from bench.harness.measure import islands_over, rate_of
from bench.harness.merge_waits import pushes_in, waits_alone
from bench.hetero import (
    CPU,
    add_cpu_target,
    all_or_none,
    emulated_env,
    fast_utilisation,
    loss_at,
    main,
    make_spec,
    mean_reached,
    mix_label,
    mix_problem,
    over_pace,
    paced_env,
    parse_mix,
    plan_runs,
    time_to,
)

EVALS = [
    {"tokens": 0, "evalLoss": 4.0, "time": 100.0},
    {"tokens": 1000, "evalLoss": 3.0, "time": 110.0},
    {"tokens": 2000, "evalLoss": 2.0, "time": 130.0},
]


def hetero_args(**options: object) -> argparse.Namespace:
    """bench.hetero's parsed options for a gpt-tiny job (H = 20, 4 x 64 tokens a step), plus
    the `options` a test sets."""
    return argparse.Namespace(
        preset="gpt-tiny",
        seed=0,
        eval_tokens=4096,
        inner_steps=20,
        batch_size=4,
        seq_len=64,
        **options,
    )


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
    # `cpu`: an island training for real beside emulated ones, its factor not set (CPU)
    assert parse_mix("1,1,1,cpu") == [1.0, 1.0, 1.0, CPU]
    assert mix_label(parse_mix("1,1,1,cpu")) == "1,1,1,cpu"
    assert mix_label([1.0, 1.0, 2.0, 4.0]) == "1,1,2,4"


def test_a_cpu_island_trains_for_real_and_needs_the_others_emulated() -> None:
    """1,1,1,cpu at T = 10 ms: the three fast islands step 10 ms (0.01 s) each, emulated; the
    CPU island gets no DILOCO_EMULATE_STEP_SECONDS (it trains). Without --emulate-step-ms every
    island would be a real CPU one: refused; so is a mix of CPU islands only. The 60 s bound
    reads the slowest emulated factor (2 x 30 000 ms = 60 s: allowed; 4 x 20 000 = 80 s: not)."""
    mix = parse_mix("1,1,1,cpu")
    assert emulated_env(mix, 10.0) == {
        0: {"DILOCO_EMULATE_STEP_SECONDS": "0.01"},
        1: {"DILOCO_EMULATE_STEP_SECONDS": "0.01"},
        2: {"DILOCO_EMULATE_STEP_SECONDS": "0.01"},
    }
    assert mix_problem([mix], 10.0) is None
    assert mix_problem([mix], 0.0) == (
        "a mix's cpu island needs --emulate-step-ms (the other islands emulated)"
    )
    assert mix_problem([[CPU, CPU]], 10.0) == "a mix needs at least one island that is not cpu"
    assert mix_problem([[1.0, 2.0, CPU]], 30_000.0) is None
    assert mix_problem([[1.0, 4.0, CPU]], 20_000.0) is not None
    assert mix_problem([[1.0, 3.0], [1.0, 1.0, 3.0]], 0.0) == (
        "every mix must have the same number of islands"
    )
    assert mix_problem([[1.0, 3.0]], 0.0) is None


def test_the_cpu_islands_share_is_judged_against_its_measured_compute_share() -> None:
    """Two runs of 1,1,1,cpu: island 3's merged-token share over its compute share 1.05 and
    0.85 (its step time 3.2x and 4.1x the fast islands'): within 10% in the first, not in the
    second, so met in 1 of 2; the fast islands' shares are not this row's."""
    targets = Table("t", ["target", "figure", "verdict"])
    rows = [
        {"shares": [0.99, 0.98, 0.99, 1.05], "speeds": [1.0, 1.0, 1.0, 3.2], "cpu": [3]},
        {"shares": [1.0, 1.0, 1.0, 0.85], "speeds": [1.0, 1.0, 1.0, 4.1], "cpu": [3]},
    ]
    add_cpu_target(targets, "1,1,1,cpu auto, K=4", rows)
    assert targets.rows == [
        [
            "1,1,1,cpu auto, K=4: the CPU island's merged-token share within 10% of its "
            "measured compute share",
            "1.050x at 3.20x the fast step time, 0.850x at 4.10x the fast step time",
            "met in 1 of 2",
        ]
    ]
    met = Table("t", ["target", "figure", "verdict"])
    add_cpu_target(met, "k", rows[:1])
    assert met.rows[0][2] == "met"


def test_movement_factor_reaches_the_spec_only_when_set() -> None:
    """--movement-factor 0 (a CPU island beside one emulated island) sets
    syncer.guards.movementFactor to 0; unset, the spec's default (1.5) stays."""
    args = hetero_args(movement_factor=None)
    spec = make_spec(args, islands=2, quorum=2, mode="auto", tokens=1000)
    assert spec.syncer.guards.movement_factor == 1.5
    args.movement_factor = 0.0
    spec = make_spec(args, islands=2, quorum=2, mode="auto", tokens=1000)
    assert spec.syncer.guards.movement_factor == 0.0


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


def test_paced_steps_pace_every_island_and_keep_the_fast_islands_alone(tmp_path: Path) -> None:
    """--pace-step-ms 200 at 1,1,1,3: every island gets DILOCO_PACE_STEP_SECONDS 0.2 (the
    learner multiplies it by its DILOCO_SLOWDOWN, 3 for the slow one); 0 paces none. The paced
    runs train, so the fast islands alone stay in the plan. Pacing and emulating exclude each
    other; a pace over 60 s is refused. Each island's steps over the pace are read from its
    rank-0 learner's exit line (the last one); an island without one is left out."""
    mix = parse_mix("1,1,1,3")
    assert paced_env(mix, 200.0) == {i: {"DILOCO_PACE_STEP_SECONDS": "0.2"} for i in range(4)}
    assert paced_env(mix, 0.0) == {}
    assert mix_problem([mix], 0.0, 200.0) is None
    assert mix_problem([mix], 50.0, 200.0) == (
        "--emulate-step-ms and --pace-step-ms exclude each other (emulated steps are paced)"
    )
    assert mix_problem([mix], 0.0, 61_000.0) == "--pace-step-ms must be >= 0 and at most 60 s"
    args = hetero_args(repeats=1, quorums=[4], no_fixed=True, emulate_step_ms=0.0)
    args.pace_step_ms = 200.0
    keys = [key for _, key, _, _ in plan_runs(args, [mix], budget=1000, extra=1500)]
    assert keys == ["equal speeds, K=4", "3 fast islands alone, K=3", "1,1,1,3 auto, K=4"]
    (tmp_path / "island-0.0.log").write_text(
        "x paced steps: 1 of 50 over the pace (0.200s a step: compute took longer)\n"
        "x paced steps: 3 of 210 over the pace (0.200s a step: compute took longer)\n"
    )
    (tmp_path / "island-1.0.log").write_text("the job has finished: exiting\n")
    assert over_pace(tmp_path, ["island-0", "island-1", "island-2"]) == {"island-0": (3, 210)}


def test_repeats_interleave_baselines_and_mixed_runs() -> None:
    """--repeats 2, one mix at K = 4 and 1, auto only: baseline, the fast islands alone, the
    mixed runs, then all of them again; the 1,1,1,3 mix's fast islands alone are 3, and every
    repeat of a configuration shares its key."""
    args = hetero_args(repeats=2, quorums=[4, 1], no_fixed=True, emulate_step_ms=0.0)
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


def test_utilisation_counts_fill_steps_from_the_tokens_consumed() -> None:
    """An island over 10 s: its schedule position 100 -> 280 (180 steps) while it consumed
    200 steps' tokens (512 a step: 51,200 -> 153,600; 20 fill steps move no position), its step
    time 0.05 s. From the tokens: 200 x 0.05 / 10 = 1.0 (and 20 steps/s); from the position, as
    the other benchmarks read it: 180 x 0.05 / 10 = 0.9."""

    def status(step: int, tokens: int) -> dict[str, object]:
        return {"islands": {"a": {"step": step, "tokens": tokens, "stepTime": 0.05}}}

    samples = [
        (0.0, status(100, 51_200)),
        (5.0, status(190, 102_400)),
        (10.0, status(280, 153_600)),
    ]
    by_tokens = islands_over(samples, 0.0, 10.0, tokens_per_step=512)["a"]
    assert by_tokens.utilisation == pytest.approx(1.0) and by_tokens.steps_per_s == 20.0
    assert islands_over(samples, 0.0, 10.0)["a"].utilisation == pytest.approx(0.9)


def test_a_moving_step_time_is_read_as_a_speed_not_a_mean_step_time() -> None:
    """A CPU island over 4 s whose step time, sampled each second, reads 0.1, 0.1, 0.4, 0.4,
    0.1 s (the load rising and falling), 25 steps' tokens (512 a step) consumed. Its speed is
    the time-mean of 1 / t: (10 + 10 + 2.5 + 2.5 + 10) / 5 = 7.0 steps/s, so 25 steps in 4 s
    are 25 / (4 x 7.0) = 0.893 of what it could take; by the time-mean step time, 0.22 s
    (4.5 steps/s), they would be 25 x 0.22 / 4 = 1.375, capped at 1.0 (hetero17's reading: the
    island looked slower than it ran, and its merged-token share above its compute share)."""

    def status(tokens: int, step_time: float) -> dict[str, object]:
        return {"islands": {"c": {"step": 0, "tokens": tokens, "stepTime": step_time}}}

    samples = [
        (0.0, status(0, 0.1)),
        (1.0, status(5_120, 0.1)),
        (2.0, status(6_400, 0.4)),
        (3.0, status(7_680, 0.4)),
        (4.0, status(12_800, 0.1)),
    ]
    w = islands_over(samples, 0.0, 4.0, tokens_per_step=512)["c"]
    assert w.speed == pytest.approx(7.0)
    assert w.busy == pytest.approx(0.892857, abs=1e-6)  # it waited a little
    assert w.step_time == pytest.approx(0.22)  # the time-mean step time
    assert w.utilisation == 1.0  # 25 x 0.22 / 4 = 1.375, capped
    assert rate_of([0.1, 0.1, 0.4, 0.4]) == pytest.approx(6.25)
    assert rate_of([0.0, 0.5]) == pytest.approx(2.0)  # a 0 s step time is no reading
    assert rate_of([]) == 0.0


def test_an_islands_round_path_is_read_from_the_syncers_log() -> None:
    """The syncer logs a round's change and every probe's reading; only changes make the path,
    whose first entry is the round before the first change."""
    log = "\n".join(
        [
            "2026 INFO island-1: rounds of 50 inner steps (was 50) at its step 3, step time",
            "2026 INFO island-1: rounds of 17 inner steps (was 50) at its step 14, step time",
            "2026 INFO island-0: rounds of 50 inner steps (was 50) at its step 3, step time",
            "2026 INFO island-1: rounds of 12 inner steps (was 17) at its step 40, step time",
            "2026 INFO island-1: rounds of 20 inner steps (was 12) at its step 90, step time",
        ]
    )
    assert round_paths(log, ["island-0", "island-1"]) == {
        "island-0": [],
        "island-1": [50, 17, 12, 20],
    }


def test_emulated_islands_step_their_speed_factor_times_t_and_skip_the_fast_alone() -> None:
    """--emulate-step-ms 50 on 1,1,2,4: 50 ms x the factor, in seconds, each island's own
    DILOCO_EMULATE_STEP_SECONDS (0.05, 0.05, 0.1, 0.2); 0 leaves every island real. The plan
    drops the fast islands alone (their one figure, time to target, needs training)."""
    assert emulated_env([1.0, 1.0, 2.0, 4.0], 50.0) == {
        0: {"DILOCO_EMULATE_STEP_SECONDS": "0.05"},
        1: {"DILOCO_EMULATE_STEP_SECONDS": "0.05"},
        2: {"DILOCO_EMULATE_STEP_SECONDS": "0.1"},
        3: {"DILOCO_EMULATE_STEP_SECONDS": "0.2"},
    }
    assert emulated_env([1.0, 3.0], 0.0) == {}
    args = hetero_args(repeats=1, quorums=[4], no_fixed=True, emulate_step_ms=50.0)
    keys = [key for _, key, _, _ in plan_runs(args, [[1.0, 1.0, 1.0, 3.0]], 1000, 1500)]
    assert keys == ["equal speeds, K=4", "1,1,1,3 auto, K=4"]


def test_emulated_smoke_run_gives_the_slow_island_its_step_time_and_a_short_round(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real job (syncer and 2 learners on loopback) with --emulate-step-ms 40 on speeds 1,3
    at K = 2: the 3x island's reported step time is 3x the fast one's (emulated steps are
    exact; real steps on shared cores read 3.4-5.2x), auto sizes its round below H = 10 (about
    10 / 3), and the report prints loss and time as n/a."""
    code = main(
        [
            *("--mixes", "1,3", "--quorums", "2", "--no-fixed", "--skip-torchft"),
            *("--rounds", "10", "--inner-steps", "10", "--emulate-step-ms", "40"),
            *("--no-record", "--workdir", str(tmp_path)),
        ]
    )
    assert code == 0
    ours = json.loads((tmp_path / "results.json").read_text())["ours"]
    assert list(ours) == ["equal speeds, K=2", "1,3 auto, K=2"]
    # its utilisation read from the tokens it consumed: nonzero, near 1 at equal speeds
    assert ours["equal speeds, K=2"]["utilisation"]["island-0"] > 0.5, ours
    mixed = ours["1,3 auto, K=2"]
    fast, slow = mixed["step_time"]["island-0"], mixed["step_time"]["island-1"]
    assert 0.04 <= fast < 0.05 and 2.7 <= slow / fast <= 3.3, (fast, slow)
    assert mixed["inner_steps"]["island-0"] == 10
    assert mixed["inner_steps"]["island-1"] <= 5, mixed["inner_steps"]
    out = capsys.readouterr().out
    assert "loss and time n/a" in out and "emulated steps do not train" in out


def test_no_later_than_the_fast_islands_alone_when_they_never_reached_it() -> None:
    """A mixed run that reached the target is no later than fast islands alone that never did
    (pace47 seed 2: the mix in 44.6 s, the alone run at 1.027x the target at its budget, never
    there); one that did not reach it is not; with no alone run at all (emulated) nothing is
    judged met. The doctests of no_later and no_later_figure pass too."""
    import doctest

    import bench.hetero
    from bench.hetero import no_later, no_later_figure

    assert no_later(44.6, None, alone_runs=1) is True
    assert no_later(None, None, alone_runs=1) is False
    assert no_later(61.0, 60.0, alone_runs=3) is False
    assert no_later_figure(44.6, None) == "44.6s (alone: not reached)"
    runner = doctest.DocTestRunner()
    for fn in (bench.hetero.no_later, bench.hetero.no_later_figure):
        for test in doctest.DocTestFinder().find(fn):
            runner.run(test)
    assert (runner.failures, runner.tries) == (0, 4)
