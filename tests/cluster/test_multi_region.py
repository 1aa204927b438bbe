"""Multi-region: two control planes on this machine stand for two regions, one job spanning both.

Region A runs the syncer; region B's job points its islands at it (spec.syncer.endpoint) with a
distinct island-name prefix and its own data shards. Both clusters get the chart (helm install)
and run the operator as the chart's ServiceAccount. kwok pods have no containers, so the syncer
and learners run as local processes started from the pod templates the operators wrote: their
environment read from the Deployment/StatefulSet, their mounted ConfigMap and Secrets copied into
local files, and only what cannot be local overridden (ports; region A's in-cluster syncer URL,
which no local resolver knows, becomes the loopback address). The syncer serves HTTPS with a
self-signed certificate, and every client verifies it with the CA from a Secret.

The jobs are examples/multi-region/region-{a,b}.yaml with tiny training settings, so the
walk-through's wiring is what runs here; a second test keeps the example manifests valid.
"""

from __future__ import annotations

import json
import secrets
import ssl
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.api import parse_job_spec
from diloco_trainer.api import contract
from diloco_trainer.local import Proc, free_port, wait_ready

from hack.localcluster.harness import TINY_TRAINING, ControlPlane

from .operator_helpers import Cluster, create_token_secret, deep_merge
from .region_helpers import ChartOperator, LocalPod, self_signed_tls, workload_template
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "multi-region"
# The extra control plane test_control_plane.py starts too: one start per session serves both.
REGION_B_CLUSTER = "second"
POD_INDEX = "apps.kubernetes.io/pod-index"


def example(name: str) -> dict[str, Any]:
    """An example manifest, parsed."""
    return yaml.safe_load((EXAMPLES / name).read_text())


def tiny(manifest: dict[str, Any], islands: dict[str, Any]) -> dict[str, Any]:
    """The example with tiny training settings (gpt-tiny, a few inner steps) and these islands.

    Both regions use the same model/data/inner settings, as the walk-through requires. The grace
    window is long enough for both regions' pushes to land in one merge once both have joined
    (a round closes as soon as every active island has pushed).
    """
    spec = deep_merge(
        manifest["spec"],
        {
            **TINY_TRAINING,
            "image": "diloco-trainer:test",
            "islands": {**islands, "resources": {}},
            "sync": {**TINY_TRAINING["sync"], "graceSeconds": "20"},
            "syncer": {"resources": {}},
        },
    )
    spec["stopAfter"] = {}  # run until the test stops it: when region B joins is not knowable
    return {**manifest, "spec": spec}


def _start_learner(
    cluster: Cluster, job: str, island: str, workdir: Path, overrides: dict[str, str]
) -> Proc:
    """Rank 0 of island `island` from its StatefulSet's pod template."""
    sts = f"{job}-{island}"
    pod = LocalPod.from_template(
        cluster.cp,
        cluster.ns,
        workload_template(cluster.cp, cluster.ns, "statefulset", sts),
        "learner",
        workdir / island,
        pod_name=f"{sts}-0",
        pod_labels={POD_INDEX: "0"},
    )
    # No cluster DNS here: rank 0 is its own master (world size 1).
    local = {contract.MASTER_ADDR: "127.0.0.1", contract.MASTER_PORT: str(free_port())}
    return pod.start(island, workdir / f"{island}.log", {**local, **overrides})


def test_multi_region_islands_of_two_clusters_train_with_one_syncer(
    control_plane: ControlPlane,
    make_control_plane: Callable[[str], ControlPlane],
    chart_operator_in: Callable[[ControlPlane, str], ChartOperator],
    tmp_path: Path,
) -> None:
    procs: list[Proc] = []
    namespaces: list[tuple[ControlPlane, str]] = []
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            # Region B's control plane starts while region A is set up (minutes saved, not logic).
            cp_b = pool.submit(make_control_plane, REGION_B_CLUSTER)
            _run_two_regions(control_plane, cp_b, chart_operator_in, procs, namespaces, tmp_path)
    finally:
        for proc in reversed(procs):
            proc.stop()
        for cp, ns in namespaces:
            cp.kubectl("delete", "dilocojobs", "--all", "-n", ns, "--wait=false", check=False)
            cp.delete_namespace(ns)


