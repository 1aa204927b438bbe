"""A DiLoCoJob trains in real pods (issue 11): the chart's operator runs as a pod on the real
node from the image built here, and a tiny job (2 islands x 2 DDP ranks of gpt-tiny on CPU, a
checkpoint volume) trains, loses a learner pod and its syncer pod on the way, succeeds, and
leaves its final weights on the volume; `helm uninstall` and deleting the job leave nothing.

The tests run in file order and share one release and one job (module fixtures): each step
starts where the previous one left the job.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_operator.resources.pods import RUN_AS_USER
from diloco_trainer.syncer.storage.checkpoint import load_checkpoint
from safetensors import safe_open

from hack.localcluster.harness import ControlPlane, poll_until
from hack.localcluster.settings import NODE_NAME

from .job_fixtures import (
    Release,
    chart_release,
    checkpoint_volume,
    job_status,
    syncer_pod,
    syncer_status,
    tiny_job,
)

JOB = "tiny"
# Far more than the steps below need: step 5 lowers spec.stopAfter to a few steps ahead, so the
# earlier steps never race the job's end however fast or slow the shared machine is.
OUTER_STEPS = 10_000
MORE_STEPS = 3
WAIT = float(os.environ.get("DILOCO_NODE_JOB_WAIT", "300"))  # seconds; waits end once they hold


@dataclass
class JobRun:
    cp: ControlPlane
    ns: str
    name: str
    volume: Path

    def status(self) -> dict[str, Any]:
        return job_status(self.cp, self.ns, self.name)

    def syncer(self) -> dict[str, Any]:
        """The syncer's /v1/status, waiting for a Ready syncer pod that answers."""
        return poll_until(
            lambda: syncer_status(self.cp, self.ns, self.name),
            timeout=WAIT,
            what=f"{self.ns}/{self.name}'s syncer answering /v1/status",
            ignore=(OSError,),
        )

    def wait_syncer(self, what: str, check: Any) -> dict[str, Any]:
        """Poll the syncer's status until check(status) holds; that status."""

        def holds() -> dict[str, Any] | None:
            status = syncer_status(self.cp, self.ns, self.name)
            return status if status is not None and check(status) else None

        return self.explained(lambda: poll_until(holds, timeout=WAIT, what=what, ignore=(OSError,)))

    def events(self, reason: str) -> list[dict[str, Any]]:
        items = self.cp.kubectl_json("get", "events", "-n", self.ns)["items"]
        return [e for e in items if e.get("reason") == reason]

    def explained(self, wait: Any) -> Any:
        """Run wait(); on a timeout, fail with the job's pods, status and syncer log."""
        try:
            return wait()
        except TimeoutError as e:
            pods = self.cp.kubectl("get", "pods", "-n", self.ns, "-o", "wide", check=False).stdout
            syncer = f"deploy/{self.name}-syncer"
            log = self.cp.kubectl("logs", syncer, "-n", self.ns, "--tail=30", check=False).stdout
            raise AssertionError(f"{e}\n{pods}\nstatus: {self.status()}\nsyncer log:\n{log}") from e


@pytest.fixture(scope="module")
def release(
    node_cluster: ControlPlane,
    node_images: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Release]:
    operator = node_images["operator"]
    with chart_release(node_cluster, operator, tmp_path_factory, "diloco-system") as rel:
        yield rel


