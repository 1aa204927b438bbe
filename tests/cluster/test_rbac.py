"""Every rule of the chart's ClusterRole is needed: without it the operator fails at what it covers.

For each rule of the ClusterRole that `helm template` renders with default values, the operator
runs (a local process with the chart's Deployment arguments: cluster-wide, standalone) as a
ServiceAccount bound to that ClusterRole minus the rule. A job is applied, and the case waits until
the API server refused the operator a request on the rule's resources (the RBAC denial in its log)
and checks what the refusal left undone: no children, no status, no Events. A control case with
every rule shows the same job reconciled with no denial at all, so each failure is the rule's.

The operator posts Events only for what happens to a job (an island dropped, the job finished),
so the Events case (and the control) also runs a job against a real `diloco syncer` on loopback
and makes one of its islands unready: the operator drops it at the syncer and reports it.

A new rule in the chart fails `test_rbac_cases_cover_every_rendered_rule` until it gets a case here.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hack.localcluster.harness import ControlPlane

from .operator_helpers import Cluster, LocalSyncer, create_token_secret, job_manifest
from .region_helpers import ChartOperator, helm_for, one, operator_args, render_chart
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster

RELEASE = "rbac"
JOB = "rbac"
REMOTE = "remote"  # the job whose islands train against the loopback syncer
SERVICE_ACCOUNT = "operator"


def rule_id(rule: dict[str, Any]) -> str:
    """`groups/resources` of one rule, the core group spelled `core`."""
    groups = ",".join(g or "core" for g in rule["apiGroups"])
    return f"{groups}/{','.join(rule['resources'])}"


@dataclass(frozen=True)
class Chart:
    """The default rendering: the operator's ClusterRole rules and its Deployment arguments."""

    rules: list[dict[str, Any]]
    args: list[str]


@pytest.fixture(scope="module")
def chart(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Chart:
    docs = render_chart(
        helm_for(control_plane, tmp_path_factory.mktemp("helm")), RELEASE, "diloco-system", {}
    )
    role = one(docs, "ClusterRole", f"{RELEASE}-diloco-operator")
    return Chart(rules=role["rules"], args=operator_args(docs))


@dataclass
class Run:
    """One case: a namespace, the operator with a reduced role, and the job it was given."""

    cluster: Cluster
    operator: ChartOperator
    syncer: LocalSyncer

    def drop_island_of_remote_job(self) -> str:
        """Run job REMOTE against the syncer, then make its island's pod unready; its name."""
        ns = self.cluster.ns
        prefix = "r" + ns[-6:]  # islands of every case stay apart at the shared syncer
        create_token_secret(self.cluster.cp, ns, self.syncer.secret_name, self.syncer.token)
        syncer = {"endpoint": self.syncer.url, "tokenSecretName": self.syncer.secret_name}
        islands = {"count": 1, "replicas": 1, "namePrefix": prefix}
        self.cluster.apply(job_manifest(REMOTE, islands=islands, syncer=syncer))
        self.wait(
            lambda: self.cluster.status(REMOTE).get("phase") == "Running", "job REMOTE Running"
        )
        island = f"{prefix}-island-0"
        self.cluster.set_pod_ready(f"{REMOTE}-{island}-0", False)
        return island

    def refused(self, *resources: str) -> bool:
        """The operator's log shows the API server refusing it one of these resources."""
        return any(res in resources for _, res in self.operator.denials())

    def exists(self, kind: str, name: str) -> bool:
        return self.cluster.get(kind, name) is not None

    def status(self) -> dict[str, Any]:
        return self.cluster.status(JOB)

    def job_events(self, job: str) -> list[dict[str, Any]]:
        items = self.cluster.items("events")
        return [e for e in items if e["involvedObject"].get("name") == job]

    def wait(self, predicate: Callable[[], Any], what: str) -> None:
        try:
            wait_until(predicate, WAIT, message=what)
        except pytest.fail.Exception as err:
            pytest.fail(f"{err}\noperator log:\n{self.operator.log_text()[-4000:]}")


@pytest.fixture
def run_with_rules(
    control_plane: ControlPlane,
    chart: Chart,
    shared_syncer: LocalSyncer,
    namespace: str,
    crd: Path,
    tmp_path: Path,
) -> Iterator[Callable[[list[dict[str, Any]]], Run]]:
    """run_with_rules(rules) -> Run: the operator as a ServiceAccount holding exactly `rules`."""
    cp = control_plane
    role = f"rbac-test-{namespace}"
    started: list[ChartOperator] = []

    def start(rules: list[dict[str, Any]]) -> Run:
        cp.kubectl("create", "serviceaccount", SERVICE_ACCOUNT, "-n", namespace)
        cp.apply(
            [
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRole",
                    "metadata": {"name": role},
                    "rules": rules,
                },
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "ClusterRoleBinding",
                    "metadata": {"name": role},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": role,
                    },
                    "subjects": [
                        {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}
                    ],
                },
            ]
        )
        kubeconfig = cp.kubeconfig_for_sa(namespace, SERVICE_ACCOUNT, tmp_path / "sa.kubeconfig")
        op = ChartOperator(
            env={**cp.env_with_kubeconfig(kubeconfig), "PYTHONUNBUFFERED": "1"},
            namespace=namespace,
            log_file=tmp_path / "operator.log",
            args=chart.args,
        )
        started.append(op)
        op.start()
        cluster = Cluster(cp, namespace)
        # A job with its own syncer and a generated token: every kind of child.
        cluster.apply(job_manifest(JOB, islands={"count": 1, "replicas": 1}))
        return Run(cluster=cluster, operator=op, syncer=shared_syncer)

    yield start
    for op in started:
        op.stop(signal.SIGKILL)  # nothing to finish: the case is decided, and kopf stops slowly
    cp.kubectl("delete", "clusterrolebinding,clusterrole", role, "--ignore-not-found")
    # The job goes first so that no cluster-wide operator of a later case picks it up.
    cp.kubectl("delete", "dilocojobs", "--all", "-n", namespace, "--wait=false")


