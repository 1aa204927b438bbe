"""The operator creates a job's children, repairs drift, and lets GC delete them with the job."""

from __future__ import annotations

import re
from typing import Any

import pytest
from diloco_trainer.api import contract
from kubernetes import client

from .operator_helpers import Cluster, OperatorProcess, job_manifest
from .waits import WAIT, elapsed_until, wait_until

pytestmark = pytest.mark.cluster


OWNER_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of",
    "diloco.dev/job",
)


def _children(cluster: Cluster, job: str) -> dict[str, set[str]]:
    sel = f"diloco.dev/job={job}"
    return {
        "statefulsets": cluster.names("statefulsets", sel),
        "services": cluster.names("services", sel),
        "deployments": cluster.names("deployments", sel),
        "configmaps": cluster.names("configmaps", sel),
        "secrets": cluster.names("secrets", sel),
    }


def _children_fast(api: Any, namespace: str, job: str) -> dict[str, set[str]]:
    sel = f"diloco.dev/job={job}"
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)

    def names(items: Any) -> set[str]:
        return {o.metadata.name for o in items.items}

    return {
        "statefulsets": names(apps.list_namespaced_stateful_set(namespace, label_selector=sel)),
        "services": names(core.list_namespaced_service(namespace, label_selector=sel)),
        "deployments": names(apps.list_namespaced_deployment(namespace, label_selector=sel)),
        "configmaps": names(core.list_namespaced_config_map(namespace, label_selector=sel)),
        "secrets": names(core.list_namespaced_secret(namespace, label_selector=sel)),
    }


def _expected(job: str, islands: int) -> dict[str, set[str]]:
    names = {f"{job}-island-{i}" for i in range(islands)}
    return {
        "statefulsets": names,
        "services": names | {f"{job}-syncer"},
        "deployments": {f"{job}-syncer"},
        "configmaps": {f"{job}-config"},
        # The root token (the syncer's) and the islands' own credentials.
        "secrets": {f"{job}-token", f"{job}-island-tokens"},
    }


