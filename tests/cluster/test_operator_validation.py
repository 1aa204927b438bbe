"""Bad DiLoCoJob manifests are refused by the API server itself, naming the field.

Only the CRD is needed (no operator): the schema's types, ranges, enums and CEL rules do the work,
and real kubectl applies the manifests with its default strict field validation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .operator_helpers import Cluster, job_manifest

pytestmark = pytest.mark.cluster


def _apply(cluster: Cluster, manifest: dict[str, Any]) -> tuple[int, str]:
    result = cluster.cp.kubectl(
        "apply", "-n", cluster.ns, "-f", "-", input=json.dumps(manifest), check=False
    )
    return result.returncode, result.stderr + result.stdout


def _without_image(name: str) -> dict[str, Any]:
    manifest = job_manifest(name)
    del manifest["spec"]["image"]
    return manifest


CASES: dict[str, tuple[dict[str, Any], str]] = {
    "quorum-above-islands": (
        job_manifest("bad", islands={"count": 2}, sync={"quorum": 3}),
        "spec.sync.quorum",
    ),
    "islands-count-zero": (job_manifest("bad", islands={"count": 0}), "spec.islands.count"),
    "inner-lr-zero": (job_manifest("bad", inner={"lr": 0}), "spec.inner.lr"),
    "inner-lr-negative": (job_manifest("bad", inner={"lr": -0.1}), "spec.inner.lr"),
    "outer-lr-zero": (job_manifest("bad", outer={"lr": 0}), "spec.outer.lr"),
    "unknown-compression": (
        job_manifest("bad", sync={"compression": "zip"}),
        "spec.sync.compression",
    ),
    "missing-image": (_without_image("bad"), "spec.image"),
    "unknown-field-under-spec": (job_manifest("bad", learningRate=1), "spec.learningRate"),
    "unknown-nested-field": (job_manifest("bad", inner={"lrr": 1}), "spec.inner.lrr"),
    "grace-seconds-word": (
        job_manifest("bad", sync={"graceSeconds": "soon"}),
        "spec.sync.graceSeconds",
    ),
    "grace-seconds-negative": (
        job_manifest("bad", sync={"graceSeconds": -1}),
        "spec.sync.graceSeconds",
    ),
    "remote-syncer-with-checkpoint-claim": (
        job_manifest("bad", syncer={"endpoint": "https://s:1", "checkpoint": {"claimName": "c"}}),
        "spec.syncer.checkpoint.claimName",
    ),
    "remote-syncer-with-service-type": (
        job_manifest("bad", syncer={"endpoint": "https://s:1", "service": {"type": "NodePort"}}),
        "spec.syncer.service.type",
    ),
    "remote-syncer-with-tls-secret": (
        job_manifest("bad", syncer={"endpoint": "https://s:1", "tls": {"secretName": "t"}}),
        "spec.syncer.tls.secretName",
    ),
    "endpoint-not-a-url": (
        job_manifest("bad", syncer={"endpoint": "syncer:8470"}),
        "spec.syncer.endpoint",
    ),
    # TLS wherever the credentials would leave the cluster (api/exposure.py).
    "loadbalancer-without-tls": (
        job_manifest("bad", syncer={"service": {"type": "LoadBalancer"}}),
        "spec.syncer.service.type",
    ),
    "nodeport-without-tls": (
        job_manifest("bad", syncer={"service": {"type": "NodePort"}}),
        "spec.syncer.service.type",
    ),
    "remote-http-endpoint": (
        job_manifest("bad", syncer={"endpoint": "http://syncer.example.com:8470"}),
        "spec.syncer.endpoint",
    ),
    "endpoint-with-a-path": (
        job_manifest("bad", syncer={"endpoint": "https://syncer.example.com/admin?x="}),
        "spec.syncer.endpoint",
    ),
    "endpoint-with-user-info": (
        job_manifest("bad", syncer={"endpoint": "https://u:p@syncer.example.com"}),
        "spec.syncer.endpoint",
    ),
    "name-too-long-for-statefulsets": (job_manifest("a" * 42), "metadata.name"),
    "name-starting-with-digit": (job_manifest("1job"), "metadata.name"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_validation_refuses_bad_manifest(cluster: Cluster, case: str) -> None:
    manifest, field = CASES[case]
    code, output = _apply(cluster, manifest)
    assert code != 0, f"{case}: the API server accepted it:\n{output}"
    assert field in output, f"{case}: {field} not named in:\n{output}"
    assert not cluster.items("dilocojobs")


def test_operator_validation_accepts_and_defaults_minimal_manifest(cluster: Cluster) -> None:
    manifest = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": "minimal"},
        "spec": {"image": "trainer:1", "sync": {"graceSeconds": "2.5"}},
    }
    code, output = _apply(cluster, manifest)
    assert code == 0, output
    spec = cluster.job("minimal")["spec"]
    # Nested defaults from the pydantic models, applied by the API server.
    assert spec["islands"]["count"] == 2 and spec["islands"]["replicas"] == 1
    assert spec["inner"]["lr"] == pytest.approx(4e-4)
    assert spec["syncer"]["port"] == 8470 and spec["syncer"]["service"]["type"] == "ClusterIP"
    assert spec["sync"]["graceSeconds"] == "2.5" and spec["sync"]["compression"] == "int8"
    assert spec["islands"]["template"] == {} and spec["suspend"] is False


def test_operator_validation_remote_quorum_may_exceed_local_islands(cluster: Cluster) -> None:
    manifest = job_manifest(
        "remote", islands={"count": 1}, sync={"quorum": 3}, syncer={"endpoint": "https://s:443"}
    )
    code, output = _apply(cluster, manifest)
    assert code == 0, output


def test_operator_validation_kubectl_explain_shows_descriptions(cluster: Cluster) -> None:
    out = cluster.cp.kubectl("explain", "dilocojob.spec.sync.quorum").stdout
    assert "islands whose pseudo-gradients open a merge" in out
    out = cluster.cp.kubectl("explain", "dj.spec.islands").stdout
    assert "namePrefix" in out and "The M islands of compute" in out


@pytest.mark.parametrize(
    "syncer",
    [
        {"service": {"type": "LoadBalancer"}, "tls": {"secretName": "syncer-tls"}},
        {"service": {"type": "NodePort"}, "tls": {"secretName": "syncer-tls"}},
        {"endpoint": "https://syncer.example.com:8470"},
        {"endpoint": "http://127.0.0.1:8470"},
        {"endpoint": "http://other-syncer.team-a.svc.cluster.local:8470"},
        {"endpoint": "http://10.0.0.7:8470", "tls": {"allowInsecureEndpoint": True}},
    ],
    ids=["lb-tls", "nodeport-tls", "https", "loopback", "cluster-service", "explicitly-insecure"],
)
def test_operator_validation_accepts_tls_internal_or_explicitly_insecure_syncers(
    cluster: Cluster, syncer: dict[str, Any]
) -> None:
    code, output = _apply(cluster, job_manifest("ok", syncer=syncer))
    assert code == 0, output
