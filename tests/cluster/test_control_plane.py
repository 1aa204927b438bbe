"""The local control plane itself: nodes, scheduling, kwok pod lifecycle, GC, RBAC."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hack.localcluster.harness import ControlPlane, pod_ready

from .waits import WAIT, holds_for, wait_until

pytestmark = pytest.mark.cluster


def _statefulset(name: str, replicas: int) -> list[dict[str, Any]]:
    labels = {"app": name}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name},
            "spec": {"clusterIP": "None", "selector": labels, "ports": [{"port": 80}]},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name},
            "spec": {
                "serviceName": name,
                "replicas": replicas,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "containers": [
                            {
                                "name": "main",
                                "image": "registry.invalid/fake:latest",
                                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                            }
                        ]
                    },
                },
            },
        },
    ]


def _pods(cp: ControlPlane, namespace: str, selector: str) -> list[dict[str, Any]]:
    return cp.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]


def _running_ready(cp: ControlPlane, namespace: str, selector: str, count: int):
    pods = _pods(cp, namespace, selector)
    ok = [
        p
        for p in pods
        if p["status"].get("phase") == "Running"
        and pod_ready(p)
        and "deletionTimestamp" not in p["metadata"]
    ]
    return ok if len(ok) == count else None


def _get_pod(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    return cp.kubectl_json("get", "pod", name, "-n", namespace)


def _bare_pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "registry.invalid/fake:latest"}],
        },
    }


def test_nodes_ready(control_plane: ControlPlane) -> None:
    nodes = control_plane.kubectl_json("get", "nodes")["items"]
    assert len(nodes) >= 1
    for node in nodes:
        assert node["metadata"]["annotations"].get("kwok.x-k8s.io/node") == "fake"
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", node["metadata"]["name"]
        # The node lifecycle controller removes the not-ready taint once the node is Ready.
        taints = [t["key"] for t in node["spec"].get("taints") or []]
        assert "node.kubernetes.io/not-ready" not in taints


def test_version_and_rbac_mode(control_plane: ControlPlane) -> None:
    version = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    assert version["clientVersion"]["gitVersion"] == version["serverVersion"]["gitVersion"]
    # RBAC is on: the admin (system:masters) can do anything, anonymous nothing.
    can = control_plane.kubectl("auth", "can-i", "*", "*", check=False)
    assert can.stdout.strip() == "yes"


def test_statefulset_pods_become_running_and_ready(
    control_plane: ControlPlane, namespace: str
) -> None:
    control_plane.apply(_statefulset("web", 2), namespace)
    pods = wait_until(
        lambda: _running_ready(control_plane, namespace, "app=web", 2),
        timeout=WAIT,
        message="2 Running+Ready pods of StatefulSet web",
    )
    assert sorted(p["metadata"]["name"] for p in pods) == ["web-0", "web-1"]
    for pod in pods:
        assert pod["spec"]["nodeName"].startswith("kwok-node-")
        assert pod["status"].get("podIP")
    wait_until(
        lambda: (
            control_plane.kubectl_json("get", "statefulset", "web", "-n", namespace)["status"].get(
                "readyReplicas"
            )
            == 2
        ),
        timeout=WAIT,
        message="StatefulSet web readyReplicas == 2",
    )


def test_deleted_statefulset_pod_is_recreated_and_ready(
    control_plane: ControlPlane, namespace: str
) -> None:
    control_plane.apply(_statefulset("db", 2), namespace)
    pods = wait_until(
        lambda: _running_ready(control_plane, namespace, "app=db", 2),
        timeout=WAIT,
        message="2 Running+Ready pods of StatefulSet db",
    )
    old_uid = next(p["metadata"]["uid"] for p in pods if p["metadata"]["name"] == "db-1")
    # Graceful delete: kwok's pod-delete stage finishes it (there is no kubelet).
    control_plane.kubectl("delete", "pod", "db-1", "-n", namespace, "--wait=true", timeout=WAIT)

    def recreated() -> bool:
        pod = _get_pod(control_plane, namespace, "db-1")
        return (
            pod["metadata"]["uid"] != old_uid
            and pod["status"].get("phase") == "Running"
            and pod_ready(pod)
        )

    wait_until(recreated, timeout=WAIT, message="db-1 recreated and Ready")


def _patch_status(cp: ControlPlane, namespace: str, pod: str, patch: dict[str, Any]) -> None:
    """A strategic merge patch of the pod's status subresource (kwok never writes it back)."""
    cp.kubectl(
        "patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=strategic",
        "-p", json.dumps(patch),
    )  # fmt: skip


