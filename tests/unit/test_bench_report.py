"""The decoupled-quality report's arithmetic (time to a loss, how far a run went): its
hand-worked doctests run with the unit tier, so a change of rule fails here."""

from __future__ import annotations

import doctest
from types import SimpleNamespace
from typing import Any

from bench.harness import decoupled_quality_report


def test_bench_report_doctests_pass() -> None:
    result = doctest.testmod(decoupled_quality_report)
    assert result.attempted >= 5 and result.failed == 0, result


def _run(seed: int, loss: float, push: float = 0.0, pull: float = 0.0) -> dict[str, Any]:
    # One evaluation at the budget (100 tokens): the loss at the budget is `loss` exactly.
    return {
        "seed": seed,
        "history": [(0.0, 0.0, 5.0), (9.0, 100.0, loss)],
        "push": push,
        "pull": pull,
    }


def test_parity_targets_judge_each_seed_and_bytes_each_way() -> None:
    results = {
        "sync DP (baseline)": [_run(0, 1.9, 1000.0, 1000.0), _run(1, 1.9, 1000.0, 1000.0)],
        # 1000 / 9 = 111x pushed, 1000 / 11 = 91x pulled: pulled misses.
        "ours K=4": [_run(0, 2.0, 9.0, 11.0), _run(1, 2.0, 9.0, 11.0)],
        # K=4 / torchft: 2.0 / 2.0 = 1.0000 (met), 2.0 / 1.99 = 1.0050 (above): missed.
        "torchft K=4": [_run(0, 2.0), _run(1, 1.99)],
        # 2.02 / 2 = 1.0100, 1.98 / 2 = 0.9900: both at most 1% above; mean 1.0000.
        "ours K=2": [_run(0, 2.02), _run(1, 1.98)],
        # 2.04 / 2 = 1.0200 misses on seed 0 although the mean of the ratios is 1.0000.
        "ours K=1": [_run(0, 2.04), _run(1, 1.96)],
    }
    table = decoupled_quality_report.parity_targets(SimpleNamespace(islands=4), results, 100)
    rows = {row[0]: (row[1], row[2]) for row in table.rows}
    assert rows == {
        "ours K=4 at or below torchft K=4 on each seed": (
            "1.0000 (seed 0); 1.0050 (seed 1)",
            "MISSED",
        ),
        "K=2 at most 1% above K=4 on each seed": ("1.0100 (seed 0); 0.9900 (seed 1)", "met"),
        "K=2 at most 1% above K=4, mean of the seeds' ratios": ("1.0000x", "met"),
        "K=1 at most 1% above K=4 on each seed": ("1.0200 (seed 0); 0.9800 (seed 1)", "MISSED"),
        "K=1 at most 1% above K=4, mean of the seeds' ratios": ("1.0000x", "met"),
        "K=4: >= 100x fewer bytes per worker than DDP, pushed and pulled apart": (
            "111x pushed, 91x pulled",
            "MISSED",
        ),
    }


def test_parity_targets_leave_out_variants_that_did_not_run() -> None:
    results = {
        "sync DP (baseline)": [_run(0, 1.9, 10.0, 10.0)],
        "ours K=4": [_run(0, 2.0, 0.1, 0.1)],
    }
    table = decoupled_quality_report.parity_targets(SimpleNamespace(islands=4), results, 100)
    assert [row[0] for row in table.rows] == [
        "K=4: >= 100x fewer bytes per worker than DDP, pushed and pulled apart"
    ]


def test_skip_baseline_runs_ours_alone_and_the_tables_read_without_it() -> None:
    from bench import decoupled_quality

    args = decoupled_quality.parse_args(
        ["--no-straggler", "--skip-torchft", "--only", "ours K=", "--skip-baseline"]
    )
    assert decoupled_quality.variants(args) == [
        ("ours K=4", "ours", 4, False),
        ("ours K=2", "ours", 2, False),
        ("ours K=1", "ours", 1, False),
    ]
    run = {"wall": 1.0, "merges": 2}
    results = {
        "ours K=4": [{**_run(0, 2.0, 9.0, 11.0), **run}],
        "ours K=2": [{**_run(0, 2.02), **run}],
        "ours K=1": [{**_run(0, 2.04), **run}],
    }
    args.seeds = [0]
    tables, _ = decoupled_quality_report.tables(args, results, 100, 3.0)
    main = {row[0]: row for row in tables[0].rows}
    # No sync DP: its ratio and the bytes against DDP read "—"; K=1 / K=4 = 2.04 / 2.0.
    assert (main["ours K=1"][2], main["ours K=1"][3], main["ours K=1"][8]) == ("—", "1.0200x", "—")
    assert [row[0] for row in tables[3].rows] == [
        "K=2 at most 1% above K=4 on each seed",
        "K=2 at most 1% above K=4, mean of the seeds' ratios",
        "K=1 at most 1% above K=4 on each seed",
        "K=1 at most 1% above K=4, mean of the seeds' ratios",
    ]


def test_without_ours_at_k_m_the_ratio_to_it_reads_dash() -> None:
    # --only 'ours K=2': no K=4 in the run, so no ratio to it (it read 0.0000x before).
    args = SimpleNamespace(islands=4, preset="gpt-tiny", inner_steps=30, steps=600, seeds=[0])
    results = {"ours K=2": [{**_run(0, 2.02), "wall": 1.0, "merges": 2}]}
    row = decoupled_quality_report.main_table(args, results, 100).rows[0]
    assert (row[1], row[2], row[3]) == ("2.0200 ± 0.0000", "—", "—")