@pytest.fixture(scope="module")
def job(
    node_cluster: ControlPlane,
    node_images: dict[str, str],
    release: Release,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[JobRun]:
    """The tiny job in its own namespace, its checkpoints on a hostPath volume owned by the uid
    the operator runs pods as (fsGroup does not reach a hostPath)."""
    ns = node_cluster.create_namespace("job-on-node")
    volume = tmp_path_factory.mktemp("checkpoints")
    volume.chmod(0o755)
    os.chown(volume, RUN_AS_USER, RUN_AS_USER)
    claim = f"{ns}-ckpt"  # the PersistentVolume is cluster-wide: one per namespace
    node_cluster.apply(checkpoint_volume(claim, ns, volume))
    node_cluster.apply(tiny_job(JOB, node_images["trainer"], claim, OUTER_STEPS), ns)
    yield JobRun(node_cluster, ns, JOB, volume)
    node_cluster.delete_namespace(ns)
    node_cluster.kubectl("delete", "pv", claim, "--ignore-not-found", "--wait=false")


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_chart_operator_runs_as_pod_on_real_node(
    node_cluster: ControlPlane, release: Release
) -> None:
    cp = node_cluster
    pods = cp.kubectl_json("get", "pods", "-n", release.namespace, "-l", release.selector)["items"]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    pod = pods[0]
    assert ready(pod), pod["status"]  # helm --wait: its readiness probe (/readyz) passed
    assert pod["spec"]["nodeName"] == NODE_NAME
    (container,) = pod["spec"]["containers"]
    assert container["imagePullPolicy"] == "Never"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    sa = pod["spec"]["serviceAccountName"]
    assert sa.startswith(release.name)  # the chart's ServiceAccount, bound by its RBAC
    can = cp.kubectl(
        "auth", "can-i", "create", "statefulsets", "-n", "default",
        f"--as=system:serviceaccount:{release.namespace}:{sa}", check=False,
    )  # fmt: skip
    assert can.stdout.strip() == "yes"
    name = pod["metadata"]["name"]
    metrics = cp.kubectl(
        "get", "--raw", f"/api/v1/namespaces/{release.namespace}/pods/{name}:9090/proxy/metrics"
    ).stdout
    assert "diloco_operator_reconciles_total" in metrics


def outer_step(run: JobRun) -> int:
    return int(run.status().get("outerStep") or 0)


def test_job_trains_in_real_pods_eval_loss_falling(job: JobRun) -> None:
    cp = job.cp
    job.explained(
        lambda: poll_until(lambda: outer_step(job) >= 3, timeout=WAIT, what="outer step 3")
    )
    table = cp.kubectl("get", "dj", job.name, "-n", job.ns).stdout.splitlines()
    columns = dict(zip(table[0].split(), table[1].split(), strict=False))
    assert columns["PHASE"] == "Running" and columns["ISLANDS"] == "2/2", table
    assert int(table[1].split()[3]) >= 3, table  # OUTER STEP
    pods = cp.kubectl_json("get", "pods", "-n", job.ns)["items"]
    names = sorted(p["metadata"]["name"] for p in pods)
    assert [n for n in names if "island" in n] == [
        f"{JOB}-island-{i}-{r}" for i in (0, 1) for r in (0, 1)
    ]
    assert all(p["spec"]["nodeName"] == NODE_NAME for p in pods)
    # A syncer takes a minute to start here (data, initial eval): its startup probe, not the
    # liveness probe, covers that (the liveness probe alone killed it).
    syncer = syncer_pod(cp, job.ns, job.name)
    assert syncer is not None
    assert syncer["status"]["containerStatuses"][0]["restartCount"] == 0, syncer["status"]
    status = job.syncer()
    evals = [e["evalLoss"] for e in status["evalHistory"]]
    assert len(evals) >= 3 and evals[-1] < evals[0] - 0.5, evals
    # Each island is 2 DDP ranks: both pods of island 0 reached the syncer as one island.
    assert status["islands"]["island-0"]["replicas"] == 2
    log = cp.kubectl("logs", f"{JOB}-island-0-1", "-n", job.ns).stdout
    assert "rank 1/2" in log, log[-2000:]
    # limits.cpu 1 on a cgroup v1 node: one thread, not one per node CPU.
    assert "on cpu with 1 thread(s)" in log, log[-2000:]


def test_deleted_learner_pod_is_dropped_comes_back_and_contributes(job: JobRun) -> None:
    cp, island = job.cp, "island-1"
    before = job.syncer()
    record = before["islands"][island]
    version = before["versions"][0]
    assert not before["finished"], "the job finished before a learner could be deleted"
    cp.kubectl("delete", "pod", f"{JOB}-island-1-1", "-n", job.ns, "--wait=false")
    dropped = job.explained(
        lambda: poll_until(
            lambda: [e for e in job.events("IslandDropped") if island in e["message"]],
            timeout=WAIT,
            what=f"{island} dropped",
        )
    )
    assert "tiny-island-1-1" in dropped[0]["message"]
    log_of = f"{JOB}-island-1-0"

    def rejoin_version() -> int | None:
        """The version island-1 last joined at (its rank 0's log, whose container may have
        restarted), None before it rejoined: a join at `version` or later is a rejoin."""
        log = cp.kubectl("logs", log_of, "-n", job.ns, check=False).stdout
        joins = [int(v) for v in re.findall(r"took version (\d+) \(joined\)", log)]
        return joins[-1] if joins and joins[-1] >= version else None

    def merged_since_rejoin(s: dict[str, Any]) -> list[int]:
        """Versions of merges after island-1's rejoin that hold its work. A push after the
        rejoin counts in the syncer's tally before the merge that holds it closes, so the wait
        is for the merge itself, not for the push count."""
        rec = s["islands"][island]
        if rec["state"] != "active" or rec["joins"] <= record["joins"]:
            return []
        joined = rejoin_version()
        if joined is None:
            return []
        return [
            m["version"]
            for m in s["merges"]
            if m["version"] > joined and island in {c["island"] for c in m["contributors"]}
        ]

    after = job.wait_syncer(
        f"{island} rejoined and its work merged again", lambda s: bool(merged_since_rejoin(s))
    )
    assert job.events("IslandReadded"), "the operator re-added the island"
    log = cp.kubectl("logs", log_of, "-n", job.ns).stdout
    joins = [int(v) for v in re.findall(r"took version (\d+) \(joined\)", log)]
    assert joins and joins[-1] >= version, (version, log[-3000:])  # the current, not version 0
    assert after["islands"][island]["pushes"] > record["pushes"], after["islands"][island]


def test_deleted_syncer_pod_resumes_from_checkpoint(job: JobRun) -> None:
    cp = job.cp
    pod = syncer_pod(cp, job.ns, job.name)
    assert pod is not None
    before = job.syncer()
    assert not before["finished"], "the job finished before the syncer could be deleted"
    cp.kubectl("delete", "pod", pod["metadata"]["name"], "-n", job.ns, "--wait=false")

    def new_syncer() -> dict[str, Any] | None:
        now = syncer_pod(cp, job.ns, job.name)
        return now if now and now["metadata"]["uid"] != pod["metadata"]["uid"] else None

    job.explained(lambda: poll_until(new_syncer, timeout=WAIT, what="a new syncer pod Ready"))
    resumed = job.syncer()
    assert resumed["resumedFrom"], resumed  # not a fresh start: the checkpoint survived the pod
    step = int(re.search(r"ckpt-(\d+)", resumed["resumedFrom"]).group(1))
    assert step >= before["checkpoint"]["outerStep"], (before["checkpoint"], resumed["resumedFrom"])
    pushes = {i: r["pushes"] for i, r in resumed["islands"].items()}
    job.wait_syncer(
        "both islands pushing to the new syncer",
        lambda s: (
            all(s["islands"][i]["pushes"] > n for i, n in pushes.items())
            and s["versions"][0] > resumed["versions"][0]
        ),
    )


def test_job_succeeds_final_weights_copied_out(job: JobRun, tmp_path: Path) -> None:
    cp = job.cp
    stop = job.syncer()["outerStep"] + MORE_STEPS
    patch = {"spec": {"stopAfter": {"outerSteps": stop}}}
    cp.kubectl("patch", "dj", job.name, "-n", job.ns, "--type=merge", "-p", json.dumps(patch))
    job.explained(
        lambda: poll_until(
            lambda: job.status().get("phase") == "Succeeded", timeout=WAIT, what="Succeeded"
        )
    )
    final = job.status()["finalCheckpoint"]
    # The new stopAfter reaches the syncer as a new pod (the spec's hash), which resumes from
    # its newest checkpoint: on a loaded node the old one may have checkpointed past `stop`
    # before it went (CI: stop 29, resumed at 30), and a job resumed past its stop ends there.
    resumed = job.syncer()["resumedFrom"]
    assert resumed, "the syncer resumed from no checkpoint"
    resumed_at = int(re.search(r"ckpt-(\d+)", resumed).group(1))
    assert final["outerStep"] == max(stop, resumed_at) and final["volume"] != "emptyDir", final
    on_volume = job.volume / final["path"]
    assert (on_volume / "weights.safetensors").is_file(), sorted(job.volume.rglob("*"))
    # The README's recipe: `diloco export` in the syncer pod, then `kubectl cp` it out.
    inside = f"/var/lib/diloco/{final['path']}"
    cp.kubectl(
        "exec", f"deploy/{JOB}-syncer", "-n", job.ns, "-c", "syncer", "--",
        "diloco", "export", inside, "-o", "/var/lib/diloco/model.safetensors",
    )  # fmt: skip
    pod = syncer_pod(cp, job.ns, job.name)
    assert pod is not None
    out = tmp_path / "model.safetensors"
    source = f"{job.ns}/{pod['metadata']['name']}:/var/lib/diloco/model.safetensors"
    cp.kubectl("cp", "-c", "syncer", source, str(out))
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        exported = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not iterable)
    # The file is the job's final global weights: the checkpoint on the volume, read here on
    # the node's side of the volume, tensor for tensor.
    assert meta["outerStep"] == str(final["outerStep"]) and meta["weights"] == "exact", meta
    expected = load_checkpoint(on_volume).weights
    assert sorted(exported) == sorted(expected)
    different = [k for k in expected if not torch.equal(exported[k], expected[k])]
    assert not different, different
    assert sum(t.numel() for t in exported.values()) > 100_000  # gpt-tiny: ~0.14M


