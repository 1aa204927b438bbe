"""bench/studies/late_holds: a run folder read as the learners write it (their log lines copied
from a busy_link run), with the figures worked out by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.studies.late_holds import read_run

_PREFIX = "2026-11-30 20:07:30,205 INFO island-0/0 diloco.learner: "

ISLAND_0 = [
    "step 30: fragment 0 pushed (base version 0, 70000 bytes int8, 15360 tokens in 30 steps; "
    "0.000s on the training thread)",
    "step 19 loss 4.1 tokens 10240 (5000 tokens/s); 20 steps: 9.000s training, 0.500s sync path, "
    "0.500s waiting for the syncer; 0.26s cpu",
    "step 59: 1 sync(s) of 0.600s x 2 fragment(s) outlast a round of 30 steps of 0.016s: a merge "
    "late by ceil(H/2) steps, the link slower than its traffic is held for (sync.lateMergeHold "
    "auto)",
    "step 59: fragment 0's merge not back 29 steps after its push (the bound, H - 1 = 29 of 30); "
    "held 0.63s for its merge",
    "step 60: fragment 0 applied version 1 (merged, 1.27s after the push; 0.001s on the training "
    "thread; pull 0.713s (30000 bytes), rebuild 0.005s, receipt ready 0.000s)",
    "step 75: fragment 1's merge not back 15 steps after its push (the bound, ceil(H/2) = 15 of "
    "30, the link slower than its traffic); held 1.20s for its merge",
    "step 79 loss 3.9 tokens 40960 (5000 tokens/s); 20 steps: 1.000s training, 0.100s sync path, "
    "0.900s waiting for the syncer; 0.26s cpu",
    "step 99 loss 3.8 tokens 51200 (5000 tokens/s); 20 steps: 3.000s training, 0.000s sync path, "
    "0.000s waiting for the syncer; 0.26s cpu",
]


def test_a_run_folder_is_read(tmp_path: Path) -> None:
    run = tmp_path / "seed0-k1-L100"
    run.mkdir()
    (run / "island-0.0.log").write_text("".join(_PREFIX + line + "\n" for line in ISLAND_0))
    (run / "relay-stats.json").write_text(json.dumps({"up": 1_000_000, "down": 2_500_000}))
    holds = read_run(run)
    # the first progress window (the join's) left out: 40 steps, 4 s training, 0.1 s sync path,
    # 0.9 s waiting: utilisation 4 / 5 = 0.8
    assert holds.split.steps == 40
    assert math.isclose(holds.split.utilisation, 0.8)
    assert (holds.holds_half, holds.holds_last) == (1, 1)
    assert math.isclose(holds.held_seconds, 0.63 + 1.20)
    assert (holds.judged_slow, holds.judged_fits) == (1, 0)
    # F x mean latency / round = 2 x 0.6 / (30 x 0.016) = 1.2 / 0.48 = 2.5
    assert len(holds.ratios) == 1 and math.isclose(holds.ratios[0], 2.5)
    assert holds.relay_bytes == 3_500_000
    # a push of 70,000 bytes and a pulled merge of 30,000; the last of them at step 60
    assert (holds.sync_bytes, holds.steps) == (100_000, 60)
    # 100,000 / 60 bytes a step x 40 steps = 66,666.7 bytes at 1 Mbit/s (125,000 bytes/s) =
    # 0.5333 s of link over 4 s of compute on one island: 0.1333
    assert math.isclose(holds.offered(holds.bytes_a_step, 1.0), (100_000 / 60 * 40) / 125_000 / 4)
    assert "offered L 13%" in holds.row(holds.bytes_a_step, 1.0)
