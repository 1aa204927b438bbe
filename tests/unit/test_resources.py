"""Pure child builders and the reconcile planner: no cluster needed."""

from __future__ import annotations

import copy
from typing import Any

from diloco_operator import api, resources
from diloco_operator.planner import plan_changes, statefulset_in_flight
from diloco_operator.resources import JobRef
from diloco_trainer.api import contract

JOB = JobRef(name="demo", namespace="ns1", uid="uid-1")


def _spec(**overrides: Any) -> api.DiLoCoJobSpec:
    data: dict[str, Any] = {"image": "trainer:1", "islands": {"count": 3, "replicas": 2}}
    for key, value in overrides.items():
        data[key] = value
    return api.parse_job_spec(data)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _children(spec: api.DiLoCoJobSpec, running: bool = True) -> dict[tuple[str, str], dict]:
    return {
        (c["kind"], c["metadata"]["name"]): c
        for c in resources.build_children(JOB, spec, islands_running=running)
    }


def test_build_children_names_and_kinds() -> None:
    kids = _children(_spec())
    assert set(kids) == {
        ("ConfigMap", "demo-config"),
        ("Deployment", "demo-syncer"),
        ("Service", "demo-syncer"),
        *[("StatefulSet", f"demo-island-{i}") for i in range(3)],
        *[("Service", f"demo-island-{i}") for i in range(3)],
    }


