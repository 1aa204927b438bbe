"""Full end-to-end on kind: images built from the Dockerfile, the chart installed with helm, a tiny
DiLoCoJob trained to completion by real pods.

Needs a Docker engine and the `kind` CLI; without them the test skips with the reason (the only
skip in the project: CI machines have no Docker engine). helm and kubectl are the pinned
binaries of hack/build-binaries.sh, like in the other tiers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart.helm_tool import CHART, REPO, Helm, locate_binary

pytestmark = [pytest.mark.kind, pytest.mark.timeout(3600)]

TAG = "kind-test"
OPERATOR_IMAGE = f"diloco-operator:{TAG}"
TRAINER_IMAGE = f"diloco-trainer:{TAG}"
RELEASE = "diloco"
OPERATOR_NAMESPACE = "diloco-system"
JOB_NAMESPACE = "default"
JOB_NAME = "kind-tiny"
OUTER_STEPS = 3
# Two islands of one pod each train gpt-tiny for a few outer steps of a few inner steps.
TINY_JOB: dict[str, Any] = {
    "apiVersion": "diloco.dev/v1alpha1",
    "kind": "DiLoCoJob",
    "metadata": {"name": JOB_NAME, "namespace": JOB_NAMESPACE},
    "spec": {
        "image": TRAINER_IMAGE,
        "model": {"preset": "gpt-tiny"},
        "data": {"evalTokens": 2048},
        "islands": {
            "count": 2,
            "replicas": 1,
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        },
        "inner": {"steps": 4, "batchSize": 2, "seqLen": 32, "lr": 1e-3},
        "sync": {"quorum": 2, "graceSeconds": 1},
        "stopAfter": {"outerSteps": OUTER_STEPS},
        "syncer": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
    },
}
BUILD_TIMEOUT_S = 1800  # the trainer image downloads torch
CLUSTER_TIMEOUT_S = 300
TRAIN_TIMEOUT_S = 900


def docker_unavailable() -> str | None:
    """Why this machine cannot run the kind tier, or None when it can."""
    if shutil.which("docker") is None:
        return "no `docker` CLI on PATH"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30 s"
    if info.returncode != 0:
        last = (info.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no Docker engine reachable (`docker info`: {last})"
    if shutil.which("kind") is None:
        return "no `kind` CLI on PATH (https://kind.sigs.k8s.io)"
    return None


def run(
    argv: list[str], *, timeout: float, env: dict[str, str] | None = None, input: str | None = None
) -> str:
    """Run a command; fail the test with its output when it exits non-zero."""
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, input=input, check=False
    )
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(argv)} exited {result.returncode}\n"
            f"stdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}"
        )
    return result.stdout


def wait_for(
    probe: Callable[[], Any], *, timeout: float, what: str, on_timeout: Callable[[], str]
) -> Any:
    """Poll probe() until it returns something truthy; fail with diagnostics at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{on_timeout()}")
        time.sleep(2)


@dataclass
class KindCluster:
    """A kind cluster with the chart's images loaded, and the tools pointed at it."""

    name: str
    kubeconfig: Path
    kubectl_path: Path
    helm: Helm

    def kubectl(self, *args: str, timeout: float = 120, input: str | None = None) -> str:
        """kubectl against this cluster; fails the test on a non-zero exit."""
        argv = [str(self.kubectl_path), "--kubeconfig", str(self.kubeconfig), *args]
        return run(argv, timeout=timeout, input=input)

    def job(self) -> dict[str, Any]:
        """The DiLoCoJob as the API server has it."""
        return json.loads(
            self.kubectl("get", "dilocojob", JOB_NAME, "-n", JOB_NAMESPACE, "-o=json")
        )

    def diagnostics(self) -> str:
        """What a person would look at when the job does not finish."""
        parts = []
        for args in (
            ["get", "pods", "-A", "-o", "wide"],
            ["describe", "dilocojob", JOB_NAME, "-n", JOB_NAMESPACE],
            ["logs", "-n", OPERATOR_NAMESPACE, "deployment/diloco-diloco-operator", "--tail=80"],
            ["logs", "-n", JOB_NAMESPACE, f"deployment/{JOB_NAME}-syncer", "--tail=60"],
        ):
            argv = [str(self.kubectl_path), "--kubeconfig", str(self.kubeconfig), *args]
            result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{result.stdout}{result.stderr}")
        return "\n".join(parts)


