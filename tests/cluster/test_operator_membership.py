"""Pod health -> syncer membership, and syncer progress -> job status, with a real syncer.

kwok pods have no containers, so a real `diloco syncer` (and, for progress, a real learner)
runs on loopback and the job points at it with spec.syncer.endpoint.
"""

# ruff: noqa: F811  (fixtures are imported from operator_fixtures and requested by name)
from __future__ import annotations

from typing import Any

import pytest

from .conftest import wait_until
from .operator_fixtures import (  # noqa: F401
    Cluster,
    LocalSyncer,
    OperatorProcess,
    cluster,
    crd,
    elapsed_until,
    job_manifest,
    make_local_syncer,
    operator,
)

pytestmark = pytest.mark.cluster

# Deadlines for the operator to act: generous, for a loaded 2-core machine (waits end as soon as
# their condition holds). How fast a drop reaches the syncer is measured by bench/operator_scale.py.
WAIT = 180


def _remote_job(name: str, make_local_syncer: Any, **spec: Any) -> tuple[dict, LocalSyncer]:
    manifest = job_manifest(name, **spec)
    syncer = make_local_syncer(manifest)
    manifest["spec"]["syncer"] = {"endpoint": syncer.url, "tokenSecretName": syncer.secret_name}
    return manifest, syncer


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def test_operator_drops_unready_island_and_readds_it(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest, syncer = _remote_job("mem", make_local_syncer, islands={"count": 2, "replicas": 2})
    cluster.apply(manifest)
    # One status document for the wait and the assertions on it (read twice, its fields could
    # come from different reconciles).
    status = wait_until(
        lambda: (
            (st := cluster.status("mem")).get("islands", {}).get("ready") == 2
            and _condition(st, "SyncerReachable").get("status") == "True"
            and st
        ),
        WAIT,
        message="both islands ready and the syncer reached",
    )
    assert status["phase"] == "Running"
    assert cluster.get("deployment", "mem-syncer") is None  # remote syncer: none here

    cluster.set_pod_ready("mem-island-1-1", False)
    took = elapsed_until(
        lambda: syncer.island_state("island-1") == "dropped", WAIT, "island-1 dropped at the syncer"
    )
    print(f"pod NotReady -> island dropped at the syncer: {took:.2f}s")
    assert syncer.island_state("island-0") != "dropped"
    (event,) = wait_until(lambda: cluster.events("IslandDropped"), WAIT, message="drop Event")
    assert "island-1" in event["message"] and "mem-island-1-1" in event["message"]
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "mem"
    status = wait_until(
        lambda: (st := cluster.status("mem")).get("phase") == "Degraded" and st,
        WAIT,
        message="Degraded",
    )
    entry = next(i for i in status["islandStatuses"] if i["name"] == "island-1")
    assert entry["healthy"] is False and entry["readyPods"] == 1

    cluster.set_pod_ready("mem-island-1-1", True)
    took = elapsed_until(
        lambda: syncer.island_state("island-1") == "active", WAIT, "island-1 active again"
    )
    print(f"pod Ready -> island re-added at the syncer: {took:.2f}s")
    wait_until(lambda: cluster.events("IslandReadded"), WAIT, message="re-add Event")
    wait_until(lambda: cluster.status("mem").get("phase") == "Running", WAIT, message="Running")
    metrics = operator.metrics()
    assert "diloco_operator_islands_dropped_total 1.0" in metrics
    assert "diloco_operator_islands_readded_total 1.0" in metrics


def test_operator_status_follows_syncer_to_success(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest, syncer = _remote_job(
        "prog",
        make_local_syncer,
        islands={"count": 1, "replicas": 1},
        stopAfter={"outerSteps": 2},
        # Long enough for the checks below to see the finished job before it is deleted (with
        # 3 s, a loaded machine's kubectl polls could miss the Succeeded status altogether).
        ttlSecondsAfterFinished=20,
    )
    cluster.apply(manifest)
    wait_until(lambda: cluster.status("prog").get("phase") == "Running", WAIT, message="Running")
    learner = syncer.start_learner("island-0", 0)

    def outer_step_in_status() -> dict[str, Any] | None:
        status = cluster.status("prog")
        return status if (status.get("outerStep") or 0) >= 1 else None

    status = wait_until(outer_step_in_status, 300, message="status.outerStep >= 1")
    assert status["outerStep"] <= syncer.status()["outerStep"]
    assert status.get("lastSyncTime") and status.get("tokens", 0) > 0

    done = wait_until(
        lambda: (st := cluster.status("prog")).get("phase") == "Succeeded" and st,
        300,
        message="Succeeded",
    )
    assert done["outerStep"] == syncer.status()["outerStep"] >= 2
    assert _condition(done, "Succeeded")["status"] == "True" and done.get("finishedTime")
    # Finished: islands scaled to zero, then the job deleted after its TTL (children by GC).
    wait_until(
        lambda: all(s["spec"]["replicas"] == 0 for s in cluster.items("statefulsets")),
        WAIT,
        message="islands scaled to zero",
    )
    wait_until(lambda: not cluster.items("dilocojobs"), WAIT, message="job deleted after TTL")
    wait_until(lambda: not cluster.items("statefulsets"), WAIT, message="children collected")
    learner.wait(timeout=120)
    assert learner.returncode == 0, learner.log_text()[-3000:]


def test_operator_survives_unreachable_syncer(cluster: Cluster, operator: OperatorProcess) -> None:
    cluster.cp.kubectl(
        "create", "secret", "generic", "tok", "-n", cluster.ns, "--from-literal=token=t"
    )
    dead = "http://127.0.0.1:9"  # discard port: nothing answers
    cluster.apply(
        job_manifest(
            "lost", islands={"count": 1}, syncer={"endpoint": dead, "tokenSecretName": "tok"}
        )
    )
    condition = wait_until(
        lambda: (
            (c := _condition(cluster.status("lost"), "SyncerReachable")).get("status") == "False"
            and "127.0.0.1:9" in c.get("message", "")
            and c
        ),
        WAIT,
        message="SyncerReachable=False naming the endpoint",
    )
    assert condition["reason"] == "NotYetReached"
    status = wait_until(
        lambda: (st := cluster.status("lost")).get("islandsSummary") == "1/1" and st,
        WAIT,
        message="island ready",
    )
    assert status["phase"] == "Pending"
    assert operator.alive
    assert "diloco_operator_syncer_unreachable_total" in operator.metrics()


def test_operator_reaches_tls_syncer_with_ca_secret(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest = job_manifest("tls", islands={"count": 1})
    syncer = make_local_syncer(manifest, tls=True)
    assert syncer.url.startswith("https://") and syncer.cert is not None
    cluster.cp.kubectl(
        "create", "secret", "generic", "syncer-ca", "-n", cluster.ns,
        f"--from-file=ca.crt={syncer.cert}",
    )  # fmt: skip
    manifest["spec"]["syncer"] = {
        "endpoint": syncer.url,
        "tokenSecretName": syncer.secret_name,
        "tls": {"caSecretName": "syncer-ca"},
    }
    cluster.apply(manifest)
    wait_until(
        lambda: _condition(cluster.status("tls"), "SyncerReachable").get("status") == "True",
        WAIT,
        message="the HTTPS syncer reached with the CA from the Secret",
    )
    sts = cluster.get("statefulset", "tls-island-0")
    assert sts is not None
    env = {
        e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["DILOCO_SYNCER_URL"] == syncer.url and env["DILOCO_CA_FILE"].endswith("ca.crt")
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["ca"]["secret"]["secretName"] == "syncer-ca"


def test_operator_reaches_tls_syncer_when_ca_secret_comes_after_the_job(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest = job_manifest("late-ca", islands={"count": 1})
    syncer = make_local_syncer(manifest, tls=True)
    manifest["spec"]["syncer"] = {
        "endpoint": syncer.url,
        "tokenSecretName": syncer.secret_name,
        "tls": {"caSecretName": "late-ca"},
    }
    cluster.apply(manifest)
    wait_until(
        lambda: _condition(cluster.status("late-ca"), "SyncerReachable").get("status") == "False",
        WAIT,
        message="the HTTPS syncer unreachable while the CA Secret is missing",
    )
    cluster.cp.kubectl(
        "create", "secret", "generic", "late-ca", "-n", cluster.ns,
        f"--from-file=ca.crt={syncer.cert}",
    )  # fmt: skip
    wait_until(
        lambda: _condition(cluster.status("late-ca"), "SyncerReachable").get("status") == "True",
        WAIT,
        message="the syncer reached once the CA Secret exists (the operator re-reads it)",
    )
