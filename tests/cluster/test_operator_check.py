"""The operator's pre-flight check (issue 24), seen as a user with only kubectl sees it: a job
whose learners' memory limit cannot hold one step gets no children, stays Pending with the
reason as its message, a `Checked=False` condition and a `CheckFailed` Event; raising the
limit lets it start. A job with no stop condition starts, its warning on the condition and an
Event. The real operator process against a real API server (kwok nodes)."""

from __future__ import annotations

import pytest

from .operator_helpers import Cluster, OperatorProcess, job_manifest
from .waits import WAIT, holds_for, wait_until

pytestmark = pytest.mark.cluster

STOP = {"stopAfter": {"outerSteps": 5}}
# gpt-tiny's learner process alone is estimated at 400 MiB (interpreter, torch, corpus).
TOO_SMALL = {"islands": {"count": 2, "resources": {"limits": {"memory": "256Mi"}}}}
ENOUGH = {"islands": {"resources": {"limits": {"memory": "1Gi"}}}}


def checked(cluster: Cluster, name: str) -> dict[str, str] | None:
    """The job's Checked condition once the operator has written it."""
    conditions = cluster.status(name).get("conditions") or []
    return next((c for c in conditions if c["type"] == "Checked"), None)


def children(cluster: Cluster, name: str) -> set[str]:
    sel = f"diloco.dev/job={name}"
    kinds = ("statefulsets", "deployments", "configmaps", "services")
    return {f"{kind}/{n}" for kind in kinds for n in cluster.names(kind, sel)}


def test_failing_check_holds_the_job_until_the_spec_is_fixed(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("small", **STOP, **TOO_SMALL))
    condition = wait_until(lambda: checked(cluster, "small"), WAIT, message="Checked condition")
    assert condition["status"] == "False" and condition["reason"] == "CheckFailed", condition
    assert condition["message"].startswith(
        "islands.resources.limits.memory (0.25 GiB): a learner step needs about"
    ), condition
    status = cluster.status("small")
    assert status["phase"] == "Pending"
    assert status["message"].startswith("pre-flight check failed, no pods created"), status
    assert condition["message"] in status["message"]
    (event,) = wait_until(lambda: cluster.events("CheckFailed"), WAIT, message="CheckFailed event")
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "small"
    assert event["message"] == condition["message"]
    # Held: nothing is created while the check fails (the operator syncs it again meanwhile).
    holds_for(lambda: not children(cluster, "small"), duration=5.0, message="no children")
    assert cluster.items("pods", "diloco.dev/job=small") == []
    # `kubectl describe` shows both to a user.
    described = cluster.cp.kubectl("describe", "dj", "small", "-n", cluster.ns).stdout
    assert "CheckFailed" in described and "islands.resources.limits.memory" in described

    cluster.patch_spec("small", ENOUGH)
    passed = wait_until(
        lambda: (c := checked(cluster, "small")) is not None and c["status"] == "True" and c,
        WAIT,
        message="Checked=True after the fix",
    )
    assert passed["reason"] == "Passed" and passed["message"] == "", passed
    wait_until(
        lambda: (
            {"statefulsets/small-island-0", "deployments/small-syncer"}
            <= children(cluster, "small")
        ),
        WAIT,
        message="the fixed job's children",
    )
    (event,) = wait_until(lambda: cluster.events("CheckPassed"), WAIT, message="CheckPassed")
    assert event["type"] == "Normal"


def test_warnings_do_not_hold_the_job(cluster: Cluster, operator: OperatorProcess) -> None:
    cluster.apply(job_manifest("forever", **ENOUGH))  # no stopAfter: runs until stopped
    condition = wait_until(lambda: checked(cluster, "forever"), WAIT, message="Checked condition")
    assert condition["status"] == "True" and condition["reason"] == "PassedWithWarnings"
    assert condition["message"].startswith("stopAfter: neither outerSteps nor tokens is set")
    wait_until(
        lambda: "statefulsets/forever-island-0" in children(cluster, "forever"),
        WAIT,
        message="children of a job with warnings",
    )
    (event,) = wait_until(lambda: cluster.events("CheckWarnings"), WAIT, message="CheckWarnings")
    assert event["message"] == condition["message"]
