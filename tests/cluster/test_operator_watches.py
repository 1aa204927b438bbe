"""The operator works from its watches: once a job runs, syncing it reads nothing per job.

Pod readiness flips (island dropped and re-added at a real loopback syncer) and several timer
passes go by while the operator's read counter stays where the job's first sync left it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from .operator_helpers import Cluster, OperatorProcess, job_manifest
from .waits import WAIT, holds_for, wait_until

pytestmark = pytest.mark.cluster

READ = re.compile(r'^diloco_operator_api_reads_total\{kind="([^"]+)",verb="([^"]+)"\} (\S+)$')


def _reads(operator: OperatorProcess) -> dict[tuple[str, str], float]:
    """{(verb, kind): count} of the operator's API reads so far."""
    out = {}
    for line in operator.metrics().splitlines():
        match = READ.match(line)
        if match:
            out[(match.group(2), match.group(1))] = float(match.group(3))
    return out


def _phase(cluster: Cluster, name: str) -> Any:
    return cluster.status(name).get("phase")


def test_operator_steady_state_reads_nothing_per_job(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest = job_manifest("watch", islands={"count": 2, "replicas": 1})
    syncer = make_local_syncer(manifest)
    manifest["spec"]["syncer"] = {"endpoint": syncer.url, "tokenSecretName": syncer.secret_name}
    cluster.apply(manifest)
    wait_until(lambda: _phase(cluster, "watch") == "Running", WAIT, message="Running")
    before = _reads(operator)
    # The first sync listed no children (a job never synced owns none yet) and read each child
    # it wants once before writing it (children.py). Its pods are listed once at most: only
    # while this operator has never read pods (sync.POD_READS: with pods unreadable it must not
    # write a status, test_rbac.py).
    lists = {kind: n for (verb, kind), n in before.items() if verb == "list" and n}
    assert set(lists) <= {"Pod"} and lists.get("Pod", 0) <= 1, before
    assert before[("get", "StatefulSet")] >= 2 and before[("get", "ConfigMap")] >= 1, before

    cluster.set_pod_ready("watch-island-1-0", False)
    wait_until(lambda: syncer.island_state("island-1") == "dropped", WAIT, message="dropped")
    wait_until(lambda: _phase(cluster, "watch") == "Degraded", WAIT, message="Degraded")
    cluster.set_pod_ready("watch-island-1-0", True)
    wait_until(lambda: syncer.island_state("island-1") == "active", WAIT, message="re-added")
    wait_until(lambda: _phase(cluster, "watch") == "Running", WAIT, message="Running again")
    # Two timer passes at least (STATUS_INTERVAL 5 s) on top of the event-driven syncs.
    holds_for(lambda: _reads(operator) == before, duration=12, message="no new API reads")