def test_uninstall_and_job_deletion_leave_nothing(job: JobRun, release: Release) -> None:
    cp = job.cp
    release.uninstall()

    def release_objects() -> list[str]:
        kinds = "all,serviceaccounts,configmaps,secrets,roles,rolebindings"
        ns = ["-n", release.namespace, "-l", release.selector, "-o", "name"]
        names = cp.kubectl("get", kinds, *ns).stdout.split()
        cluster = ["clusterroles,clusterrolebindings", "-l", release.selector, "-o", "name"]
        return names + cp.kubectl("get", *cluster).stdout.split()

    # helm --wait waits for the Deployment, not its pod's graceful stop.
    poll_until(lambda: release_objects() == [], timeout=WAIT, what="no object of the release")
    # No finalizer on jobs: deleting one works with the operator gone; owner references take
    # its children with it (the garbage collector, not the operator).
    cp.kubectl("delete", "dj", job.name, "-n", job.ns, "--wait=true", "--timeout=120s")
    kinds = "pods,statefulsets,deployments,services,configmaps,secrets,networkpolicies"

    def remaining() -> list[str]:
        names = cp.kubectl("get", kinds, "-n", job.ns, "-o", "name").stdout.split()
        return [n for n in names if n != "configmap/kube-root-ca.crt"]

    job.explained(lambda: poll_until(lambda: remaining() == [], timeout=WAIT, what="no children"))
    # The claim and its hostPath volume are the test's own (kept: reclaim policy Retain).
    assert cp.kubectl("get", "pvc", "-n", job.ns, "-o", "name").stdout.split() != []
