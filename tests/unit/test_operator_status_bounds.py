"""A syncer's figures that Kubernetes cannot store (or a time past year 9999) are left out of the
job's status instead of making every status patch fail."""

from __future__ import annotations

from diloco_operator.status_progress import INT64_MAX, carried_progress, int_or_none
from diloco_operator.times import time_field

from .observations import syncer_status


def test_operator_status_bounds_times_out_of_range_are_dropped() -> None:
    assert time_field(1e20) is None and time_field(float("nan")) is None
    assert time_field(float("inf")) is None and time_field(-5) is None
    assert time_field(1_700_000_000) == "2023-11-14T22:13:20Z"


def test_operator_status_bounds_counts_beyond_int64_are_dropped() -> None:
    assert int_or_none(INT64_MAX) == INT64_MAX
    assert int_or_none(10**19) is None and int_or_none(float("inf")) is None
    progress = carried_progress(
        syncer_status({"outerStep": 3, "tokens": 10**19, "lastMergeTime": 1e20, "loss": 2.5}),
        None,
    )
    assert (progress.outer_step, progress.tokens, progress.last_sync_time) == (3, None, None)
    assert progress.loss == 2.5
