"""An operator restarted mid-job picks up where it was: no duplicated, deleted or new children."""

from __future__ import annotations

import signal

import pytest

from .operator_helpers import Cluster, OperatorProcess, job_manifest
from .waits import WAIT, holds_for, wait_until

pytestmark = pytest.mark.cluster


KINDS = ("statefulsets", "services", "deployments", "configmaps", "secrets", "pods")


def _snapshot(cluster: Cluster) -> dict[str, dict[str, str]]:
    """{kind: {name: uid}} of everything the job owns, pods included."""
    return {
        kind: {
            o["metadata"]["name"]: o["metadata"]["uid"]
            for o in cluster.items(kind, "diloco.dev/job=rs")
        }
        for kind in KINDS
    }


def _versions(cluster: Cluster) -> dict[str, str]:
    """resourceVersions of the controllers the operator writes (a write changes them)."""
    return {
        f"{kind}/{o['metadata']['name']}": o["metadata"]["resourceVersion"]
        for kind in ("configmaps", "secrets")
        for o in cluster.items(kind, "diloco.dev/job=rs")
    }


def _reconciles(operator: OperatorProcess) -> float:
    for line in operator.metrics().splitlines():
        if line.startswith('diloco_operator_reconciles_total{result="ok"}'):
            return float(line.split()[-1])
    return 0.0


def test_operator_restart_keeps_children(cluster: Cluster, operator: OperatorProcess) -> None:
    cluster.apply(job_manifest("rs", islands={"count": 3, "replicas": 2}))
    wait_until(
        lambda: cluster.pods_ready("diloco.dev/job=rs", 7),
        WAIT,
        message="6 learners + syncer Ready",
    )
    wait_until(lambda: cluster.status("rs").get("islandsSummary") == "3/3", WAIT, message="3/3")
    before = _snapshot(cluster)
    versions = _versions(cluster)
    token = cluster.get("secret", "rs-token")["data"]  # type: ignore[index]

    operator.stop(signal.SIGKILL)  # a crash: no clean shutdown
    operator.start()
    generation_seen = cluster.status("rs").get("observedGeneration")
    # The new process has reconciled the job (its resume pass) once this counter moves.
    wait_until(
        lambda: (
            'diloco_operator_reconciles_total{result="ok"} ' in operator.metrics()
            and _reconciles(operator) >= 1
        ),
        WAIT,
        message="a reconcile by the restarted operator",
    )
    holds_for(lambda: _snapshot(cluster) == before, duration=8, message="children unchanged")
    assert _versions(cluster) == versions, "ConfigMap or token Secret rewritten"
    assert cluster.get("secret", "rs-token")["data"] == token  # type: ignore[index]
    assert cluster.status("rs").get("observedGeneration") == generation_seen

    # And it still works: a scale-up after the restart is carried out.
    cluster.patch_spec("rs", {"islands": {"count": 4}})
    wait_until(
        lambda: len(cluster.items("statefulsets", "diloco.dev/job=rs")) == 4, WAIT, message="4th"
    )
    after = _snapshot(cluster)
    for kind in KINDS:
        for name, uid in before[kind].items():
            assert after[kind].get(name) == uid, f"{kind}/{name} replaced"
