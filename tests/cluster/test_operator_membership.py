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

DROP_DEADLINE = 5.0


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
    wait_until(
        lambda: (
            cluster.status("mem").get("islands", {}).get("ready") == 2
            and _condition(cluster.status("mem"), "SyncerReachable").get("status") == "True"
        ),
        90,
        message="both islands ready and the syncer reached",
    )
    assert cluster.get("deployment", "mem-syncer") is None  # remote syncer: none here
    assert cluster.status("mem")["phase"] == "Running"

    cluster.set_pod_ready("mem-island-1-1", False)
    took = elapsed_until(
        lambda: syncer.island_state("island-1") == "dropped", 15, "island-1 dropped at the syncer"
    )
    print(f"pod NotReady -> island dropped at the syncer: {took:.2f}s")
    assert took < DROP_DEADLINE
    assert syncer.island_state("island-0") != "dropped"
    (event,) = wait_until(lambda: cluster.events("IslandDropped"), 30, message="drop Event")
    assert "island-1" in event["message"] and "mem-island-1-1" in event["message"]
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "mem"
    wait_until(lambda: cluster.status("mem").get("phase") == "Degraded", 30, message="Degraded")
    entry = next(i for i in cluster.status("mem")["islandStatuses"] if i["name"] == "island-1")
    assert entry["healthy"] is False and entry["readyPods"] == 1

    cluster.set_pod_ready("mem-island-1-1", True)
    took = elapsed_until(
        lambda: syncer.island_state("island-1") == "active", 15, "island-1 active again"
    )
    print(f"pod Ready -> island re-added at the syncer: {took:.2f}s")
    assert took < DROP_DEADLINE
    wait_until(lambda: cluster.events("IslandReadded"), 30, message="re-add Event")
    wait_until(lambda: cluster.status("mem").get("phase") == "Running", 30, message="Running")
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
        ttlSecondsAfterFinished=3,
    )
    cluster.apply(manifest)
    wait_until(lambda: cluster.status("prog").get("phase") == "Running", 90, message="Running")
    learner = syncer.start_learner("island-0", 0)

    def outer_step_in_status() -> int | None:
        step = cluster.status("prog").get("outerStep")
        return step if step and step >= 1 else None

    wait_until(outer_step_in_status, 180, message="status.outerStep >= 1")
    status = cluster.status("prog")
    assert status["outerStep"] <= syncer.status()["outerStep"]
    assert status.get("lastSyncTime") and status.get("tokens", 0) > 0

    wait_until(lambda: cluster.status("prog").get("phase") == "Succeeded", 180, message="Succeeded")
    done = cluster.status("prog")
    assert done["outerStep"] == syncer.status()["outerStep"] >= 2
    assert _condition(done, "Succeeded")["status"] == "True" and done.get("finishedTime")
    # Finished: islands scaled to zero, then the job deleted after its TTL (children by GC).
    wait_until(
        lambda: all(s["spec"]["replicas"] == 0 for s in cluster.items("statefulsets")),
        30,
        message="islands scaled to zero",
    )
    wait_until(lambda: not cluster.items("dilocojobs"), 60, message="job deleted after TTL")
    wait_until(lambda: not cluster.items("statefulsets"), 60, message="children collected")
    learner.wait(timeout=60)
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
        60,
        message="SyncerReachable=False naming the endpoint",
    )
    assert condition["reason"] == "NotYetReached"
    wait_until(
        lambda: cluster.status("lost").get("islandsSummary") == "1/1", 60, message="island ready"
    )
    assert cluster.status("lost")["phase"] == "Pending"
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
        60,
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
        60,
        message="the HTTPS syncer unreachable while the CA Secret is missing",
    )
    cluster.cp.kubectl(
        "create", "secret", "generic", "late-ca", "-n", cluster.ns,
        f"--from-file=ca.crt={syncer.cert}",
    )  # fmt: skip
    wait_until(
        lambda: _condition(cluster.status("late-ca"), "SyncerReachable").get("status") == "True",
        60,
        message="the syncer reached once the CA Secret exists (the operator re-reads it)",
    )
