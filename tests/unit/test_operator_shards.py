"""The operator's children for syncer.shards (pure builders): one Deployment and Service per
shard named NAME-syncer-I, each selecting its shard's pods, told its shard and keeping its state in
its own directory; the learners' DILOCO_SYNCER_URL lists the shards' Services in shard order; one
syncer keeps today's names and pods exactly."""

from __future__ import annotations

from typing import Any

from diloco_operator import api, resources
from diloco_operator.resources import SHARD_LABEL, JobRef, NetworkOptions
from diloco_trainer.api import contract

JOB = JobRef(name="demo", namespace="ns1", uid="uid-1")


def _spec(**overrides: Any) -> api.DiLoCoJobSpec:
    data: dict[str, Any] = {"image": "trainer:1", "islands": {"count": 2}}
    data.update(overrides)
    return api.parse_job_spec(data)


def _sharded() -> api.DiLoCoJobSpec:
    return _spec(sync={"fragments": 4}, syncer={"shards": 2})


def _children(spec: api.DiLoCoJobSpec) -> dict[tuple[str, str], dict[str, Any]]:
    network = NetworkOptions(enabled=True, operator_labels={"app": "op"})
    children = resources.build_children(JOB, spec, islands_running=True, network=network)
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _syncer_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_one_syncer_keeps_todays_names_labels_and_environment() -> None:
    kids = _children(_spec())
    syncers = sorted(name for kind, name in kids if kind == "Deployment")
    assert syncers == ["demo-syncer"]
    deployment = kids[("Deployment", "demo-syncer")]
    assert SHARD_LABEL not in deployment["spec"]["selector"]["matchLabels"]
    container = _syncer_container(deployment)
    assert contract.SYNCER_SHARD not in _env(container)
    assert all("subPath" not in m for m in container["volumeMounts"])
    assert resources.syncer_url(JOB, _spec()) == "http://demo-syncer.ns1.svc:8470"


def test_shards_get_a_deployment_and_service_each() -> None:
    kids = _children(_sharded())
    assert {n for k, n in kids if k == "Deployment"} == {"demo-syncer-0", "demo-syncer-1"}
    syncer_services = {n for k, n in kids if k == "Service" and "syncer" in n}
    assert syncer_services == {"demo-syncer-0", "demo-syncer-1"}
    assert ("Deployment", "demo-syncer") not in kids
    for shard in (0, 1):
        name = f"demo-syncer-{shard}"
        deployment, service = kids[("Deployment", name)], kids[("Service", name)]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector[SHARD_LABEL] == str(shard)
        assert service["spec"]["selector"] == selector
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pod_labels[SHARD_LABEL] == str(shard)
        container = _syncer_container(deployment)
        assert _env(container)[contract.SYNCER_SHARD] == str(shard)
        (state,) = [m for m in container["volumeMounts"] if m["name"] == "state"]
        assert state["subPath"] == f"shard-{shard}"
        assert state["mountPath"] == contract.STATE_MOUNT


def test_child_keys_name_the_shards_in_build_order() -> None:
    spec = _sharded()
    network = NetworkOptions(enabled=True, operator_labels={"app": "op"})
    built = resources.build_children(JOB, spec, islands_running=True, network=network)
    keys = resources.child_keys(JOB, spec, network=network)
    assert keys == [(c["kind"], c["metadata"]["name"]) for c in built]


def test_learners_route_by_every_shards_service_url() -> None:
    kids = _children(_sharded())
    statefulset = kids[("StatefulSet", "demo-island-0")]
    (learner,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert _env(learner)[contract.SYNCER_URL] == (
        "http://demo-syncer-0.ns1.svc:8470,http://demo-syncer-1.ns1.svc:8470"
    )


def test_network_policy_lets_the_job_and_operator_reach_every_shard() -> None:
    kids = _children(_sharded())
    (policy,) = [c for (kind, _), c in kids.items() if kind == "NetworkPolicy"]
    # The policy selects every pod of the job (shards included) and lets the job's pods (any
    # port) and the operator (the syncer port) reach them.
    assert policy["spec"]["podSelector"] == {"matchLabels": {"diloco.dev/job": "demo"}}
    ports = [
        {p["port"] for p in rule.get("ports", [{"port": 8470}])}
        for rule in policy["spec"]["ingress"]
    ]
    assert all(8470 in p for p in ports)
    for shard in (0, 1):
        pod_labels = kids[("Deployment", f"demo-syncer-{shard}")]["spec"]["template"]["metadata"]
        assert pod_labels["labels"]["diloco.dev/job"] == "demo"
