"""bench/studies/kept_steps: the linear model's radius by hand, and a run folder read as the
learner and syncer write them (their log lines copied from a busy_link run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.studies.kept_steps import kept_radius, read_run


def test_without_momentum_a_round_shrinks_the_error_by_one_minus_lr_a() -> None:
    # β = 0, k = 0: e ← e − lr·a·e, so the radius is |1 − 0.7 x 1| = 0.3
    assert math.isclose(kept_radius(0.7, 0.0, 1.0, 0.0, 1.0), 0.3, abs_tol=1e-12)


def test_steps_from_the_previous_base_make_the_loop_second_order() -> None:
    # β = 0, k = 1: e_{t+1} = e_t − lr·a·e_{t−1}: λ² − λ + 0.7 = 0, complex, |λ| = sqrt(0.7)
    assert math.isclose(kept_radius(0.7, 0.0, 1.0, 1.0, 1.0), math.sqrt(0.7), rel_tol=1e-9)


def test_nesterov_with_a_fresh_round() -> None:
    # β = 0.9, k = 0, a = 1, s = 1: m' = 0.9·m + e, e' = e − 0.7·(e + 0.9·m') = −0.33·e − 0.567·m:
    # on (e, m) the map [[−0.33, −0.567], [1, 0.9]], trace 0.57, det −0.297 + 0.567 = 0.27,
    # λ² − 0.57·λ + 0.27 = 0 has complex roots (0.3249 < 1.08): |λ| = sqrt(0.27)
    assert math.isclose(kept_radius(0.7, 0.9, 1.0, 0.0, 1.0), math.sqrt(0.27), rel_tol=1e-9)


def test_the_share_damps_what_kept_steps_feed_the_momentum() -> None:
    fresh = kept_radius(0.7, 0.9, 1.0, 1.0, 1.0)
    shared = kept_radius(0.7, 0.9, 1.0, 1.0, 0.25)
    assert fresh > 1.0 > shared  # 1.285 and 0.964 in the study's table


def _merge(version: int, complete: bool, contributors: list[tuple[str, int, float]]) -> str:
    return json.dumps(
        {
            "complete": complete,
            "version": version,
            "momentum": 1.0 if complete else 0.25,
            "contributors": [
                {"island": i, "lag": lag, "discount": d} for i, lag, d in contributors
            ],
        }
    )


def test_a_run_folder_is_read(tmp_path: Path) -> None:
    run = tmp_path / "seed0-k1-L160"
    (run / "syncer").mkdir(parents=True)
    everyone = [(f"island-{i}", 0, 1.0) for i in range(4)]
    (run / "syncer" / "merges.jsonl").write_text(
        "\n".join(
            [
                _merge(1, True, everyone),
                _merge(1, True, everyone),
                _merge(2, True, everyone),
                _merge(3, False, [("island-0", 2, 0.9)]),
            ]
        )
        + "\n"
    )
    (run / "syncer.log").write_text(
        "2026-11-30 07:26:15,479 INFO diloco.syncer: eval at outer step 1 (76800 tokens): "
        "loss 2.9860\n"
    )
    lines = [
        "step 30: fragment 0 pushed (base version 0, 71808 bytes int8, 15360 tokens in 30 steps;"
        " 0.000s on the training thread)",
        "step 51: fragment 0 applied version 1 (merged, 1.41s after the push; 0.000s on the "
        "training thread; pull 0.466s (73048 bytes), rebuild 0.006s, receipt ready 0.000s)",
        "step 60: fragment 0 pushed (base version 1, 71808 bytes int8, 15360 tokens in 30 steps;"
        " 0.000s on the training thread)",
        "step 93: fragment 0 applied version 3 (merged, 2.29s after the push; 0.000s on the "
        "training thread; pull 0.966s (146096 bytes), rebuild 0.006s, receipt ready 0.000s)",
        "step 200: held 1.0s for the syncer; stepping on",
        "step 105: fragment 0's merge not back 15 steps after its push (the bound, ceil(H/2) = "
        "15 of 30); held 2.50s for its merge",
        "step 135: fragment 0 not merged within 30s of a hold 15 steps after its push; training "
        "on without it",
    ]
    prefix = "2026-11-30 07:26:14,329 INFO island-0/0 diloco.learner: "
    (run / "island-0.0.log").write_text("".join(prefix + line + "\n" for line in lines))
    got = read_run(run)
    assert got.merges == 4 and got.later == 2 and got.complete == 1 and got.alone == 1
    assert got.first_partial == 3
    assert got.lags == [0, 0, 0, 0, 2] and got.discounts == [1.0] * 4 + [0.9]
    assert got.momentum == [1.0, 0.25]
    assert got.push_steps == [30, 30]
    assert got.kept == [21, 33]  # 51 − 30, 93 − 60
    assert got.chains == [1.0, 2.0]  # 146096 / 73048: a chain of two versions
    assert got.holds == 1 and got.held_s == 1.0
    # A late-merge hold (sync.lateMergeHold) apart from the step cap's; one ended by the budget.
    assert got.late_holds == 2 and got.late_held_s == 2.5
    assert got.evals == [(1, 76800, 2.986)]
    assert got.row()[7] == "27.0/33 (0.90)"  # mean kept 27 of H = 30