def test_patched_not_ready_condition_sticks(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.apply(_statefulset("learner", 2), namespace)
    wait_until(
        lambda: _running_ready(control_plane, namespace, "app=learner", 2),
        timeout=WAIT,
        message="2 Running+Ready pods of StatefulSet learner",
    )
    patch = {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "Test"}]}}
    _patch_status(control_plane, namespace, "learner-0", patch)

    def still_not_ready() -> bool:
        pod = _get_pod(control_plane, namespace, "learner-0")
        return pod["status"]["phase"] == "Running" and not pod_ready(pod)

    holds_for(still_not_ready, duration=3.0, message="learner-0 Ready=False after the patch")
    # The StatefulSet controller sees it too.
    wait_until(
        lambda: (
            control_plane.kubectl_json("get", "statefulset", "learner", "-n", namespace)[
                "status"
            ].get("readyReplicas", 0)
            == 1
        ),
        timeout=WAIT,
        message="StatefulSet learner readyReplicas == 1",
    )


def test_patched_failed_phase_sticks(control_plane: ControlPlane, namespace: str) -> None:
    control_plane.apply(_bare_pod("worker"), namespace)
    wait_until(
        lambda: _running_ready(control_plane, namespace, "app=worker", 1),
        timeout=WAIT,
        message="pod worker Running+Ready",
    )
    patch = {
        "status": {
            "phase": "Failed",
            "reason": "Error",
            "conditions": [{"type": "Ready", "status": "False"}],
        }
    }
    _patch_status(control_plane, namespace, "worker", patch)

    def still_failed() -> bool:
        pod = _get_pod(control_plane, namespace, "worker")
        return pod["status"]["phase"] == "Failed" and not pod_ready(pod)

    holds_for(still_failed, duration=3.0, message="pod worker phase=Failed after the patch")
    # A failed pod can still be deleted (kwok finishes the graceful deletion).
    control_plane.kubectl("delete", "pod", "worker", "-n", namespace, "--wait=true", timeout=WAIT)


def test_garbage_collection_by_owner_reference(control_plane: ControlPlane, namespace: str) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "owner"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "owner"}},
            "template": {
                "metadata": {"labels": {"app": "owner"}},
                "spec": {"containers": [{"name": "main", "image": "registry.invalid/fake:1"}]},
            },
        },
    }
    control_plane.apply(deployment, namespace)
    uid = control_plane.kubectl_json("get", "deployment", "owner", "-n", namespace)["metadata"][
        "uid"
    ]
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": "owner",
                    "uid": uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "data": {"k": "v"},
    }
    control_plane.apply(child, namespace)
    wait_until(
        lambda: _running_ready(control_plane, namespace, "app=owner", 1),
        timeout=WAIT,
        message="the Deployment's pod Running+Ready",
    )
    control_plane.kubectl("delete", "deployment", "owner", "-n", namespace, "--wait=false")

    def gone() -> bool:
        cm = control_plane.kubectl("get", "configmap", "owned", "-n", namespace, check=False)
        pods = _pods(control_plane, namespace, "app=owner")
        return cm.returncode != 0 and "NotFound" in cm.stderr and not pods

    wait_until(gone, timeout=WAIT, message="ConfigMap owned and the pods garbage-collected")


def test_serviceaccount_kubeconfig_is_least_privilege(
    control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    control_plane.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    control_plane.kubectl(
        "create", "role", "pod-reader", "--verb=get,list,watch", "--resource=pods", "-n", namespace
    )
    control_plane.kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
        "-n",
        namespace,
    )
    kubeconfig = control_plane.kubeconfig_for_sa(namespace, "reader", tmp_path / "sa.kubeconfig")
    env = control_plane.env_with_kubeconfig(kubeconfig)

    def sa_kubectl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(control_plane.bin_dir / "kubectl"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT,
            check=False,
        )

    who = sa_kubectl("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
    assert who.stdout == f"system:serviceaccount:{namespace}:reader", who.stderr
    assert sa_kubectl("get", "pods", "-n", namespace).returncode == 0
    denied = sa_kubectl("get", "secrets", "-n", namespace)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()
    assert sa_kubectl("get", "pods", "-n", "default").returncode != 0


def test_two_control_planes_side_by_side(make_control_plane, control_plane: ControlPlane) -> None:
    other = make_control_plane("second")
    assert other.server != control_plane.server
    ns = other.create_namespace("only-here")
    try:
        assert other.kubectl("get", "namespace", ns, check=False).returncode == 0
        assert control_plane.kubectl("get", "namespace", ns, check=False).returncode != 0
        other.apply(_bare_pod("p"), ns)
        wait_until(
            lambda: _running_ready(other, ns, "app=p", 1),
            timeout=WAIT,
            message="a pod Running+Ready on the second cluster",
        )
    finally:
        other.delete_namespace(ns)
