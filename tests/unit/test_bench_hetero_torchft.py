"""bench/hetero's torchft side: the runs it plans, the utilisation window read from a replica's
progress records, its eval history in ours' form and one row's figures against its own
equal-speed run and ours' (hand-derived values)."""

from __future__ import annotations

import argparse

from bench.hetero import (
    near_end_commits,
    parse_mix,
    plan_torchft,
    torchft_cells,
    torchft_history,
    torchft_unavailable,
    torchft_window,
)


def args(**kw: object) -> argparse.Namespace:
    base = {
        "repeats": 1,
        "preset": "gpt-tiny",
        "seed": 0,
        "eval_tokens": 4096,
        "inner_steps": 20,
        "batch_size": 4,
        "seq_len": 64,
        "skip_torchft": False,
    }
    return argparse.Namespace(**{**base, **kw})


def test_plan_runs_equal_speeds_then_each_mix_at_k_equal_m() -> None:
    runs = plan_torchft(args(), [parse_mix("1,1,1,3"), parse_mix("1,1,2,4")], budget=1000)
    assert [(name, speeds) for name, _, speeds, _ in runs] == [
        ("torchft equal speeds, K=4", [1.0, 1.0, 1.0, 1.0]),
        ("torchft 1,1,1,3, K=4", [1.0, 1.0, 1.0, 3.0]),
        ("torchft 1,1,2,4, K=4", [1.0, 1.0, 2.0, 4.0]),
    ]
    spec = runs[1][3]
    assert spec.islands.count == 4 and spec.inner.steps == 20 and spec.model.seed == 0
    two = plan_torchft(args(repeats=2), [parse_mix("1,1,1,3")], budget=1000)
    assert [name for name, *_ in two] == [
        "torchft equal speeds, K=4 #1",
        "torchft 1,1,1,3, K=4 #1",
        "torchft equal speeds, K=4 #2",
        "torchft 1,1,1,3, K=4 #2",
    ]
    assert two[0][1] == two[2][1]  # repeats share a key


def test_skip_flag_is_the_reason_given() -> None:
    assert torchft_unavailable(args(skip_torchft=True)) == "skipped (--skip-torchft)"


def test_near_end_commit() -> None:
    # budget 10 rounds of 1000 tokens: 80% is committed at commit 8
    assert near_end_commits(10_000, 1000) == 8
    # 2.5 rounds: 80% = 2000 tokens = 2 commits
    assert near_end_commits(2500, 1000) == 2
    # a 1-round budget still reads from commit 1 to commit 2
    assert near_end_commits(1000, 1000) == 2


RECORDS = [
    {"time": 10.0, "commits": 0},
    {"time": 12.0, "commits": 0},
    {"time": 15.0, "commits": 1},
    {"time": 18.0, "commits": 2},
    {"time": 21.0, "commits": 3},
]


def test_window_from_the_first_commit_to_the_near_end_commit() -> None:
    assert torchft_window(RECORDS, 2) == (15.0, 18.0)
    assert torchft_window(RECORDS, 3) == (15.0, 21.0)
    # never got to commit 9: up to its last record
    assert torchft_window(RECORDS, 9) == (15.0, 21.0)
    assert torchft_window(RECORDS[:2], 2) is None  # no commit
    assert torchft_window(RECORDS[:3], 2) is None  # one record past the first commit: empty


def test_history_in_ours_form() -> None:
    saved = [
        ({"outer_step": 1, "time": 105.0, "file": "outer-1"}, 3.5),
        ({"outer_step": 2, "time": 111.0, "file": "outer-2"}, 3.1),
    ]
    # 4 replicas x 20 steps x 256 tokens = 20480 tokens a commit
    assert torchft_history(100.0, 4.6, saved, 20480) == [
        {"time": 100.0, "tokens": 0, "evalLoss": 4.6},
        {"time": 105.0, "tokens": 20480, "evalLoss": 3.5},
        {"time": 111.0, "tokens": 40960, "evalLoss": 3.1},
    ]


def test_cells_against_its_equal_speed_run_and_ours() -> None:
    """Target 3.0 lies halfway from 3.2 (t = 120) to 2.8 (t = 140): 30 s after the start at
    100. Loss at 1500 tokens: halfway from 3.2 (1000) to 2.8 (2000) = 3.0. Fast replicas
    (factor 1): (0.6 + 0.8 + 0.7) / 3 = 0.7; the 3x replica's 0.95 left out."""
    r = {
        "started": 100.0,
        "evals": [
            {"time": 100.0, "tokens": 0, "evalLoss": 4.0},
            {"time": 120.0, "tokens": 1000, "evalLoss": 3.2},
            {"time": 140.0, "tokens": 2000, "evalLoss": 2.8},
        ],
        "utilisation": {"replica0": 0.6, "replica1": 0.8, "replica2": 0.7, "replica3": 0.95},
    }
    ref = {"t": 20.0, "loss": 2.5, "util": 0.875}
    cells = torchft_cells(r, [1, 1, 1, 3], 3.0, 1500, ref, ours_time=15.0)
    assert cells == [
        "30.0s",
        "1.500x",  # 30 / 20
        "2.000x",  # 30 / 15
        "3.0000",
        "1.2000x",  # 3.0 / 2.5
        "1.0000x",  # 3.0 / the target 3.0
        "70.0%",
        "0.800x",  # 0.7 / 0.875
        "60.0% 80.0% 70.0% 95.0%",
    ]
    never = torchft_cells(r, [1, 1, 1, 3], 2.0, 1500, None, ours_time=None)
    assert never[:3] == ["not reached", "n/a", "n/a"]
    assert never[4] == "n/a" and never[5] == "1.5000x"  # 3.0 / 2.0
    assert never[6:8] == ["70.0%", "n/a"]


def test_loss_without_an_evaluation_past_the_budget_reads_nan() -> None:
    r = {
        "started": 0.0,
        "evals": [{"time": 0.0, "tokens": 0, "evalLoss": 4.0}],
        "utilisation": {"replica0": 0.5},
    }
    cells = torchft_cells(r, [1], 3.0, 1500, None, ours_time=None)
    assert cells[3] == "nan" and cells[5] == "n/a"
    assert cells[6] == "50.0%"