def _run_two_regions(
    cp_a: ControlPlane,
    cp_b_future: Future[ControlPlane],
    chart_operator_in: Callable[[ControlPlane, str], ChartOperator],
    procs: list[Proc],
    namespaces: list[tuple[ControlPlane, str]],
    tmp_path: Path,
) -> None:
    job_a = tiny(example("region-a.yaml"), {"count": 1, "totalShards": 2})
    job_b = tiny(example("region-b.yaml"), {"count": 1, "shardOffset": 1, "totalShards": 2})
    name = job_a["metadata"]["name"]
    assert job_b["metadata"]["name"] == name
    spec_a, spec_b = job_a["spec"], job_b["spec"]
    t0 = time.monotonic()

    def mark(what: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {what}")

    region_a = Cluster(cp_a, cp_a.create_namespace("region-a"))
    namespaces.append((cp_a, region_a.ns))
    operators = [chart_operator_in(cp_a, region_a.ns)]
    mark("region A: chart installed, operator running")

    # Region A: token and TLS Secrets as the README creates them, then the job.
    token = secrets.token_urlsafe(32)
    tls = self_signed_tls(
        tmp_path / "tls", ips=["127.0.0.1"], dns=[f"{name}-syncer.{region_a.ns}.svc"]
    )
    create_token_secret(cp_a, region_a.ns, spec_a["syncer"]["tokenSecretName"], token)
    tls.create_secrets(cp_a, region_a.ns, tls=spec_a["syncer"]["tls"]["secretName"])
    region_a.apply(job_a)
    service = wait_until(
        lambda: (
            region_a.get("deployment", f"{name}-syncer")
            and region_a.get("service", f"{name}-syncer")
        ),
        WAIT,
        message="region A's syncer Deployment and Service",
    )
    assert service["spec"]["type"] == "LoadBalancer"

    # The syncer from its Deployment's pod template; only its port is made local.
    syncer_pod = LocalPod.from_template(
        cp_a,
        region_a.ns,
        workload_template(cp_a, region_a.ns, "deployment", f"{name}-syncer"),
        "syncer",
        tmp_path / "syncer",
        pod_name=f"{name}-syncer",
    )
    assert syncer_pod.env[contract.TLS_CERT_FILE].startswith(str(tmp_path))
    port = free_port()
    syncer = syncer_pod.start("syncer", tmp_path / "syncer.log", {contract.SYNCER_PORT: str(port)})
    procs.append(syncer)
    url = f"https://127.0.0.1:{port}"
    # Learners retry until the syncer answers, so nothing waits for it to be ready yet.

    # Region B: the chart, the same token, the CA, and the job pointing at region A's syncer.
    cp_b = cp_b_future.result()
    region_b = Cluster(cp_b, cp_b.create_namespace("region-b"))
    namespaces.append((cp_b, region_b.ns))
    operators.append(chart_operator_in(cp_b, region_b.ns))
    mark("region B: control plane up, chart installed, operator running")
    create_token_secret(cp_b, region_b.ns, spec_b["syncer"]["tokenSecretName"], token)
    tls.create_secrets(cp_b, region_b.ns, ca=spec_b["syncer"]["tls"]["caSecretName"])
    job_b["spec"]["syncer"]["endpoint"] = url
    region_b.apply(job_b)
    wait_until(
        lambda: region_b.get("statefulset", f"{name}-eu-island-0"),
        WAIT,
        message="region B's island",
    )
    assert region_b.get("deployment", f"{name}-syncer") is None  # no syncer in region B

    # One learner per region from its StatefulSet; region A's names the in-cluster Service,
    # which only cluster DNS resolves, so it dials the same syncer on loopback instead.
    workdir = tmp_path / "learners"
    procs.append(_start_learner(region_a, name, "island-0", workdir, {contract.SYNCER_URL: url}))
    procs.append(_start_learner(region_b, name, "eu-island-0", workdir, {}))
    mark("learners started")
    wait_ready(url, token, timeout=WAIT, proc=syncer, ca_file=tls.cert)
    mark("region A's syncer ready")

    def status() -> dict[str, Any]:
        return syncer_status(url, token, tls.cert)

    def merged_together() -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(the first merge of both regions, the islands of the same status read), or None."""
        doc = status()
        for merge in doc.get("merges") or []:
            if {c["island"] for c in merge["contributors"]} == {"island-0", "eu-island-0"}:
                return merge, doc["islands"]
        return None

    def alive() -> bool:
        dead = [p for p in procs if not p.alive]
        assert not dead, "\n".join(f"{p.name} exited:\n{p.log_text()[-3000:]}" for p in dead)
        return True

    merge, islands = wait_until(
        lambda: alive() and merged_together(),
        420,
        interval=1.0,
        message="a merge with contributors from both regions",
    )
    mark("merge of both regions")
    assert islands["island-0"]["state"] == islands["eu-island-0"]["state"] == "active"
    print(f"merge of both regions at outer step {merge['outerStep']}: {merge['contributors']}")

    # Region B's job reports its islands and the outer step, read from the remote syncer.
    def b_reports() -> dict[str, Any] | None:
        st = region_b.status(name)
        entries = {i["name"]: i for i in st.get("islandStatuses") or []}
        eu = entries.get("eu-island-0") or {}
        ok = (st.get("outerStep") or 0) >= merge["outerStep"] and eu.get("inQuorum")
        return st if ok else None

    st_b = wait_until(
        b_reports, 2 * WAIT, message="region B's status with its island and outer step"
    )
    mark("region B's status shows its island and the outer step")
    assert [i["name"] for i in st_b["islandStatuses"]] == ["eu-island-0"]
    assert st_b["phase"] == "Running" and st_b["islands"]["ready"] == 1
    assert st_b["islandStatuses"][0]["state"] == "active" and st_b["islandStatuses"][0]["lastPush"]
    # Each region trained its own shard of the two.
    logs = {p.name: p.log_text() for p in procs}
    assert "shard 0 of 2" in logs["island-0"] and "shard 1 of 2" in logs["eu-island-0"]
    for op in operators:
        assert op.denials() == []


def syncer_status(url: str, token: str, ca_file: Path) -> dict[str, Any]:
    """GET /v1/status over HTTPS, verified with the CA."""
    request = urllib.request.Request(
        url + "/v1/status", headers={"Authorization": f"Bearer {token}"}
    )
    context = ssl.create_default_context(cafile=str(ca_file))
    with urllib.request.urlopen(request, timeout=10, context=context) as resp:
        return json.loads(resp.read())


def test_multi_region_example_manifests_are_accepted(cluster_for_examples: Cluster) -> None:
    """region-a.yaml and region-b.yaml as shipped: the API model and the API server accept them."""
    for name in ("region-a.yaml", "region-b.yaml"):
        manifest = example(name)
        spec = parse_job_spec(manifest["spec"])
        assert spec.syncer.token_secret_name == "diloco-token"
        out = cluster_for_examples.cp.kubectl(
            "apply", "--dry-run=server", "-n", cluster_for_examples.ns,
            "-f", str(EXAMPLES / name),
        )  # fmt: skip
        assert "created (server dry run)" in out.stdout, out.stdout
    a = parse_job_spec(example("region-a.yaml")["spec"])
    b = parse_job_spec(example("region-b.yaml")["spec"])
    assert a.syncer.service.type == "LoadBalancer" and a.syncer.tls.secret_name
    assert b.syncer.endpoint and b.syncer.tls.ca_secret_name and b.islands.name_prefix
    # Shards of the two regions tile 0..totalShards-1 without overlap.
    shards_a = range(a.islands.shard_offset, a.islands.shard_offset + a.islands.count)
    shards_b = range(b.islands.shard_offset, b.islands.shard_offset + b.islands.count)
    assert sorted([*shards_a, *shards_b]) == list(range(a.total_shards()))
    assert a.total_shards() == b.total_shards()
    # What learners of both regions depend on is the same.
    for field in ("model", "data", "inner"):
        assert getattr(a, field) == getattr(b, field), field
    for field in ("fragments", "overlap_steps", "compression", "mix_alpha", "error_feedback"):
        assert getattr(a.sync, field) == getattr(b.sync, field), field


@pytest.fixture
def cluster_for_examples(control_plane: ControlPlane, namespace: str, crd: Path) -> Cluster:
    return Cluster(control_plane, namespace)
