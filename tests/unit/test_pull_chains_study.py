"""bench/studies/pull_chains: a run folder read as the learner, syncer and relay write it (their
log lines copied from a busy_link run), every figure counted by hand."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies.pull_chains import read_run, run_folders

LINE = (
    "2026-11-30 16:56:35,026 INFO island-0/0 diloco.learner: step {step}: fragment {f} applied "
    "version {v} (merged, 0.39s after the push; 0.000s on the training thread; pull 0.008s "
    "({n} bytes), rebuild 0.009s, receipt ready 0.000s, ready at 1796057795.021)"
)


def test_a_run_folder_is_read(tmp_path: Path) -> None:
    run = tmp_path / "seed0-k1-L100"
    (run / "syncer").mkdir(parents=True)
    merges = [["island-0", "island-1"], ["island-2"], ["island-3"], ["island-0"]]
    (run / "syncer" / "merges.jsonl").write_text(
        "\n".join(json.dumps({"contributors": [{"island": i} for i in m]}) for m in merges)
    )
    (run / "island-0.0.log").write_text(
        "\n".join(
            [
                LINE.format(step=31, f=0, v=1, n=100),
                "an unrelated line",
                LINE.format(step=47, f=1, v=1, n=100),
                LINE.format(step=61, f=0, v=4, n=300),  # a chain of versions 2, 3, 4
                LINE.format(step=77, f=1, v=2, n=100),  # one version
            ]
        )
    )
    (run / "relay-stats.json").write_text(json.dumps({"up": 1000, "down": 2500}))
    got = read_run(run)
    assert (got.merges, got.alone) == (4, 3)  # three of one island
    assert got.contributors == [2, 1, 1, 1]
    assert got.chains == [3, 1]  # each fragment's first pull is the base, not counted
    assert got.pulled == 600  # 100 + 100 + 300 + 100
    assert (got.up, got.down) == (1000, 2500)
    assert run_folders([str(tmp_path)]) == [run]
    assert "versions a pull 2.00 (1 of 2 >= 2)" in got.row()
