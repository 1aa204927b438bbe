"""Islands idle waiting for merges -> the job's WaitingForMerges condition, one Event per
episode, each island's share in status.islandStatuses and `kubectl get dj -o wide` (issue 45).

kwok pods have no containers: a real `diloco syncer` runs on loopback, the job points at it with
spec.syncer.endpoint, and the test speaks for island-0's learner with its own credential: its
heartbeats say what share of its wall time it waited for the syncer (the learner's `waiting`,
tests/e2e/test_merge_waits_e2e.py has real learners report it). The rule's numbers (3 status
reads in a row at 25% or more raise, 3 below 10% clear) are tests/unit/test_merge_waits.py's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from diloco_trainer.api import credentials
from diloco_trainer.learner.syncer_client import SyncerClient

from .operator_helpers import Cluster, LocalSyncer, OperatorProcess, job_manifest
from .waits import WAIT, holds_for, wait_until

pytestmark = pytest.mark.cluster

CONDITION, EVENT = "WaitingForMerges", "IslandsWaitForMerges"


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def _beat(syncer: LocalSyncer, island: str, waiting: float, *, join: bool = False) -> bool:
    """One heartbeat of `island` saying it waited `waiting` of its wall time (joins first when
    asked); True once sent, so a wait can send one at each poll."""

    async def send() -> None:
        token = credentials.island_token(syncer.token, island)
        async with SyncerClient(syncer.url, token, retry_deadline=5) as client:
            if join:
                await client.join(island, 1)
            await client.heartbeat(island, step=1, tokens=64, waiting=waiting)

    asyncio.run(send())
    return True


def _wide_waiting(cluster: Cluster, name: str) -> str:
    """`kubectl get dj NAME -o wide`'s WAITING column: its last (priority-1 columns follow
    AGE), one word for a job of one island."""
    out = cluster.cp.kubectl("get", "dj", name, "-n", cluster.ns, "-o", "wide").stdout
    header, row = out.strip().splitlines()
    assert header.split()[-1] == "WAITING", header
    return row.split()[-1]


def test_operator_raises_and_clears_waiting_for_merges_with_one_event(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest = job_manifest("waits", islands={"count": 1, "replicas": 1})
    syncer = make_local_syncer(manifest)
    manifest["spec"]["syncer"] = {"endpoint": syncer.url, "tokenSecretName": syncer.secret_name}
    cluster.apply(manifest)
    _beat(syncer, "island-0", 0.0, join=True)
    wait_until(
        lambda: _condition(cluster.status("waits"), "SyncerReachable").get("status") == "True",
        WAIT,
        message="the syncer reached",
    )
    assert _condition(cluster.status("waits"), CONDITION).get("status") == "False"

    # island-0 waits 60% of its time: raised after 3 status reads (STATUS_INTERVAL 5 s each).
    def raised() -> dict[str, Any] | None:
        _beat(syncer, "island-0", 0.6)
        status = cluster.status("waits")
        return status if _condition(status, CONDITION).get("status") == "True" else None

    status = wait_until(raised, WAIT, interval=1.0, message=f"{CONDITION} True")
    condition = _condition(status, CONDITION)
    assert condition["reason"] == EVENT
    assert "island-0 60%" in condition["message"] and "inner.steps" in condition["message"]
    (entry,) = status["islandStatuses"]
    assert entry["name"] == "island-0" and entry["waiting"] == 0.6
    assert status["waitingSummary"] == "60%" and _wide_waiting(cluster, "waits") == "60%"
    (event,) = wait_until(lambda: cluster.events(EVENT), WAIT, message=f"{EVENT} Event")
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "waits"
    # Still waiting over more reads: the same episode, no second Event.
    holds_for(lambda: _beat(syncer, "island-0", 0.6) and len(cluster.events(EVENT)) == 1, 12.0)

    # Down to 5%: cleared after 3 reads below 10%, and still only the one Event.
    def cleared() -> dict[str, Any] | None:
        _beat(syncer, "island-0", 0.05)
        status = cluster.status("waits")
        return status if _condition(status, CONDITION).get("status") == "False" else None

    status = wait_until(cleared, WAIT, interval=1.0, message=f"{CONDITION} False again")
    assert _condition(status, CONDITION)["reason"] == "NotWaiting"
    assert status["islandStatuses"][0]["waiting"] == 0.05
    assert len(cluster.events(EVENT)) == 1
