"""syncer.shards in a cluster: the operator creates a Deployment and Service per shard, points the
learners at every shard, replaces a shard's pod that dies without touching the others, and reads
the shards' statuses as one (outer step = the least-merged fragment) while a shard is killed and
restored from its checkpoint.

kwok pods have no containers, so the status test runs two real `diloco syncer` shards on
loopback (with a real learner) and the job points at them with spec.syncer.shardEndpoints.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from diloco_trainer.api import contract
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.local import (
    SyncerShards,
    free_port,
    start_learner,
    start_syncer_shards,
    write_job_files,
)

from .operator_helpers import Cluster, OperatorProcess, create_token_secret, job_manifest
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster

SHARD_LABEL = "diloco.dev/syncer-shard"


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def test_operator_creates_shards_routes_learners_and_replaces_a_dead_shard_pod(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("shd", islands={"count": 2}, syncer={"shards": 2}))
    shards = {"shd-syncer-0", "shd-syncer-1"}
    wait_until(
        lambda: cluster.names("deployments", "diloco.dev/job=shd") == shards,
        WAIT,
        message="a syncer Deployment per shard",
    )
    services = cluster.names("services", "diloco.dev/job=shd")
    assert shards <= services and "shd-syncer" not in services
    for shard in (0, 1):
        name = f"shd-syncer-{shard}"
        deployment = cluster.get("deployment", name)
        service = cluster.get("service", name)
        assert deployment is not None and service is not None
        assert service["spec"]["selector"][SHARD_LABEL] == str(shard)
        assert deployment["spec"]["selector"]["matchLabels"][SHARD_LABEL] == str(shard)
        assert _env(_container(deployment))[contract.SYNCER_SHARD] == str(shard)
    # Every learner routes by both shards' Services, in shard order.
    urls = ",".join(f"http://shd-syncer-{i}.{cluster.ns}.svc:8470" for i in (0, 1))
    for island in (0, 1):
        statefulset = cluster.get("statefulset", f"shd-island-{island}")
        assert statefulset is not None
        assert _env(_container(statefulset))[contract.SYNCER_URL] == urls

    def shard_pods() -> dict[str, str] | None:
        pods = {
            p["metadata"]["labels"][SHARD_LABEL]: p["metadata"]["uid"]
            for p in cluster.items("pods", f"diloco.dev/job=shd,{SHARD_LABEL}")
        }
        return pods if set(pods) == {"0", "1"} else None

    before = wait_until(shard_pods, WAIT, message="a pod per shard")
    (victim,) = [
        p["metadata"]["name"] for p in cluster.items("pods", f"diloco.dev/job=shd,{SHARD_LABEL}=1")
    ]
    cluster.cp.kubectl("delete", "pod", victim, "-n", cluster.ns, "--wait=true", timeout=WAIT)
    after = wait_until(
        lambda: (pods := shard_pods()) is not None and pods["1"] != before["1"] and pods,
        WAIT,
        message="shard 1's pod replaced",
    )
    assert after["0"] == before["0"]  # shard 0 untouched


def _start_shards(manifest: dict[str, Any], workdir: Path) -> SyncerShards:
    """Two real shards of the job's spec on loopback (the caller stops them)."""
    spec = parse_spec(manifest["spec"])
    files = write_job_files(spec, workdir)
    return start_syncer_shards(
        files,
        shards=2,
        state_dir=workdir / "state",
        job_name=manifest["metadata"]["name"],
        log_dir=workdir,
        extra_env={"OMP_NUM_THREADS": "1"},
        ready_timeout=120,
    )


def test_operator_status_is_the_least_merged_shard_through_a_shard_restart(
    cluster: Cluster, operator: OperatorProcess, tmp_path: Path
) -> None:
    manifest = job_manifest(
        "shr",
        islands={"count": 1},
        sync={"fragments": 2, "compression": "none", "heartbeatTimeoutSeconds": 10},
        stopAfter={"outerSteps": 1000},
        syncer={"shards": 2, "checkpoint": {"everyOuterSteps": 1, "keep": 2}},
    )
    group = _start_shards(manifest, tmp_path)
    learner = None
    try:
        create_token_secret(cluster.cp, cluster.ns, "shr-token-shared", group.files.token)
        manifest["spec"]["syncer"].update(
            shardEndpoints=group.urls, tokenSecretName="shr-token-shared"
        )
        cluster.apply(manifest)
        learner = start_learner(
            group.files,
            syncer_url=group.url,
            island="island-0",
            island_index=0,
            log_file=tmp_path / "island-0.log",
            master_port=free_port(),
            job_name="shr",
            extra_env={"OMP_NUM_THREADS": "1"},
        )
        wait_until(
            lambda: (cluster.status("shr").get("outerStep") or 0) >= 2,
            300,
            message="status.outerStep >= 2",
        )
        _kill_and_restore(cluster, group)
        learner.stop()  # no more merges: the statuses stand still
        status = wait_until(
            lambda: (
                (st := cluster.status("shr")).get("outerStep")
                == min(_outer(group, 0), _outer(group, 1))
                and _condition(st, "SyncerReachable").get("status") == "True"
                and st
            ),
            WAIT,
            message="status.outerStep = the least of the shards' once shard 1 is back",
        )
        # Shard 0 merged on while shard 1 was down: the job reads the one behind.
        assert _outer(group, 0) > _outer(group, 1) == status["outerStep"]
    finally:
        if learner is not None:
            learner.stop()
        for proc in group.procs:
            proc.stop()


def _outer(group: SyncerShards, shard: int) -> int:
    """Shard `shard`'s own outer step (its /v1/status)."""
    req = urllib.request.Request(
        group.urls[shard] + "/v1/status",
        headers={"Authorization": f"Bearer {group.files.token}"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(json.loads(resp.read())["outerStep"])


def _kill_and_restore(cluster: Cluster, group: SyncerShards) -> None:
    """SIGKILL shard 1; shard 0 merges on and the job's syncer is unreachable meanwhile; shard
    1 comes back on its port from its checkpoint, at most one outer step (its cadence) back."""
    before = _outer(group, 1)
    group.procs[1].kill()
    group.procs[1].wait()
    wait_until(
        lambda: _condition(cluster.status("shr"), "SyncerReachable").get("status") == "False",
        WAIT,
        message="SyncerReachable=False while shard 1 is down",
    )
    wait_until(
        lambda: _outer(group, 0) >= before + 2, 300, message="shard 0 merges while 1 is down"
    )
    group.start(1)
    assert _outer(group, 1) >= before - 1
