"""The chaos suite's measures (hack/localcluster/chaos_measure.py), on hand-made merge logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hack.localcluster.chaos_measure import (
    all_contribute_at,
    loss_at_tokens,
    losses_at_equal_tokens,
    lost_merges,
    read_merges,
    refusal_delta,
)


def rec(version: int, time: float, *islands: str, tokens: int = 100, fragment: int = 0) -> dict:
    return {
        "version": version,
        "fragment": fragment,
        "time": time,
        "tokens": tokens,
        "contributors": [{"island": i} for i in islands],
    }


def test_lost_merges_are_versions_merged_again_later() -> None:
    # Versions 1..3 merged; the syncer was killed after 3 and resumed from the checkpoint of 2,
    # so version 3 was merged again at t=40: the first 3 is lost. Fragment 1's version 3 is not.
    log = [
        rec(1, 10, "a", "b"),
        rec(2, 20, "a", "b"),
        rec(3, 30, "a", "b", tokens=70),
        rec(3, 30.5, "a", fragment=1),
        rec(3, 40, "a", "b"),
        rec(4, 50, "a", "b"),
    ]
    assert [(r["version"], r["time"]) for r in lost_merges(log, 0, 100)] == [(3, 30)]
    assert lost_merges(log, 31, 100) == []  # outside the window
    assert sum(r["tokens"] for r in lost_merges(log, 25, 35)) == 70


def test_all_contribute_at_is_the_first_merge_after_with_every_island() -> None:
    log = [rec(1, 10, "a", "b"), rec(2, 20, "a"), rec(3, 25, "b"), rec(4, 31, "a", "b")]
    assert all_contribute_at(log, 15, {"a", "b"}) == 31
    assert all_contribute_at(log, 5, {"a", "b"}) == 10
    assert all_contribute_at(log, 15, {"b"}) == 25
    assert all_contribute_at(log, 31, {"a", "b"}) is None


def test_loss_at_tokens_interpolates_and_refuses_to_extrapolate() -> None:
    history = [(0, 10.0), (100, 6.0), (300, 5.0)]
    assert loss_at_tokens(history, 50) == pytest.approx(8.0)  # halfway from 10 to 6
    assert loss_at_tokens(history, 200) == pytest.approx(5.5)
    assert loss_at_tokens(history, 300) == 5.0
    with pytest.raises(ValueError, match="outside"):
        loss_at_tokens(history, 301)


def test_losses_at_equal_tokens_every_step_and_at_the_chaos_runs_end() -> None:
    chaos = [(0, 10.0), (100, 8.0), (250, 6.0)]
    calm = [(0, 10.0), (200, 6.0), (300, 4.0)]
    # Marks at 100 and 200 (both reach 250; 300 is past the chaos run), then the chaos end 250.
    # chaos at 200: 8 + (6 - 8) * 100/150 = 6.666..; calm at 100: halfway 10 -> 6 = 8;
    # calm at 250: halfway 6 -> 4 = 5.
    got = losses_at_equal_tokens(chaos, calm, 100)
    assert [t for t, _, _ in got] == [100, 200, 250]
    assert got[0][1:] == pytest.approx((8.0, 8.0))
    assert got[1][1:] == pytest.approx((6.0 + 2.0 / 3.0, 6.0))
    assert got[2][1:] == pytest.approx((6.0, 5.0))
    # A chaos run past the calm one's tokens: no mark beyond the calm history.
    assert [t for t, _, _ in losses_at_equal_tokens(calm, chaos, 100)] == [100, 200]
    assert losses_at_equal_tokens([], calm, 100) == []
    with pytest.raises(ValueError, match="step"):
        losses_at_equal_tokens(chaos, calm, 0)


def test_refusal_delta_counts_new_refusals_and_all_after_a_restart() -> None:
    before = {"a": {"too_stale": 2}}
    after = {"a": {"too_stale": 3, "steps_out_of_range": 1}, "b": {"too_stale": 1}}
    new = {"too_stale": 2, "steps_out_of_range": 1}  # a: 3 - 2, b: 1; a's 1 is new
    assert refusal_delta(before, after, restarted=False) == new
    assert refusal_delta(before, {"a": {"too_stale": 1}}, restarted=True) == {"too_stale": 1}


def test_read_merges_skips_a_half_written_line(tmp_path: Path) -> None:
    path = tmp_path / "merges.jsonl"
    path.write_text(json.dumps(rec(1, 1.0, "a")) + "\n" + '{"version": 2, "fra')
    assert [r["version"] for r in read_merges(path)] == [1]
    assert read_merges(tmp_path / "missing.jsonl") == []
