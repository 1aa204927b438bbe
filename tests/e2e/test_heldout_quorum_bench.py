"""bench/heldout_quorum's path end to end, small: a user's model that is no preset of ours
(bench/user_models/ngram_mlp.py, batches of (N, 8) contexts through model.entrypoint) trained
by real syncer and learner processes at K = M and K = 1, read back at the token budget."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from bench import heldout_quorum

pytestmark = pytest.mark.e2e


def test_the_quick_run_trains_a_users_model_at_both_quorums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # run_all points the learners' PYTHONPATH at the model's package: restored afterwards.
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    args = heldout_quorum.parse_args(
        ["--quick", "--no-record", "--models", "ngram-mlp", "--workdir", str(tmp_path)]
    )
    runs = heldout_quorum.run_all(args, tmp_path)

    assert [(r["model"], r["quorum"]) for r in runs] == [("ngram-mlp", 2), ("ngram-mlp", 1)]
    for r in runs:
        # Trained: the held-out loss at the budget well under the untrained one (ln 256 = 5.55
        # for uniform bytes), and the rounds merged (32 steps of H = 8 on 2 fragments: 8).
        assert math.isfinite(r["loss"]) and r["loss"] < 0.7 * r["initial"], r
        assert r["merges"] >= 4, r
    per_seed, pooled = heldout_quorum.tables(args, runs)[0]
    assert len(per_seed.rows) == 1 and len(pooled.rows) == 1
    ratio = runs[1]["loss"] / runs[0]["loss"]
    assert per_seed.rows[0][4] == f"{ratio:.4f}"
    early = runs[1]["early"] / runs[0]["early"]  # at --early 0.25 of the budget
    assert per_seed.rows[0][6] == f"{early:.4f}"
    assert all(r["early"] > r["loss"] for r in runs)  # still falling a quarter in
    assert pooled.rows[0][2] == f"{ratio:.4f}"  # one run a side: no interval
    assert pooled.rows[0][3] == "not resolved"