def test_build_children_owner_refs_and_labels() -> None:
    for child in _children(_spec()).values():
        meta = child["metadata"]
        assert meta["namespace"] == "ns1"
        (ref,) = meta["ownerReferences"]
        assert ref == {
            "apiVersion": "diloco.dev/v1alpha1",
            "kind": "DiLoCoJob",
            "name": "demo",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
        for label in ("name", "instance", "component", "managed-by", "part-of"):
            assert meta["labels"][f"app.kubernetes.io/{label}"], label
        assert meta["labels"]["diloco.dev/job"] == "demo"
        assert resources.SPEC_HASH in meta["annotations"]


def test_build_island_statefulset_env_contract() -> None:
    spec = _spec(islands={"count": 3, "replicas": 2, "shardOffset": 4})
    sts = resources.build_island_statefulset(JOB, spec, 1)
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "demo-island-1"
    assert sts["metadata"]["labels"]["diloco.dev/island"] == "island-1"
    pod = sts["spec"]["template"]
    assert pod["metadata"]["labels"]["diloco.dev/island"] == "island-1"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["diloco", "learner"] and container["image"] == "trainer:1"
    env = _env(container)
    assert env[contract.JOB_NAME] == "demo"
    assert env[contract.ISLAND] == "island-1"
    assert env[contract.ISLAND_INDEX] == "5"
    assert env[contract.RANK] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    assert env[contract.WORLD_SIZE] == "2"
    assert env[contract.MASTER_ADDR] == "demo-island-1-0.demo-island-1"
    assert env[contract.MASTER_PORT] == str(contract.DEFAULT_MASTER_PORT)
    assert env[contract.SYNCER_URL] == "http://demo-syncer.ns1.svc:8470"
    assert env[contract.TOKEN_FILE] == f"{contract.TOKEN_MOUNT}/{contract.TOKEN_KEY}"
    assert env[contract.CONFIG_FILE] == f"{contract.CONFIG_MOUNT}/{contract.CONFIG_KEY}"
    assert contract.CA_FILE not in env
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {contract.CONFIG_MOUNT, contract.TOKEN_MOUNT, contract.STATE_MOUNT} <= mounts
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["token"]["secret"]["secretName"] == "demo-token"
    assert volumes["config"]["configMap"]["name"] == "demo-config"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_build_island_statefulset_name_prefix_and_suspend() -> None:
    spec = _spec(islands={"count": 2, "namePrefix": "eu"})
    sts = resources.build_island_statefulset(JOB, spec, 1, running=False)
    assert sts["metadata"]["name"] == "demo-eu-island-1"
    assert sts["spec"]["replicas"] == 0
    assert _env(sts["spec"]["template"]["spec"]["containers"][0])[contract.ISLAND] == "eu-island-1"


def test_build_island_service_is_headless() -> None:
    svc = resources.build_island_service(JOB, _spec(), 2)
    assert svc["metadata"]["name"] == "demo-island-2"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {"diloco.dev/job": "demo", "diloco.dev/island": "island-2"}


def test_build_syncer_deployment_probes_and_checkpoint() -> None:
    spec = _spec(syncer={"port": 9000, "checkpoint": {"claimName": "ckpt"}})
    dep = resources.build_syncer_deployment(JOB, spec)
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["diloco", "syncer"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert _env(container)[contract.SYNCER_PORT] == "9000"
    # The probes go to the syncer's probe listener, the port after the syncer port, which the
    # pod declares by the name the probes use (issue 46: a flood cannot queue them).
    assert _env(container)[contract.SYNCER_HEALTH_PORT] == "9001"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 9000, "probes": 9001}
    for kind in ("readinessProbe", "startupProbe", "livenessProbe"):
        assert container[kind]["httpGet"]["port"] == "probes"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"] == {"name": "state", "persistentVolumeClaim": {"claimName": "ckpt"}}
    svc = resources.build_syncer_service(JOB, spec)
    assert svc["spec"]["ports"][0]["port"] == 9000 and svc["spec"]["type"] == "ClusterIP"


def test_build_children_tls_wires_https_and_ca() -> None:
    spec = _spec(syncer={"tls": {"secretName": "syncer-tls"}, "service": {"type": "LoadBalancer"}})
    kids = _children(spec)
    learner = kids[("StatefulSet", "demo-island-0")]["spec"]["template"]["spec"]
    env = _env(learner["containers"][0])
    assert env[contract.SYNCER_URL].startswith("https://demo-syncer.ns1.svc:")
    assert env[contract.CA_FILE] == f"{contract.CA_MOUNT}/ca.crt"
    syncer = kids[("Deployment", "demo-syncer")]["spec"]["template"]["spec"]["containers"][0]
    assert _env(syncer)[contract.TLS_CERT_FILE].endswith("tls.crt")
    assert syncer["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert kids[("Service", "demo-syncer")]["spec"]["type"] == "LoadBalancer"


def test_build_children_remote_endpoint_skips_syncer() -> None:
    spec = _spec(
        syncer={"endpoint": "https://syncer.example:443/", "tokenSecretName": "shared"},
        sync={"quorum": 5},
    )
    kids = _children(spec)
    assert ("Deployment", "demo-syncer") not in kids and ("Service", "demo-syncer") not in kids
    pod = kids[("StatefulSet", "demo-island-0")]["spec"]["template"]["spec"]
    assert _env(pod["containers"][0])[contract.SYNCER_URL] == "https://syncer.example:443"
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The shared Secret holds the job's credential: learners mount only their island's own.
    assert volumes["token"]["secret"] == {
        "secretName": "demo-island-tokens",
        "items": [{"key": "island-0", "path": contract.TOKEN_KEY}],
    }


def test_build_config_map_holds_spec_json() -> None:
    spec = _spec()
    cm = resources.build_config_map(JOB, spec)
    assert cm["data"][contract.CONFIG_KEY] == spec.to_json()


def test_build_token_secret() -> None:
    secret = resources.build_token_secret(JOB, "s3cret")
    assert secret["metadata"]["name"] == "demo-token"
    assert secret["stringData"] == {contract.TOKEN_KEY: "s3cret"}


def test_build_island_statefulset_template_overrides_merge() -> None:
    spec = _spec(
        islands={
            "count": 1,
            "template": {
                "metadata": {"labels": {"team": "ml", "diloco.dev/job": "hijack"}},
                "spec": {
                    "nodeSelector": {"gpu": "h100"},
                    "containers": [{"name": "learner", "env": [{"name": "EXTRA", "value": "1"}]}],
                },
            },
        }
    )
    pod = resources.build_island_statefulset(JOB, spec, 0)["spec"]["template"]
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["labels"]["diloco.dev/job"] == "demo"  # selector labels win
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    (container,) = pod["spec"]["containers"]
    env = _env(container)
    assert env["EXTRA"] == "1" and env[contract.ISLAND] == "island-0"


def test_build_island_statefulset_count_and_suspend_do_not_touch_pod_template() -> None:
    base = resources.build_island_statefulset(JOB, _spec(), 0)
    for other in (
        _spec(islands={"count": 5, "replicas": 2}, sync={"quorum": 4}),
        _spec(suspend=True),
        _spec(stopAfter={"outerSteps": 3}, outer={"lr": 0.5}, ttlSecondsAfterFinished=10),
    ):
        assert (
            resources.build_island_statefulset(JOB, other, 0)["spec"]["template"]
            == (base["spec"]["template"])
        )


def test_build_island_statefulset_learner_fields_change_pod_template() -> None:
    base = resources.build_island_statefulset(JOB, _spec(), 0)
    for other in (
        _spec(inner={"lr": 0.01}),
        _spec(image="trainer:2"),
        _spec(islands={"count": 3, "replicas": 2, "resources": {"limits": {"cpu": "1"}}}),
    ):
        changed = resources.build_island_statefulset(JOB, other, 0)
        assert (
            changed["metadata"]["annotations"][resources.TEMPLATE_HASH]
            != base["metadata"]["annotations"][resources.TEMPLATE_HASH]
        )


def test_syncer_config_hash_ignores_island_count() -> None:
    a = resources.syncer_config_hash(_spec())
    assert a == resources.syncer_config_hash(_spec(islands={"count": 7}))
    assert a != resources.syncer_config_hash(_spec(outer={"lr": 0.1}))


# --- planner -------------------------------------------------------------------------------


def _observed(obj: dict[str, Any], *, ready: bool = True, rev: str = "r1") -> dict[str, Any]:
    """What the API would return for a created child (status filled for StatefulSets)."""
    have = copy.deepcopy(obj)
    have["metadata"]["generation"] = 1
    if obj["kind"] == "StatefulSet":
        n = obj["spec"]["replicas"]
        have["status"] = {
            "observedGeneration": 1,
            "replicas": n,
            "readyReplicas": n if ready else 0,
            "updatedReplicas": n,
            "currentRevision": rev,
            "updateRevision": rev,
        }
    return have


def test_plan_changes_creates_everything_then_nothing() -> None:
    desired = resources.build_children(JOB, _spec(), islands_running=True)
    first = plan_changes(desired, [], job_uid=JOB.uid)
    assert len(first.apply) == len(desired) and not first.delete
    second = plan_changes(desired, [_observed(d) for d in desired], job_uid=JOB.uid)
    assert second.empty and not second.rolling


def test_plan_changes_recreates_deleted_child() -> None:
    desired = resources.build_children(JOB, _spec(), islands_running=True)
    observed = [_observed(d) for d in desired if d["metadata"]["name"] != "demo-island-1"]
    plan = plan_changes(desired, observed, job_uid=JOB.uid)
    assert {(c["kind"], c["metadata"]["name"]) for c in plan.apply} == {
        ("StatefulSet", "demo-island-1"),
        ("Service", "demo-island-1"),
    }


def test_plan_changes_scale_down_deletes_extra_islands_only() -> None:
    before = resources.build_children(JOB, _spec(), islands_running=True)
    after = resources.build_children(
        JOB, _spec(islands={"count": 1, "replicas": 2}), islands_running=True
    )
    plan = plan_changes(after, [_observed(d) for d in before], job_uid=JOB.uid)
    assert plan.delete == [
        ("Service", "demo-island-1"),
        ("Service", "demo-island-2"),
        ("StatefulSet", "demo-island-1"),
        ("StatefulSet", "demo-island-2"),
    ]
    # Only the ConfigMap changes (count is in the spec JSON); island 0 is untouched.
    assert [(c["kind"], c["metadata"]["name"]) for c in plan.apply] == [
        ("ConfigMap", "demo-config")
    ]


def test_plan_changes_ignores_objects_of_other_owners() -> None:
    desired = resources.build_children(JOB, _spec(), islands_running=True)
    stranger = _observed(resources.build_island_service(JobRef("demo", "ns1", "uid-2"), _spec(), 9))
    plan = plan_changes(desired, [*map(_observed, desired), stranger], job_uid=JOB.uid)
    assert plan.empty


def test_plan_changes_rolls_one_island_at_a_time() -> None:
    old = resources.build_children(JOB, _spec(), islands_running=True)
    new = resources.build_children(JOB, _spec(image="trainer:2"), islands_running=True)
    observed = [_observed(d) for d in old]
    plan = plan_changes(new, observed, job_uid=JOB.uid)
    rolled = [c["metadata"]["name"] for c in plan.apply if c["kind"] == "StatefulSet"]
    assert rolled == ["demo-island-0"]
    assert plan.waiting == ["demo-island-1", "demo-island-2"]
    # Island 0 updated but its new pods are not Ready yet: the others keep waiting.
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in observed}
    updated = _observed(
        next(
            c
            for c in new
            if c["metadata"]["name"] == "demo-island-0" and c["kind"] == "StatefulSet"
        )
    )
    updated["status"]["currentRevision"] = "r1"
    updated["status"]["updateRevision"] = "r2"
    by_name[("StatefulSet", "demo-island-0")] = updated
    plan = plan_changes(new, list(by_name.values()), job_uid=JOB.uid)
    assert not [c for c in plan.apply if c["kind"] == "StatefulSet"]
    assert plan.rolling == ["demo-island-0"] and plan.waiting == ["demo-island-1", "demo-island-2"]
    # Island 0 settled: island 1 goes next.
    updated["status"]["currentRevision"] = "r2"
    plan = plan_changes(new, list(by_name.values()), job_uid=JOB.uid)
    assert [c["metadata"]["name"] for c in plan.apply if c["kind"] == "StatefulSet"] == [
        "demo-island-1"
    ]


def test_plan_changes_updates_unready_or_suspended_islands_at_once() -> None:
    old = resources.build_children(JOB, _spec(), islands_running=True)
    new = resources.build_children(JOB, _spec(image="trainer:2"), islands_running=True)
    observed = [_observed(d, ready=False) for d in old]
    plan = plan_changes(new, observed, job_uid=JOB.uid)
    assert len([c for c in plan.apply if c["kind"] == "StatefulSet"]) == 3
    suspended = resources.build_children(
        JOB, _spec(image="trainer:2", suspend=True), islands_running=False
    )
    plan = plan_changes(suspended, [_observed(d) for d in old], job_uid=JOB.uid)
    assert len([c for c in plan.apply if c["kind"] == "StatefulSet"]) == 3


def test_statefulset_in_flight_follows_generation_and_revisions() -> None:
    sts = _observed(resources.build_island_statefulset(JOB, _spec(), 0))
    assert not statefulset_in_flight(sts)
    sts["metadata"]["generation"] = 2
    assert statefulset_in_flight(sts)


def test_child_keys_are_the_names_build_children_gives_without_building() -> None:
    specs = [
        _spec(),
        _spec(islands={"count": 1, "namePrefix": "eu"}),
        _spec(syncer={"endpoint": "https://syncer.example:8470", "tokenSecretName": "tok"}),
        _spec(networkPolicy={"enabled": False}),
    ]
    for spec in specs:
        for network in (None, resources.NetworkOptions(), resources.NetworkOptions(enabled=False)):
            built = resources.build_children(JOB, spec, islands_running=True, network=network)
            keys = [(c["kind"], c["metadata"]["name"]) for c in built]
            assert resources.child_keys(JOB, spec, network=network) == keys
    # Distinct cases, not one shape four times: a remote syncer has no Deployment, the policy
    # comes with the operator's network options only.
    assert ("Deployment", "demo-syncer") not in resources.child_keys(JOB, specs[2])
    assert ("NetworkPolicy", "demo-network") in resources.child_keys(
        JOB, specs[0], network=resources.NetworkOptions()
    )
