"""A job whose syncer crash-loops fails: phase Failed, islands scaled to zero, an Event."""

from __future__ import annotations

import json

import pytest

from .operator_helpers import Cluster, OperatorProcess, job_manifest
from .waits import WAIT, holds_for, wait_until

pytestmark = pytest.mark.cluster


def test_operator_fails_job_when_syncer_crash_loops(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("crash", islands={"count": 2}))
    wait_until(
        lambda: cluster.pods_ready("diloco.dev/job=crash", 3), WAIT, message="learners and syncer"
    )
    (syncer_pod,) = cluster.names("pods", "app.kubernetes.io/component=syncer")
    crash = {
        "status": {
            "containerStatuses": [
                {
                    "name": "syncer",
                    "ready": False,
                    "restartCount": 6,
                    "state": {"running": None, "waiting": {"reason": "CrashLoopBackOff"}},
                }
            ]
        }
    }
    cluster.cp.kubectl(
        "patch", "pod", syncer_pod, "-n", cluster.ns, "--subresource=status", "-p",
        json.dumps(crash),
    )  # fmt: skip
    status = wait_until(
        lambda: (st := cluster.status("crash")).get("phase") == "Failed" and st,
        WAIT,
        message="Failed",
    )
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "SyncerCrashLoop"
    assert syncer_pod in failed["message"] and status.get("finishedTime")
    wait_until(
        lambda: not cluster.items("pods", "app.kubernetes.io/component=learner"),
        WAIT,
        message="islands scaled to zero",
    )
    assert all(s["spec"]["replicas"] == 0 for s in cluster.items("statefulsets"))
    (event,) = wait_until(lambda: cluster.events("Failed"), WAIT, message="Failed Event")
    assert event["type"] == "Warning" and "crash-looped" in event["message"]
    # Failed is final: even with the syncer healthy again it stays Failed (no flapping back).
    healed = {
        "status": {
            "containerStatuses": [
                {"name": "syncer", "ready": True, "state": {"waiting": None, "running": {}}}
            ]
        }
    }
    cluster.cp.kubectl(
        "patch", "pod", syncer_pod, "-n", cluster.ns, "--subresource=status", "-p",
        json.dumps(healed),
    )  # fmt: skip
    holds_for(
        lambda: cluster.status("crash")["phase"] == "Failed",
        duration=7,
        message="phase Failed",
    )