# ------------------------------------------------------------------------------ the cases
# What each rule covers, and how its absence shows. Children: ConfigMap JOB-config, Deployment and
# Service JOB-syncer, Service and StatefulSet JOB-island-0, NetworkPolicy JOB-network, Secrets
# JOB-token and JOB-island-tokens.


def _jobs_unseen(run: Run) -> None:
    run.wait(lambda: run.refused("dilocojobs"), "a refused list/watch of dilocojobs")
    assert not run.exists("configmap", f"{JOB}-config"), "reconciled a job it cannot see"
    assert not run.status()


def _status_unwritten(run: Run) -> None:
    run.wait(
        lambda: run.refused("dilocojobs/status") and run.exists("statefulset", f"{JOB}-island-0"),
        "children created and a refused status patch",
    )
    assert not run.status(), f"status written without the rule: {run.status()}"


def _workloads_missing(run: Run) -> None:
    # The reconcile lists the job's children of every kind first, so nothing gets created.
    run.wait(lambda: run.refused("statefulsets", "deployments"), "a refused StatefulSet/Deployment")
    assert not run.exists("statefulset", f"{JOB}-island-0")
    assert not run.exists("deployment", f"{JOB}-syncer")


def _services_and_config_missing(run: Run) -> None:
    run.wait(lambda: run.refused("services", "configmaps"), "a refused Service/ConfigMap")
    assert not run.exists("configmap", f"{JOB}-config")
    assert not run.exists("service", f"{JOB}-syncer")
    assert not run.exists("service", f"{JOB}-island-0")


def _network_policies_missing(run: Run) -> None:
    # The reconcile lists the job's children of every kind first, so nothing gets created.
    run.wait(lambda: run.refused("networkpolicies"), "a refused list/watch of networkpolicies")
    assert not run.exists("networkpolicy", f"{JOB}-network")
    assert not run.exists("statefulset", f"{JOB}-island-0")


def _token_missing(run: Run) -> None:
    run.wait(lambda: run.refused("secrets"), "a refused read of the token Secret")
    assert not run.exists("secret", f"{JOB}-token")
    # Without the token there is no job: the reconcile stops before any child.
    assert not run.exists("configmap", f"{JOB}-config")


def _health_unknown(run: Run) -> None:
    run.wait(
        lambda: run.refused("pods") and run.exists("statefulset", f"{JOB}-island-0"),
        "children created and a refused pod list",
    )
    assert not run.status(), "status written without seeing the pods"


def _events_missing(run: Run) -> None:
    island = run.drop_island_of_remote_job()
    run.wait(
        lambda: run.syncer.island_state(island) == "dropped" and run.refused("events"),
        "the island dropped at the syncer and its Event refused",
    )
    assert run.job_events(REMOTE) == []


def _crd_changes_unwatched(run: Run) -> None:
    # kopf watches CRDs to notice the DiLoCoJob CRD being installed or replaced while it runs;
    # refused, it says so and serves only the resources found at start.
    run.wait(lambda: run.refused("customresourcedefinitions"), "a refused list/watch of the CRDs")
    verbs = {verb for verb, res in run.operator.denials() if res == "customresourcedefinitions"}
    assert verbs <= {"list", "watch"}, verbs


CASES: dict[str, Callable[[Run], None]] = {
    "diloco.dev/dilocojobs": _jobs_unseen,
    "diloco.dev/dilocojobs/status": _status_unwritten,
    "apps/statefulsets,deployments": _workloads_missing,
    "core/services,configmaps": _services_and_config_missing,
    "networking.k8s.io/networkpolicies": _network_policies_missing,
    "core/secrets": _token_missing,
    "core/pods": _health_unknown,
    "core/events": _events_missing,
    "apiextensions.k8s.io/customresourcedefinitions": _crd_changes_unwatched,
}


def test_rbac_cases_cover_every_rendered_rule(chart: Chart) -> None:
    assert sorted(rule_id(r) for r in chart.rules) == sorted(CASES)


def test_rbac_full_role_reconciles_without_denials(
    chart: Chart, run_with_rules: Callable[[list[dict[str, Any]]], Run]
) -> None:
    run = run_with_rules(chart.rules)
    run.wait(lambda: run.status().get("phase"), "status written")
    island = run.drop_island_of_remote_job()
    run.wait(
        lambda: [e for e in run.job_events(REMOTE) if e["reason"] == "IslandDropped"],
        "an IslandDropped Event",
    )
    assert run.syncer.island_state(island) == "dropped"
    for kind, name in (
        ("configmap", f"{JOB}-config"),
        ("deployment", f"{JOB}-syncer"),
        ("service", f"{JOB}-syncer"),
        ("service", f"{JOB}-island-0"),
        ("statefulset", f"{JOB}-island-0"),
        ("secret", f"{JOB}-token"),
    ):
        assert run.exists(kind, name), f"{kind}/{name} missing"
    assert run.status()["islands"]["desired"] == 1
    assert run.operator.denials() == []


@pytest.mark.parametrize("removed", sorted(CASES))
def test_rbac_rule_removed_breaks_operator(
    removed: str, chart: Chart, run_with_rules: Callable[[list[dict[str, Any]]], Run]
) -> None:
    rules = [r for r in chart.rules if rule_id(r) != removed]
    assert len(rules) == len(chart.rules) - 1, f"no rule {removed} in the chart"
    run = run_with_rules(rules)
    CASES[removed](run)
    print(f"without {removed}: refused {sorted(set(run.operator.denials()))}")
