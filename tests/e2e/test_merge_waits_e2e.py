"""Issue 45's user path with real processes: learners behind a slow link say in their heartbeats
how much of their wall time they waited for the syncer, and the syncer's status shows it per
island (IslandStatus.waiting, what the operator copies to status.islandStatuses and reads for
its WaitingForMerges condition: tests/unit/test_merge_waits.py).

A K = M job of two gpt-tiny islands (fp32 pushes of 135K parameters, 0.54 MB, and as much pulled
back per island and round) whose learners reach the syncer through one rate-limited relay
(bench/harness/relay.py, both directions in one 4 Mbit/s bucket): a round's ~2.2 MB take ~4 s on
the link against well under a second of compute, so each blocking learner waits for most of its
wall time. The status must show each island's share, a number in (0, 1], at 0.25 or more (the
operator's raise threshold), and each learner's own progress lines must agree that it waited
that much (the split of learner/step_costs.WindowCosts, measured apart from the heartbeats')."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import JobSpec

from bench.bandwidth import start_relay
from bench.harness.ours_harness import OursRun

from .conftest import wait_until

RATE_MBIT = 4.0
# A progress line's split (learner/step_costs.WindowCosts.line).
SPLIT = re.compile(
    r"(\d+) steps: ([\d.]+)s training, ([\d.]+)s sync path, ([\d.]+)s waiting for the syncer"
)


@pytest.fixture
def slow_link_run(
    make_spec: Callable[..., JobSpec], workdir: Path
) -> Iterator[tuple[OursRun, dict[str, Any]]]:
    spec = make_spec(
        islands={"count": 2},
        sync={"quorum": 2, "heartbeatTimeoutSeconds": 10},  # heartbeats every 2.5 s
        stopAfter={"outerSteps": 10_000},  # stopped by the test
        syncer={"checkpoint": {"everyOuterSteps": 1000}, "evalEveryOuterSteps": 1000},
    )
    relay: dict[str, Any] = {}

    def route(_i: int, url: str) -> str:
        if not relay:
            target = int(url.rsplit(":", 1)[1])
            relay["proc"], relay["port"] = start_relay(workdir, target, RATE_MBIT, 0.0)
        return f"http://127.0.0.1:{relay['port']}"

    run = OursRun(spec=spec, workdir=workdir / "run", route=route)
    try:
        yield run, relay
    finally:
        run.stop()
        if relay:
            relay["proc"].stop()


def last_waiting_share(log: Path) -> float | None:
    """The waiting share of the learner's latest progress line, None before its first."""
    splits = SPLIT.findall(log.read_text())
    if not splits:
        return None
    _, training, sync_path, waiting = (float(x) for x in splits[-1])
    return waiting / (training + sync_path + waiting)


def test_learners_behind_a_slow_link_report_their_waiting_share_in_the_status(
    slow_link_run: tuple[OursRun, dict[str, Any]],
) -> None:
    run, _ = slow_link_run
    run.start()
    names = ["island-0", "island-1"]

    def shares() -> dict[str, float | None] | None:
        status = SyncerStatus.from_json(run.status())
        got = {n: (i.waiting if (i := status.islands.get(n)) else None) for n in names}
        # Past the first merges, and every island waiting at the operator's raise threshold.
        if status.outer_step >= 2 and all(s is not None and s >= 0.25 for s in got.values()):
            return got
        return None

    try:
        seen = wait_until(shares, timeout=600, interval=0.5, what="both islands' waiting >= 0.25")
    except AssertionError as err:
        raise AssertionError(f"{err}; last status islands: {run.status().get('islands')}") from None
    assert all(0.25 <= share <= 1.0 for share in seen.values()), seen
    # The learners' own progress lines (20 steps each) say the same of their windows.
    logs = [proc.log_file for proc in run.learners.values()]
    wait_until(
        lambda: all(last_waiting_share(log) is not None for log in logs),
        timeout=600,
        interval=0.5,
        what="a progress line of each learner",
    )
    for log in logs:
        share = last_waiting_share(log)
        assert share is not None and share >= 0.25, (log.name, share)
