"""bench/learner_overlap reads the learner's own split of its wall time from the progress lines
the learner writes (learner/step_costs.WindowCosts.line) and its merge waits: the parser and the
writer must agree, or the benchmark silently reports nothing."""

from __future__ import annotations

import os

import pytest
from diloco_trainer.learner.step_costs import WindowCosts

from bench import learner_overlap


def progress_line(step: int, tokens_per_s: int, costs: WindowCosts) -> str:
    # The format of loop.Learner._train's progress line.
    return f"step {step} loss 2.0000 tokens 100 ({tokens_per_s} tokens/s); {costs.line()}"


def window(training: float, sync_path: float, waiting: float, cpu: float = 9.0) -> WindowCosts:
    costs = WindowCosts(cpu=cpu)
    for _ in range(20):
        costs.add_step(training / 20)
        costs.add_after(sync_path / 20 + waiting / 20, waiting / 20)
    return costs


def test_split_of_sums_the_steady_windows_and_lists_the_merge_waits() -> None:
    lines = [
        progress_line(20, 50, window(9.0, 9.0, 9.0)),  # start-up: left out
        progress_line(40, 60, window(9.0, 9.0, 9.0)),  # start-up: left out
        progress_line(60, 100, window(2.0, 0.5, 1.5, cpu=3.0)),
        "step 65: waited 1.50s for fragment 1 (the 5 overlapped steps since its push took 0.50s)",
        progress_line(80, 120, window(2.0, 0.0, 0.0, cpu=1.5)),
        progress_line(100, 10, window(9.0, 9.0, 9.0)),  # the last: may hold the job's end
    ]
    text = "\n".join(lines)
    split = learner_overlap.split_of(text, learner_overlap.parse_args([]))
    assert split["steps"] == 40
    assert split["training_s"] == pytest.approx(4.0)
    assert split["sync_path_s"] == pytest.approx(0.5)
    assert split["waiting_s"] == pytest.approx(1.5)
    assert split["cpu_s"] == pytest.approx(3.0 + 1.5)  # the CPU seconds the two windows logged
    assert split["training_share"] == pytest.approx(4.0 / 6.0)
    assert split["step_path_share"] == pytest.approx(4.0 / 4.5)
    assert split["merge_waits_s"] == [1.5] and split["overlap_s"] == [0.5]
    # The windows' tokens/s are what the headline ratio is made of, unchanged by the split.
    assert [float(m.group(1)) for m in learner_overlap.WINDOW.finditer(text)] == [
        50,
        60,
        100,
        120,
        10,
    ]


def test_the_steady_windows_follow_skip_and_drop() -> None:
    args = learner_overlap.parse_args(["--skip-windows", "1", "--drop-last", "0"])
    assert learner_overlap.steady([1, 2, 3], args) == [2, 3]
    args = learner_overlap.parse_args([])  # defaults: 2 start-up windows, the last one
    assert learner_overlap.steady([1, 2, 3, 4, 5], args) == [3, 4]


def test_a_log_from_before_the_cpu_column_still_parses() -> None:
    old = "step 60 loss 2.0 tokens 1 (100 tokens/s); 20 steps: 2.00s training, 0.50s sync path, "
    match = learner_overlap.COSTS.search(old + "0.00s waiting for the syncer")
    assert match is not None and match.group(6) is None


def test_summary_over_rounds_takes_medians_and_pools_the_plain_blocks() -> None:
    """Three rounds between four plain blocks (tokens/s 100, 120, 80, 100): the rounds' ratios
    1.0, 0.8 and 1.25 have median 1.0; their A/A controls 1.2, 2/3 and 1.25 median 1.2; the
    jobs' mean (100) over every plain block's mean (100) is 1.0."""
    plains = [{"tokens_per_s": t} for t in (100.0, 120.0, 80.0, 100.0)]
    jobs = [{"tokens_per_s": t} for t in (110.0, 80.0, 110.0)]
    rounds = [
        {"ratio_tokens_per_s": 1.0, "aa_tokens_per_s": 1.2},
        {"ratio_tokens_per_s": 0.8, "aa_tokens_per_s": 80 / 120},
        {"ratio_tokens_per_s": 1.25, "aa_tokens_per_s": 1.25},
    ]
    got = learner_overlap.summary(plains, jobs, rounds)
    assert got["median_ratio"] == 1.0 and (got["min_ratio"], got["max_ratio"]) == (0.8, 1.25)
    assert got["median_aa"] == 1.2 and got["min_aa"] == pytest.approx(2 / 3)
    assert got["pooled_ratio"] == pytest.approx(1.0)


def test_the_windows_baseline_runs_the_jobs_steps_on_the_learners_cpus() -> None:
    """--baseline windows: each plain block covers the job's inner x outer steps (3 windows of
    20) read in the same steady windows; after a run with --syncer-cpus (the plain loop kept
    off the syncer's CPU) the process has every CPU it had back."""
    mine = sorted(os.sched_getaffinity(0))
    argv = ["--batch-size", "2", "--seq-len", "16", "--inner-steps", "20", "--outer-steps", "3"]
    argv += ["--warmup", "1", "--control", "--baseline", "windows", "--skip-windows", "1"]
    if len(mine) > 1:
        argv += ["--syncer-cpus", str(mine[-1])]
    result = learner_overlap.run(learner_overlap.parse_args(argv))
    assert [len(p["windows_tokens_per_s"]) for p in result["plains"]] == [3, 3]
    assert sorted(os.sched_getaffinity(0)) == mine
    assert "the job's steps, read in its steady windows" in learner_overlap.report(result)


def test_plain_process_runs_each_plain_block_in_a_process_of_its_own() -> None:
    argv = ["--batch-size", "2", "--seq-len", "16", "--inner-steps", "20", "--outer-steps", "2"]
    argv += ["--warmup", "1", "--control", "--baseline", "windows", "--skip-windows", "1"]
    argv += ["--drop-last", "0", "--plain-process"]
    result = learner_overlap.run(learner_overlap.parse_args(argv))
    # Each block's JSON came back from its own process: two windows of the job's 40 steps.
    assert [len(p["windows_tokens_per_s"]) for p in result["plains"]] == [2, 2]
    assert all(p["tokens_per_s"] > 0 for p in result["plains"])
    pids = {p["pid"] for p in result["plains"]}
    assert len(pids) == 2 and os.getpid() not in pids
    assert "each plain block in a fresh process" in learner_overlap.report(result)