def test_operator_creates_children_with_env_contract(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    api = cluster.cp.api_client()
    cluster.apply(job_manifest("demo", islands={"count": 2, "replicas": 2, "shardOffset": 3}))
    # Polled with the Python client (kubectl start-up would dominate the measurement).
    took = elapsed_until(
        lambda: _children_fast(api, cluster.ns, "demo") == _expected("demo", 2), WAIT, "children"
    )
    print(f"job applied -> all children present: {took:.2f}s")
    assert _children(cluster, "demo") == _expected("demo", 2)
    uid = cluster.job("demo")["metadata"]["uid"]
    # Owner references do the clean-up: no finalizer that would outlive the operator.
    assert not cluster.job("demo")["metadata"].get("finalizers")
    for kind in ("statefulsets", "services", "deployments", "configmaps", "secrets"):
        for obj in cluster.items(kind, "diloco.dev/job=demo"):
            meta = obj["metadata"]
            (ref,) = meta["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
                "DiLoCoJob",
                "demo",
                uid,
                True,
            ), meta["name"]
            for label in OWNER_LABELS:
                assert meta["labels"].get(label), f"{kind}/{meta['name']} lacks {label}"

    sts = cluster.get("statefulset", "demo-island-1")
    assert sts is not None
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["metadata"]["labels"]["diloco.dev/island"] == "island-1"
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["diloco", "learner"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env[contract.ISLAND] == "island-1" and env[contract.ISLAND_INDEX] == "4"
    assert env[contract.WORLD_SIZE] == "2"
    assert env[contract.MASTER_ADDR] == "demo-island-1-0.demo-island-1"
    assert env[contract.RANK]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    assert env[contract.SYNCER_URL] == f"http://demo-syncer.{cluster.ns}.svc:8470"
    assert env[contract.CONFIG_FILE] == f"{contract.CONFIG_MOUNT}/{contract.CONFIG_KEY}"
    assert env[contract.TOKEN_FILE] == f"{contract.TOKEN_MOUNT}/{contract.TOKEN_KEY}"

    syncer = cluster.get("deployment", "demo-syncer")
    assert syncer is not None
    sc = syncer["spec"]["template"]["spec"]["containers"][0]
    assert sc["command"] == ["diloco", "syncer"]
    assert sc["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sc["livenessProbe"]["httpGet"]["path"] == "/healthz"

    config = cluster.get("configmap", "demo-config")
    assert config is not None and '"count":2' in config["data"][contract.CONFIG_KEY].replace(
        " ", ""
    )
    secret = cluster.get("secret", "demo-token")
    assert secret is not None and secret["data"][contract.TOKEN_KEY]

    # kwok runs the pods; the pod-index label RANK reads is set by the StatefulSet controller.
    pods = wait_until(lambda: cluster.pods_ready("diloco.dev/island", 4), WAIT, message="4 pods")
    for pod in pods:
        index = pod["metadata"]["labels"]["apps.kubernetes.io/pod-index"]
        assert re.fullmatch(r"demo-island-[01]-" + index, pod["metadata"]["name"])


def test_operator_kubectl_get_shows_printer_columns(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("cols", islands={"count": 2}))

    def table(resource: str) -> list[str] | None:
        """`kubectl get RESOURCE` once its row shows 2/2 islands (header and row of one read)."""
        lines = cluster.cp.kubectl("get", resource, "-n", cluster.ns).stdout.splitlines()
        return lines if len(lines) > 1 and lines[1].split()[2:3] == ["2/2"] else None

    for resource in ("dilocojobs", "dj"):
        lines = wait_until(lambda r=resource: table(r), WAIT, message=f"{resource}: 2/2 islands")
        assert re.split(r"\s{2,}", lines[0].strip()) == [
            "NAME",
            "PHASE",
            "ISLANDS",
            "OUTER STEP",
            "PROGRESS",
            "ETA",
            "EVAL LOSS",
            "AGE",
        ]
        row = lines[1].split()
        assert row[:3] == ["cols", "Pending", "2/2"]  # the in-cluster syncer never answers here


def test_operator_recreates_deleted_children(cluster: Cluster, operator: OperatorProcess) -> None:
    cluster.apply(job_manifest("drift", islands={"count": 2}))
    wait_until(
        lambda: _children(cluster, "drift") == _expected("drift", 2), WAIT, message="children"
    )
    before = {
        kind: cluster.get(kind, name)["metadata"]["uid"]  # type: ignore[index]
        for kind, name in (
            ("statefulset", "drift-island-1"),
            ("service", "drift-island-1"),
            ("deployment", "drift-syncer"),
        )
    }
    for kind, name in (
        ("statefulset", "drift-island-1"),
        ("service", "drift-island-1"),
        ("deployment", "drift-syncer"),
    ):
        cluster.cp.kubectl("delete", kind, name, "-n", cluster.ns, "--wait=false")

    def recreated() -> bool:
        for kind, name in (
            ("statefulset", "drift-island-1"),
            ("service", "drift-island-1"),
            ("deployment", "drift-syncer"),
        ):
            obj = cluster.get(kind, name)
            if obj is None or obj["metadata"]["uid"] == before[kind]:
                return False
        return True

    took = elapsed_until(recreated, WAIT, "deleted children recreated")
    print(f"deleted StatefulSet/Service/Deployment recreated in {took:.2f}s")
    assert cluster.get("statefulset", "drift-island-0") is not None


def test_operator_job_deletion_garbage_collects_children(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("gc", islands={"count": 2}))
    wait_until(lambda: _children(cluster, "gc") == _expected("gc", 2), WAIT, message="children")
    wait_until(lambda: cluster.pods_ready("diloco.dev/job=gc", 3), WAIT, message="pods")
    cluster.cp.kubectl("delete", "dilocojob", "gc", "-n", cluster.ns, "--wait=false")
    empty = {kind: set() for kind in _expected("gc", 2)}
    wait_until(lambda: _children(cluster, "gc") == empty, WAIT, message="children deleted by GC")
    wait_until(lambda: not cluster.items("pods", "diloco.dev/job=gc"), WAIT, message="pods gone")
    assert operator.alive
