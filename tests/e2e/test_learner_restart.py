"""Failures while training: a learner killed with SIGKILL (rounds go on without it; restarted, it
rejoins at the current version and contributes again), and a syncer killed with SIGKILL (learners
ride it out, reconnect to the restarted syncer and the job finishes)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.run import LocalRun

from .conftest import restart_safe_port, wait_until
from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    local_run,
    run_to_finish,
    start_synchronised,
    status_of,
)

pytestmark = pytest.mark.e2e

VICTIM = "island-1"
JOINED = re.compile(r"fragment 0: took version (\d+) \(joined\)")


def merge_log(run: LocalRun) -> list[dict[str, Any]]:
    """Every merge so far, from the syncer's merges.jsonl."""
    path = run.workdir / "syncer" / "merges.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def contributors(merge: dict[str, Any]) -> set[str]:
    return {c["island"] for c in merge["contributors"]}


def merged_versions(run: LocalRun) -> dict[int, int]:
    """The newest merged version of each fragment so far (versions count merges, which run ahead
    of outer steps: those count rounds of work)."""
    newest: dict[int, int] = {}
    for m in merge_log(run):
        newest[m["fragment"]] = max(newest.get(m["fragment"], 0), m["version"])
    return newest


def merges_after(run: LocalRun, versions: dict[int, int], skip: int = 0) -> list[dict[str, Any]]:
    """Merges of each fragment past `versions` (its newest merged version at some moment) plus
    `skip` more."""
    return [m for m in merge_log(run) if m["version"] > versions.get(m["fragment"], 0) + skip]


RESUMED = re.compile(r"data: resuming at window (\d+) ")
# A learner's lines for a merge wait that its wait budget ended, a push it made again because
# that wait ran out, and a drain that waited a budget for a finish that could not come.
BUDGET_WAITS = re.compile(
    r"not merged within \d+s|overdue, pushing it again|drained, but the job did not finish"
)

# A learner's lines for a push the restarted syncer refused as ahead (the link's), for that push
# made again at once (FragmentSync.resend_lost's), and for such a refusal received instead.
AHEAD = r"push refused \(syncer answered 409: baseVersion \d+ is newer"
REFUSED = re.compile(rf"fragment (\d+): {AHEAD}.*taking the current global fragment")
AGAIN_AT_ONCE = re.compile(rf"fragment (\d+): {AHEAD}.*pushing it again now, on version")
RECEIVED_REFUSED = re.compile(rf"fragment (\d+) applied version \d+ \({AHEAD}")


def refusals(log_file: Path) -> dict[str, list[str]]:
    """A learner's pushes refused as ahead, those pushed again at once and those received, each
    as the fragments in order."""
    text = log_file.read_text()
    pattern = {"refused": REFUSED, "again": AGAIN_AT_ONCE, "received": RECEIVED_REFUSED}
    return {k: p.findall(text) for k, p in pattern.items()}


def joined_versions(log_file: Path) -> list[int]:
    """Versions of fragment 0 a learner took when it joined, one per (re)start, in order."""
    return [int(v) for v in JOINED.findall(log_file.read_text())]