def build_images() -> None:
    """Build the operator and CPU trainer images from the repository's Dockerfile."""
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    for target, image, extra in (
        ("operator", OPERATOR_IMAGE, []),
        ("trainer", TRAINER_IMAGE, ["--build-arg", "TORCH_VARIANT=cpu"]),
    ):
        argv = ["docker", "build", "--target", target, "-t", image, *extra, str(REPO)]
        run(argv, timeout=BUILD_TIMEOUT_S, env=env)


@pytest.fixture(scope="module")
def kind_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KindCluster]:
    reason = docker_unavailable()
    if reason:
        pytest.skip(f"kind tier needs a Docker engine and kind: {reason}")
    try:
        helm = Helm.located(tmp_path_factory.mktemp("helm-home"))
        kubectl = locate_binary("kubectl")
    except RuntimeError as err:
        pytest.fail(f"the kind tier needs the pinned helm and kubectl: {err}")
    build_images()
    workdir = tmp_path_factory.mktemp("kind")
    name = f"diloco-{uuid.uuid4().hex[:8]}"
    kubeconfig = workdir / "kubeconfig"
    create = ["kind", "create", "cluster", "--name", name, "--kubeconfig", str(kubeconfig)]
    try:
        run([*create, "--wait", f"{CLUSTER_TIMEOUT_S}s"], timeout=CLUSTER_TIMEOUT_S + 60)
        for image in (OPERATOR_IMAGE, TRAINER_IMAGE):
            run(["kind", "load", "docker-image", "--name", name, image], timeout=600)
        yield KindCluster(name, kubeconfig, kubectl, helm)
    finally:
        subprocess.run(
            ["kind", "delete", "cluster", "--name", name, "--kubeconfig", str(kubeconfig)],
            capture_output=True,
            timeout=300,
            check=False,
        )


def test_kind_job_should_be_valid_for_the_operator_when_parsed() -> None:
    # Runs everywhere (no Docker needed), so the manifest of the skipped test stays correct.
    from diloco_operator.api import parse_job_spec

    spec = parse_job_spec(TINY_JOB["spec"])
    assert spec.islands.count == 2 and spec.islands.replicas == 1
    assert spec.stop_after.outer_steps == OUTER_STEPS
    assert spec.image == TRAINER_IMAGE


def test_kind_should_train_tiny_job_to_success_when_chart_installed(
    kind_cluster: KindCluster,
) -> None:
    cluster = kind_cluster
    install = [
        "install", RELEASE, str(CHART),
        "--kubeconfig", str(cluster.kubeconfig),
        "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
        "--set", "image.repository=diloco-operator",
        "--set", f"image.tag={TAG}",
        "--set", "image.pullPolicy=Never",
        "--wait", "--timeout", "5m",
    ]  # fmt: skip
    result = cluster.helm.run(*install, timeout=420)
    assert result.returncode == 0, f"helm install failed:\n{result.stderr}\n{cluster.diagnostics()}"
    try:
        # The chart installed the CRD and a Ready operator (--wait); now a job.
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(TINY_JOB))

        def outer_step() -> int:
            return int(cluster.job().get("status", {}).get("outerStep") or 0)

        first = wait_for(
            outer_step,
            timeout=TRAIN_TIMEOUT_S,
            what="status.outerStep to advance",
            on_timeout=cluster.diagnostics,
        )
        assert first >= 1

        def finished() -> dict[str, Any] | None:
            status = cluster.job().get("status", {})
            assert status.get("phase") != "Failed", f"job failed: {status}"
            return status if status.get("phase") == "Succeeded" else None

        status = wait_for(
            finished,
            timeout=TRAIN_TIMEOUT_S,
            what="phase Succeeded",
            on_timeout=cluster.diagnostics,
        )
        assert status["outerStep"] >= OUTER_STEPS
        assert status["outerStep"] >= first
        # Printer columns work for users: `kubectl get dj` shows the phase.
        table = cluster.kubectl("get", "dj", JOB_NAME, "-n", JOB_NAMESPACE)
        assert "Succeeded" in table
    finally:
        cluster.helm.run(
            "uninstall", RELEASE, "--kubeconfig", str(cluster.kubeconfig),
            "--namespace", OPERATOR_NAMESPACE, "--wait", timeout=300,
        )  # fmt: skip
