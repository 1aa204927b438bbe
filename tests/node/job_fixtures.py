"""What the node tier's job tests build on: the chart installed with the operator image built
here (`chart_release`, the one release fixture every node test file uses), a tiny DiLoCoJob
pinned to the real node with a checkpoint volume, and reads of the job's status and of its
syncer's /v1/status.

The node has no registry and no volume provisioner: the images are loaded into the node
(conftest.node_images), pods never pull (`imagePullPolicy: Never`), and the checkpoint volume is
a hostPath PersistentVolume the test creates and pre-binds to the job's claim (the node is this
machine, so the test reads the final weights back from the same directory).
"""

from __future__ import annotations

import base64
import contextlib
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from chart.helm_tool import CHART, Helm

from hack.localcluster.harness import ControlPlane
from hack.localcluster.settings import NODE_LABEL, NODE_TAINT_KEY

TOLERATION = {"key": NODE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
NODE_SELECTOR = {NODE_LABEL: "true"}
SYNCER_PORT = 8470


def pinned(container: str) -> dict[str, Any]:
    """A pod template fragment: onto the real node, its image never pulled (no registry)."""
    return {
        "spec": {
            "nodeSelector": NODE_SELECTOR,
            "tolerations": [TOLERATION],
            "containers": [{"name": container, "imagePullPolicy": "Never"}],
        }
    }


def chart_values(operator_image: str) -> dict[str, Any]:
    """Values that run the chart's operator on the real node from the locally loaded image."""
    repository, tag = operator_image.rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "operator": {
            "nodeSelector": NODE_SELECTOR,
            "tolerations": [TOLERATION],
            # Two shared cores: the learners need them more than the operator does.
            "resources": {
                "requests": {"cpu": "50m", "memory": "128Mi"},
                "limits": {"cpu": "1", "memory": "512Mi"},
            },
        },
    }


@dataclass
class Release:
    """One `helm install` of charts/diloco-operator."""

    helm: Helm
    name: str
    namespace: str
    installed: bool = False

    def install(self, values: dict[str, Any], values_file: Path) -> None:
        values_file.write_text(json.dumps(values))
        args = ["install", self.name, str(CHART), "-n", self.namespace, "-f", str(values_file)]
        result = self.helm.run(*args, "--wait", "--timeout", "300s", timeout=360)
        assert result.returncode == 0, f"helm install failed:\n{result.stderr}"
        self.installed = True

    def uninstall(self) -> None:
        args = ["uninstall", self.name, "-n", self.namespace, "--wait", "--timeout", "180s"]
        result = self.helm.run(*args, timeout=240)
        assert result.returncode == 0, f"helm uninstall failed:\n{result.stderr}"
        self.installed = False

    @property
    def selector(self) -> str:
        return f"app.kubernetes.io/instance={self.name}"


@contextlib.contextmanager
def chart_release(
    cp: ControlPlane,
    operator_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    namespace: str,
    values: dict[str, Any] | None = None,
) -> Iterator[Release]:
    """The chart's operator running as a pod on the real node: `helm install` (release
    "diloco") into a fresh namespace named after `namespace`, with chart_values(operator_image)
    updated by `values` (top-level keys replace the defaults'); on exit `helm uninstall` unless
    a test already did, then the namespace is deleted. A module fixture is one `with` around it:

        with chart_release(node_cluster, node_images["operator"], tmp_path_factory, "ns") as rel:
            yield rel
    """
    home = tmp_path_factory.mktemp("helm")
    try:
        helm = Helm.located(home, env=cp.env)
    except RuntimeError as err:
        pytest.fail(f"helm is needed and could not be located or built: {err}")
    rel = Release(helm, "diloco", cp.create_namespace(namespace))
    try:
        rel.install({**chart_values(operator_image), **(values or {})}, home / "values.json")
        yield rel
    finally:
        try:
            if rel.installed:
                rel.uninstall()
            else:  # a failed install may still have left objects: remove what helm recorded
                helm.run("uninstall", rel.name, "-n", rel.namespace, "--wait", timeout=240)
        finally:
            cp.delete_namespace(rel.namespace)


def checkpoint_volume(name: str, namespace: str, path: Path) -> list[dict[str, Any]]:
    """A hostPath PersistentVolume pre-bound to the claim `name` (no provisioner on the node)."""
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(path), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": name},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]


def tiny_job(name: str, image: str, claim: str, outer_steps: int) -> dict[str, Any]:
    """2 islands x 2 DDP ranks of gpt-tiny on CPU, checkpointed every outer step to `claim`.
    A learner's CPU limit of 1 gives it one intra-op thread (learner/device.py): four learners
    share the node's two cores."""
    small = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    learner = {"requests": small["requests"], "limits": {"cpu": "1", "memory": "1Gi"}}
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": name},
        "spec": {
            "image": image,
            "model": {"preset": "gpt-tiny", "seed": 0},
            "data": {"source": "builtin:stdlib-text", "evalTokens": 4096},
            "islands": {
                "count": 2,
                "replicas": 2,
                "resources": learner,
                "template": pinned("learner"),
            },
            "inner": {
                "optimizer": "adamw",
                "lr": 3.0e-3,
                "warmupSteps": 2,
                "steps": 5,
                "batchSize": 4,
                "seqLen": 64,
            },
            "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
            "sync": {
                "quorum": 2,
                "fragments": 1,
                "overlapSteps": 0,
                "compression": "int8",
                "heartbeatTimeoutSeconds": 20,
            },
            "stopAfter": {"outerSteps": outer_steps},
            "syncer": {
                "resources": small,
                "checkpoint": {"claimName": claim, "everyOuterSteps": 1, "keep": 2},
                "evalEveryOuterSteps": 1,
                # These tests are the operator's mechanics: an honest overshoot of this tiny
                # job must not end it (the guard is tests/e2e/test_adversary_quality.py's).
                "qualityGuard": {"patience": 0},
                "template": pinned("syncer"),
            },
        },
    }


def job_status(cp: ControlPlane, ns: str, name: str) -> dict[str, Any]:
    return cp.kubectl_json("get", "dj", name, "-n", ns).get("status", {})


def syncer_pod(cp: ControlPlane, ns: str, job: str) -> dict[str, Any] | None:
    """The job's Ready syncer pod, or None while there is none."""
    selector = f"diloco.dev/job={job},app.kubernetes.io/component=syncer"
    for pod in cp.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]:
        ready = [c for c in pod["status"].get("conditions", []) if c["type"] == "Ready"]
        if (
            pod["metadata"].get("deletionTimestamp") is None
            and ready
            and ready[0]["status"] == "True"
        ):
            return pod
    return None


def syncer_status(cp: ControlPlane, ns: str, job: str) -> dict[str, Any] | None:
    """GET /v1/status of the Ready syncer pod with the job's root token (the node is this
    machine, so its pod IPs are reachable from here); None while no syncer pod is Ready."""
    pod = syncer_pod(cp, ns, job)
    if pod is None:
        return None
    secret = cp.kubectl_json("get", "secret", f"{job}-token", "-n", ns)
    token = base64.b64decode(secret["data"]["token"]).decode().strip()
    url = f"http://{pod['status']['podIP']}:{SYNCER_PORT}/v1/status"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)