def test_learner_restart_rounds_continue_and_it_rejoins_at_the_current_version(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = make_spec(
        islands={"count": 3},
        inner={"steps": 5, "batchSize": 4, "seqLen": 32, "lr": 3e-3},
        sync={"quorum": 2, "graceSeconds": "auto", "heartbeatTimeoutSeconds": 20},
        stopAfter={"outerSteps": 100000},
        syncer={"checkpoint": {"everyOuterSteps": 1000}, "evalEveryOuterSteps": 1000},
    )
    run = local_run(spec)
    run.start()
    # The victim must have been part of training before it dies: on a loaded machine its start-up
    # can take longer than the others' first two merges (CI once killed it before it joined).
    wait_until(
        lambda: (
            status_of(run)["outerStep"] >= 2
            and any(VICTIM in contributors(m) for m in merge_log(run))
        ),
        timeout=300,
        what="two outer steps and a merge with the victim",
    )

    (victim,) = [p for p in run.learners if p.name.startswith(VICTIM + "/")]
    victim.kill()
    victim.wait()
    killed_at = merged_versions(run)
    # Rounds go on without it (its last push may still land in the next merge of each fragment).
    down = wait_until(
        lambda: len(d := merges_after(run, killed_at, skip=1)) >= 3 and d,
        timeout=300,
        what="three more merges with the victim down",
    )
    assert all(VICTIM not in contributors(m) for m in down), [contributors(m) for m in down]

    before = status_of(run)
    restarted_at, merged_before = before["outerStep"], before["islands"][VICTIM]["mergedTokens"]
    (proc,) = run.start_island(1)
    status = wait_until(
        lambda: (s := status_of(run))["islands"][VICTIM]["joins"] == 2 and s,
        timeout=300,
        what="the victim to join again",
    )
    log_file = proc.log_file
    versions = wait_until(
        lambda: len(v := joined_versions(log_file)) == 2 and v, timeout=120, what="its first pull"
    )
    # Its first pull after the restart is the then-current global fragment, not version 0.
    current = status_of(run)["versions"][0]
    assert restarted_at <= versions[1] <= current, (restarted_at, versions, current)
    assert status["islands"][VICTIM]["state"] == "active"

    # ...and it contributes again: a later merge lists it.
    wait_until(
        lambda: any(
            VICTIM in contributors(m) for m in merge_log(run) if m["version"] > versions[1]
        ),
        timeout=300,
        what="a merge with the restarted island",
    )
    assert proc.alive
    # Its data goes on where its merged work ended (the syncer's record of it, seqLen 32 a
    # window, one rank), not from its first batch again.
    (resumed,) = RESUMED.findall(log_file.read_text())
    merged_after = status_of(run)["islands"][VICTIM]["mergedTokens"]
    assert merged_before // 32 <= int(resumed) <= merged_after // 32, (merged_before, resumed)
    assert int(resumed) > 0


def test_learner_rides_out_a_syncer_restart_and_the_job_finishes(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    # The wait budget (heartbeatTimeoutSeconds) is 60 s, not 20: under load the restarted syncer
    # answered 10-22 s after the kill (its start-up plus the client's backoff), and a budget
    # spent on that downtime alone is not the circular wait the last assertion looks for.
    spec = make_spec(
        islands={"count": 2},
        inner={"steps": 5, "batchSize": 4, "seqLen": 32, "lr": 3e-3},
        sync={"quorum": 2, "graceSeconds": "auto", "heartbeatTimeoutSeconds": 60},
        stopAfter={"outerSteps": 12},
        syncer={"checkpoint": {"everyOuterSteps": 2, "keep": 2}, "evalEveryOuterSteps": 1000},
    )
    run = local_run(spec)
    port = restart_safe_port()  # still free when the syncer comes back on it
    start_synchronised(run, port=port)
    wait_until(lambda: status_of(run)["outerStep"] >= 4, timeout=300, what="four outer steps")
    assert run.syncer is not None
    run.syncer.kill()
    run.syncer.wait()
    run.start_syncer(port=port)
    resumed = status_of(run)
    assert resumed["resumedFrom"] is not None
    assert resumed["outerStep"] >= 4 - 2  # from a checkpoint at most everyOuterSteps old

    status = run_to_finish(run, timeout=600)
    # Finished with every island's 12 x 5 steps merged: 12 x 2 x 5 x 128 tokens = 15,360 but a
    # step of each (the drain's rounding). The outer steps may stand at 11: the restart lost a
    # merged round, and the merge that made it up (1.6 rounds) folds once
    # (targets.drained_at_budget, shares kept).
    assert status.finished and status.outer_step in (11, 12)
    assert status.tokens >= 15_360 - 2 * 128, status
    # Both learners carried on with the restarted syncer: each appears in merges after it.
    resumed_versions = dict(enumerate(resumed["versions"]))
    late = merges_after(run, resumed_versions, skip=1)
    assert {"island-0", "island-1"} <= set().union(*(contributors(m) for m in late))
    # ...and leave on their own once it says finished.
    run.wait_learners(120)
    assert [p.returncode for p in run.learners] == [0, 0]
    # A push the restarted syncer refused as ahead is pushed again at once, like a lost one,
    # never received first (received, it was pushed again only at the fragment's next merge
    # wait or sync point: while its island waited for the other fragment's merge, whose
    # peer's push waited in turn for this one, both held until a wait budget ran out).
    for p in run.learners:
        seen = refusals(p.log_file)
        assert sorted(seen["again"]) == sorted(seen["refused"]), (p.name, seen)
        assert seen["received"] == [], (p.name, seen)
    # With no wait budget spent: at K = M a push the restarted syncer lost or refused is pushed
    # again at once and the merges it lost are made up, so each island's push of a sync point
    # meets the other's in one round (before, an island's pushes met its peer's pushes of the
    # sync point before for the rest of the job, every round freed by a budget: 20, 60, 181 s),
    # and each island trains the work the restart took back before it drains (before, both
    # waited a budget for a finish that could not come).
    waits = {p.name: BUDGET_WAITS.findall(p.log_file.read_text()) for p in run.learners}
    assert waits == {p.name: [] for p in run.learners}, waits
