"""`helm install` of charts/diloco-operator into a real control plane, the operator at work with
the chart's ServiceAccount (not the admin's credentials), and `helm uninstall` leaving nothing of
the release behind.

The chart's operator pod is a kwok fake (no containers), so the operator itself runs as a local
process with the arguments of the installed Deployment and a kubeconfig minted for the installed
ServiceAccount: every request it makes is authorised by the chart's RBAC and nothing else.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hack.localcluster.harness import ControlPlane

from .operator_helpers import Cluster, LocalSyncer, create_token_secret, job_manifest
from .region_helpers import (
    ChartRelease,
    chart_object_names,
    helm_for,
    operator_args,
    start_chart_operator,
)
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster

JOB = "helmjob"
CRD = "customresourcedefinition/dilocojobs.diloco.dev"


def test_helm_install_operator_reconciles_as_chart_serviceaccount_and_uninstall_cleans_up(
    control_plane: ControlPlane, namespace: str, shared_syncer: LocalSyncer, tmp_path: Path
) -> None:
    cp = control_plane
    jobs_ns = cp.create_namespace("helm-jobs")  # users' jobs live apart from the operator
    release = ChartRelease(
        helm_for(cp, tmp_path / "helm"),
        cp,
        name=f"diloco-{namespace[-6:]}",
        namespace=namespace,
        values={"watchNamespaces": [jobs_ns]},
    )
    operator = None
    uninstalled = False
    try:
        release.install()
        installed = chart_object_names(release.manifest())
        for kind in ("serviceaccounts", "clusterroles", "clusterrolebindings", "deployments"):
            assert any(n.startswith(f"{kind}/") for n in installed), (kind, installed)
        assert installed <= release.labelled_objects()
        cp.kubectl("wait", "--for=condition=Established", CRD, "--timeout=180s")
        deployment = next(n for n in installed if n.startswith("deployments/"))
        ready = cp.kubectl_json("get", deployment, "-n", namespace)["status"]
        assert ready.get("readyReplicas") == 1, ready  # a kwok pod: Ready without a container

        operator = start_chart_operator(
            cp,
            args=operator_args(release.manifest()),
            namespace=namespace,
            serviceaccount=release.service_account(),
            workdir=tmp_path / "operator",
        )
        denied = subprocess.run(
            [str(cp.bin_dir / "kubectl"), "auth", "can-i", "create", "clusterroles"],
            env=operator.env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert denied.stdout.strip() == "no", "the operator must not run with admin rights"

        jobs = Cluster(cp, jobs_ns)
        create_token_secret(cp, jobs_ns, shared_syncer.secret_name, shared_syncer.token)
        syncer = {"endpoint": shared_syncer.url, "tokenSecretName": shared_syncer.secret_name}
        islands = {"count": 2, "replicas": 1, "namePrefix": "helm"}
        jobs.apply(job_manifest(JOB, islands=islands, syncer=syncer))
        status = wait_until(
            lambda: (st := jobs.status(JOB)).get("phase") == "Running" and st,
            WAIT,
            message="the job Running (islands ready, syncer reached)",
        )
        assert jobs.names("statefulsets") == {f"{JOB}-helm-island-0", f"{JOB}-helm-island-1"}
        assert f"{JOB}-config" in jobs.names("configmaps")
        counts = status["islands"]
        assert (counts["desired"], counts["ready"]) == (2, 2), counts

        # An island whose pod turns unready is dropped at the syncer, then re-added.
        jobs.set_pod_ready(f"{JOB}-helm-island-1-0", False)
        wait_until(
            lambda: shared_syncer.island_state("helm-island-1") == "dropped",
            WAIT,
            message="helm-island-1 dropped at the syncer",
        )
        wait_until(lambda: jobs.events("IslandDropped"), WAIT, message="an IslandDropped Event")
        jobs.set_pod_ready(f"{JOB}-helm-island-1-0", True)
        wait_until(
            lambda: shared_syncer.island_state("helm-island-1") == "active",
            WAIT,
            message="helm-island-1 re-added",
        )
        assert operator.denials() == [], "the chart's RBAC refused the operator something"
        operator.stop()

        result = release.uninstall()
        uninstalled = result.returncode == 0
        assert uninstalled, result.stderr
        # Deleted by helm, or by garbage collection (the Deployment's ReplicaSet and pod).
        wait_until(
            lambda: release.labelled_objects() == set(),
            WAIT,
            message=f"nothing labelled {release.selector} left",
        )
        # Helm never deletes what it installed from crds/: the CRD, and so the jobs, stay.
        cp.kubectl("get", CRD)
        assert jobs.get("dilocojob", JOB) is not None
    finally:
        if operator is not None:
            operator.stop()
        if not uninstalled:
            release.uninstall()  # cluster-scoped RBAC must not outlive a failed test
        cp.kubectl("delete", "dilocojobs", "--all", "-n", jobs_ns, "--wait=false", check=False)
        cp.delete_namespace(jobs_ns)
