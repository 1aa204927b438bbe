"""A job's security in a real cluster: credentials, name collisions, and an API server that stops
answering.

- An island's credential (from the operator's NAME-island-tokens Secret, mounted by that island's
  pods only) acts as that island only: it cannot call the operator's membership route nor join
  as another island, at a real `diloco syncer`; the operator itself reaches the syncer as admin.
- A region credential in the token Secret (another cluster of a multi-region job) lets the
  operator derive its islands' credentials and reach the syncer without the root token.
- Job `a` with islands.namePrefix `b` and job `a-b` want the same StatefulSet and Service names:
  the second is refused with a NameConflict condition and an Event, the first keeps its
  children, and once `a` is gone `a-b` gets its own.
- kube-apiserver stopped (SIGSTOP: it accepts connections and never answers) makes the
  operator's /readyz fail while /healthz stays up; after SIGCONT it is ready and reconciles again.
- The job's NetworkPolicy, as the API server stores it: exactly the job's pods (any port: DDP
  connects ranks on run-time ports) and the operator's pods (syncer port), plus anyone on the
  syncer port when the syncer's Service is a LoadBalancer; none when the job opts out. The local
  cluster has no CNI, so this checks the object; tests/node/test_network_policy.py checks its
  enforcement on the real node.

The TLS rules of the CRD are in test_operator_validation.py (refusals) and here (acceptances).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from diloco_trainer.api import credentials

from hack.localcluster.harness import ControlPlane
from hack.localcluster.processes import pid_matches

from .operator_helpers import Cluster, LocalSyncer, OperatorProcess, job_manifest
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster


def _call(url: str, method: str, token: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON answer) of one request to a syncer with `token`."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _condition(cluster: Cluster, job: str, kind: str) -> dict[str, Any]:
    conditions = cluster.status(job).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def _secret_data(cluster: Cluster, name: str) -> dict[str, str] | None:
    secret = cluster.get("secret", name)
    if secret is None:
        return None
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def _remote_job(name: str, make_local_syncer: Any, **spec: Any) -> tuple[dict, LocalSyncer]:
    """A job whose islands use a loopback syncer (its root token in the job's token Secret)."""
    manifest = job_manifest(name, **spec)
    syncer = make_local_syncer(manifest)
    manifest["spec"]["syncer"] = {"endpoint": syncer.url, "tokenSecretName": syncer.secret_name}
    return manifest, syncer


def test_security_island_credential_acts_only_as_its_island(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest, syncer = _remote_job("cred", make_local_syncer, islands={"count": 2, "replicas": 1})
    cluster.apply(manifest)
    tokens = wait_until(
        lambda: _secret_data(cluster, "cred-island-tokens"), WAIT, message="island credentials"
    )
    assert set(tokens) == {"island-0", "island-1"}
    for island, token in tokens.items():
        assert credentials.verify(syncer.token, token) == credentials.Principal("island", island)
    # Each island's pods mount its own key only, and no ServiceAccount token.
    # The island-token Secret is written before the children, so wait for the StatefulSet too.
    sts = wait_until(
        lambda: cluster.get("statefulset", "cred-island-0"), WAIT, message="island-0's StatefulSet"
    )
    spec = sts["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "token")
    assert volume["secret"]["secretName"] == "cred-island-tokens"
    assert volume["secret"]["items"] == [{"key": "island-0", "path": "token"}]
    assert spec["automountServiceAccountToken"] is False
    # The operator reaches the syncer with its own credential (admin, derived from the root).
    wait_until(
        lambda: _condition(cluster, "cred", "SyncerReachable").get("status") == "True",
        WAIT,
        message="the operator reads the syncer's status",
    )

    island0 = tokens["island-0"]
    base = syncer.url
    assert _call(base + "/v1/join", "POST", tokens["island-1"], {"island": "island-1"})[0] == 200
    drop = {"state": "dropped", "reason": "a learner tried"}
    code, doc = _call(base + "/v1/islands/island-1", "PUT", island0, drop)
    assert code == 403 and "membership" in doc["error"], doc
    code, doc = _call(base + "/v1/join", "POST", island0, {"island": "island-1"})
    assert code == 403 and "island-1" in doc["error"], doc
    assert syncer.island_state("island-1") == "active"  # untouched by the refusals
    assert _call(base + "/v1/join", "POST", island0, {"island": "island-0"})[0] == 200
    assert _call(base + "/v1/status", "GET", island0)[0] == 200
    # The same route with the admin credential works: the refusal was the credential's.
    admin = credentials.admin_token(syncer.token)
    assert _call(base + "/v1/islands/island-1", "PUT", admin, drop)[0] == 200
    assert syncer.island_state("island-1") == "dropped"


def test_security_region_credential_stands_in_for_the_root(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest = job_manifest("reg", islands={"count": 1, "replicas": 1, "namePrefix": "eu"})
    syncer = make_local_syncer(manifest)
    region = credentials.region_token(syncer.token, "eu")
    cluster.cp.kubectl(
        "create", "secret", "generic", "reg-region", "-n", cluster.ns,
        f"--from-literal=token={region}",
    )  # fmt: skip
    manifest["spec"]["syncer"] = {"endpoint": syncer.url, "tokenSecretName": "reg-region"}
    cluster.apply(manifest)
    tokens = wait_until(
        lambda: _secret_data(cluster, "reg-island-tokens"), WAIT, message="island credentials"
    )
    assert tokens == {"eu-island-0": credentials.island_token(syncer.token, "eu-island-0")}
    wait_until(
        lambda: _condition(cluster, "reg", "SyncerReachable").get("status") == "True",
        WAIT,
        message="the operator reaches the syncer with the region credential",
    )
    # The region credential may not act for another region's islands.
    code, _ = _call(syncer.url + "/v1/join", "POST", region, {"island": "island-0"})
    assert code == 403


def test_security_child_name_collision_is_refused_and_clears(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("a", islands={"count": 1, "namePrefix": "b"}))
    first = wait_until(
        lambda: cluster.get("statefulset", "a-b-island-0"), WAIT, message="job a's island"
    )
    owner_a = first["metadata"]["ownerReferences"][0]
    assert owner_a["name"] == "a"
    cluster.apply(job_manifest("a-b", islands={"count": 1}))
    conflict = wait_until(
        lambda: (c := _condition(cluster, "a-b", "NameConflict")).get("status") == "True" and c,
        WAIT,
        message="NameConflict on job a-b",
    )
    assert conflict["reason"] == "NameTaken"
    assert "StatefulSet a-b-island-0" in conflict["message"]
    assert "DiLoCoJob a" in conflict["message"]
    events = wait_until(lambda: cluster.events("NameConflict"), WAIT, message="NameConflict Event")
    assert any(e["involvedObject"]["name"] == "a-b" for e in events)
    sts = cluster.get("statefulset", "a-b-island-0")
    assert sts is not None and sts["metadata"]["ownerReferences"] == [owner_a]
    assert sts["metadata"]["labels"]["diloco.dev/job"] == "a"
    assert _condition(cluster, "a", "NameConflict").get("status") == "False"

    cluster.cp.kubectl("delete", "dilocojob", "a", "-n", cluster.ns, "--wait=false")
    mine = wait_until(
        lambda: (
            (s := cluster.get("statefulset", "a-b-island-0"))
            and s["metadata"]["ownerReferences"][0]["name"] == "a-b"
            and s
        ),
        WAIT,
        message="job a-b's own island once job a is gone",
    )
    assert mine["metadata"]["labels"]["diloco.dev/job"] == "a-b"
    wait_until(
        lambda: _condition(cluster, "a-b", "NameConflict").get("status") == "False",
        WAIT,
        message="NameConflict cleared",
    )


def _probe(operator: OperatorProcess, path: str) -> int:
    try:
        url = f"http://127.0.0.1:{operator.health_port}{path}"
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


@contextmanager
def stopped_apiserver(cp: ControlPlane) -> Iterator[None]:
    """The control plane's kube-apiserver stopped (SIGSTOP) for the block, then continued."""
    state = json.loads((cp.dir / "state.json").read_text())
    (record,) = [p for name, p in state["processes"].items() if "apiserver" in name]
    pid = int(record["pid"])
    assert pid_matches(pid, record["exe"], record.get("start")), "kube-apiserver is not running"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if pid_matches(pid, record["exe"], record.get("start")):
            os.kill(pid, signal.SIGCONT)


def test_security_silent_api_server_makes_operator_unready_then_it_recovers(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("bh", islands={"count": 1}))
    wait_until(lambda: cluster.get("statefulset", "bh-island-0"), WAIT, message="first island")
    wait_until(lambda: _probe(operator, "/readyz") == 200, WAIT, message="operator ready")
    with stopped_apiserver(cluster.cp):
        wait_until(lambda: _probe(operator, "/readyz") == 503, 90, message="operator not ready")
        assert _probe(operator, "/healthz") == 200 and operator.alive  # not hung, not dead
    wait_until(lambda: _probe(operator, "/readyz") == 200, WAIT, message="operator ready again")
    cluster.patch_spec("bh", {"islands": {"count": 2}})
    wait_until(
        lambda: cluster.get("statefulset", "bh-island-1"),
        WAIT,
        message="the recovered operator reconciles a change",
    )
    assert "diloco_operator_api_ready 1.0" in operator.metrics()


# Where the chart runs the operator and its pods' labels, as the chart passes them (options.py).
OPERATOR_NAMESPACE = "diloco-system"
OPERATOR_LABELS = {"app.kubernetes.io/name": "diloco-operator", "app.kubernetes.io/instance": "d"}


@pytest.fixture
def chart_operator(
    control_plane: ControlPlane, namespace: str, crd: Path, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """An operator started with the environment the chart gives it (its namespace and labels)."""
    env = {
        **control_plane.env,
        "PYTHONUNBUFFERED": "1",
        "DILOCO_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE,
        "DILOCO_OPERATOR_POD_LABELS": ",".join(f"{k}={v}" for k, v in OPERATOR_LABELS.items()),
    }
    op = OperatorProcess(env=env, namespace=namespace, log_file=tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()
    print("\n".join(op.log_text().splitlines()[-60:]))


def test_security_network_policy_admits_only_the_jobs_pods_and_the_operator(
    cluster: Cluster, chart_operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("np", islands={"count": 2}, syncer={"port": 9470}))
    lb_syncer = {"service": {"type": "LoadBalancer"}, "tls": {"secretName": "lb-tls"}}
    cluster.apply(job_manifest("lb", islands={"count": 1}, syncer=lb_syncer))
    cluster.apply(job_manifest("off", islands={"count": 1}, networkPolicy={"enabled": False}))
    policy = wait_until(lambda: cluster.get("networkpolicy", "np-network"), WAIT, message="np")
    own = {"podSelector": {"matchLabels": {"diloco.dev/job": "np"}}}
    operator_pods = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "diloco-system"}},
        "podSelector": {"matchLabels": OPERATOR_LABELS},
    }
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"diloco.dev/job": "np"}},  # the job's pods, all of them
        "policyTypes": ["Ingress"],
        "ingress": [
            # the job's own pods, any port: DDP connects ranks on ports chosen at run time
            {"from": [own]},
            {"from": [operator_pods], "ports": [{"protocol": "TCP", "port": 9470}]},
        ],
    }
    assert policy["metadata"]["ownerReferences"][0]["name"] == "np"

    exposed = wait_until(lambda: cluster.get("networkpolicy", "lb-network"), WAIT, message="lb")
    assert exposed["spec"]["podSelector"] == {"matchLabels": {"diloco.dev/job": "lb"}}
    assert exposed["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"diloco.dev/job": "lb"}}}]},
        {"from": [operator_pods], "ports": [{"protocol": "TCP", "port": 8470}]},
        # Other clusters' learners reach an exposed syncer (behind TLS and their credentials);
        # the DDP port stays closed to them.
        {"ports": [{"protocol": "TCP", "port": 8470}]},
    ]

    # The opted-out job gets its children but no policy.
    wait_until(lambda: cluster.get("statefulset", "off-island-0"), WAIT, message="off's island")
    assert cluster.names("networkpolicies") == {"np-network", "lb-network"}
