"""bench.harness.merge_stats reads a run's merge log and learners' logs: lags, merges of one
island, the least momentum share and the islands whose round was resized."""

from __future__ import annotations

import json
from pathlib import Path

from bench.harness.merge_stats import merge_staleness


def test_merge_staleness_from_a_merge_log(tmp_path: Path) -> None:
    lines = [
        {"version": 1, "contributors": [{"lag": 0}, {"lag": 0}], "momentum": 1.0},
        {"version": 2, "contributors": [{"lag": 3}], "momentum": 0.25},
        {"version": 3, "contributors": [{"lag": 1}]},  # a log from before the field: 1
    ]
    (tmp_path / "merges.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    resized, plain = tmp_path / "island-0.0.log", tmp_path / "island-1.0.log"
    resized.write_text("step 6: rounds of 13 inner steps from here (...; was 30)\n")
    plain.write_text("step 30: fragment 0 pushed\n")
    got = merge_staleness(tmp_path, [resized, plain])
    # lags 0, 0, 3, 1: mean 1.0, max 3; two merges of one island; least share 0.25
    assert (got.merges, got.single, got.lag_mean, got.lag_max) == (3, 2, 1.0, 3)
    assert got.momentum_min == 0.25 and got.resized == 1
    assert got.cell() == "lag 1.0/3, 2/3 alone, momentum >= 0.25, H_i resized: 1"


def test_merge_staleness_without_a_log(tmp_path: Path) -> None:
    assert merge_staleness(tmp_path).cell() == "n/a"
