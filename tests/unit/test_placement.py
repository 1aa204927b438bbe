"""Placement: the syncer pod template, per-island overrides, and who admits what (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_operator import api, resources
from diloco_operator.health import PodView, island_health
from diloco_operator.resources import JobRef
from diloco_trainer.api import contract
from diloco_trainer.api.spec import ConfigError, parse_spec
from diloco_trainer.syncer.intake.admission import Admission

JOB = JobRef(name="demo", namespace="ns1", uid="uid-1")

GPU_A = {"requests": {"cpu": "4"}, "limits": {"nvidia.com/gpu": "1"}}
GPU_B = {"requests": {"cpu": "8"}, "limits": {"nvidia.com/gpu": "8"}}


def _spec(**overrides: Any) -> api.DiLoCoJobSpec:
    data: dict[str, Any] = {"image": "trainer:1", "islands": {"count": 3, "replicas": 2}}
    data.update(overrides)
    return api.parse_job_spec(data)


def _mixed() -> api.DiLoCoJobSpec:
    return _spec(
        islands={
            "count": 3,
            "replicas": 2,
            "resources": GPU_A,
            "template": {
                "spec": {
                    "nodeSelector": {"pool": "a100", "zone": "z1"},
                    "tolerations": [{"key": "gpu", "operator": "Exists"}],
                }
            },
            "overrides": [
                {
                    "islands": [2, 7],
                    "replicas": 4,
                    "resources": GPU_B,
                    "nodeSelector": {"pool": "h100"},
                    "template": {
                        "metadata": {"labels": {"diloco.dev/island": "nope", "tier": "big"}},
                        "spec": {"priorityClassName": "large"},
                    },
                }
            ],
        }
    )


def _learner(sts: dict[str, Any]) -> dict[str, Any]:
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_island_without_override_keeps_the_islands_defaults() -> None:
    sts = resources.build_island_statefulset(JOB, _mixed(), 0)
    pod = sts["spec"]["template"]["spec"]
    assert sts["spec"]["replicas"] == 2
    assert _learner(sts)["resources"] == GPU_A
    assert _env(_learner(sts))[contract.WORLD_SIZE] == "2"
    assert pod["nodeSelector"] == {"pool": "a100", "zone": "z1"}
    assert "priorityClassName" not in pod


def test_island_override_sets_replicas_resources_node_selector_and_template() -> None:
    sts = resources.build_island_statefulset(JOB, _mixed(), 2)
    template = sts["spec"]["template"]
    pod = template["spec"]
    assert sts["spec"]["replicas"] == 4
    assert _learner(sts)["resources"] == GPU_B
    assert _env(_learner(sts))[contract.WORLD_SIZE] == "4"
    # nodeSelector merges key by key over islands.template's; the tolerations stay.
    assert pod["nodeSelector"] == {"pool": "h100", "zone": "z1"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert pod["priorityClassName"] == "large"
    # The override's own labels arrive; the selector labels are not the user's to change.
    assert template["metadata"]["labels"]["tier"] == "big"
    assert template["metadata"]["labels"]["diloco.dev/island"] == "island-2"


def test_island_override_rolls_only_its_islands() -> None:
    mixed = _mixed()
    plain = _spec(islands={**mixed.islands.model_dump(by_alias=True), "overrides": []})
    for index, rolls in ((0, False), (1, False), (2, True)):
        before, after = (
            resources.build_island_statefulset(JOB, s, index)["metadata"]["annotations"][
                resources.TEMPLATE_HASH
            ]
            for s in (plain, mixed)
        )
        assert (before != after) is rolls, index


def test_suspended_island_with_override_has_no_pods() -> None:
    sts = resources.build_island_statefulset(JOB, _mixed(), 2, running=False)
    assert sts["spec"]["replicas"] == 0


def test_override_indexes_past_count_are_ignored_and_overlaps_refused() -> None:
    spec = _mixed()
    assert [spec.islands.replicas_of(i) for i in range(3)] == [2, 2, 4]
    assert spec.islands.max_replicas() == 4
    assert resources.island_replicas_by_name(spec) == {
        "island-0": 2,
        "island-1": 2,
        "island-2": 4,
    }
    scaled = _spec(islands={**spec.islands.model_dump(by_alias=True), "count": 2})
    assert scaled.islands.max_replicas() == 2
    with pytest.raises(api.SpecError, match="island 1 is named by more than one override"):
        _spec(islands={"count": 3, "overrides": [{"islands": [1]}, {"islands": [0, 1]}]})
    with pytest.raises(ConfigError, match=r"spec\.islands\.overrides\.0\.islands"):
        parse_spec({"islands": {"overrides": [{"islands": []}]}})


def test_syncer_bounds_an_islands_work_by_the_largest_island() -> None:
    # The syncer bounds a push's tokens by the island's replicas: the largest island's must fit.
    assert Admission.from_spec(_mixed()).replicas_for("island-2") == 4
    assert Admission.from_spec(_spec()).replicas_for("island-2") == 2


def test_island_health_expects_each_islands_own_replicas() -> None:
    spec = _mixed()
    sts = {i: resources.island_statefulset_name("demo", i) for i in resources.island_names(spec)}
    pods = [PodView(f"demo-island-2-{r}", "island-2", "learner", True, 0, False) for r in range(2)]
    health = island_health(sts, resources.island_replicas_by_name(spec), pods)
    assert health["island-2"].desired_pods == 4
    assert not health["island-2"].healthy
    assert health["island-2"].missing == ("demo-island-2-2", "demo-island-2-3")
    assert health["island-0"].desired_pods == 2


def test_syncer_template_places_the_syncer_and_mounts_a_volume() -> None:
    spec = _spec(
        syncer={
            "template": {
                "metadata": {"labels": {resources.COMPONENT_LABEL: "nope", "team": "ml"}},
                "spec": {
                    "nodeSelector": {"pool": "cpu"},
                    "tolerations": [{"key": "cpu-only", "operator": "Exists"}],
                    "affinity": {"nodeAffinity": {"x": 1}},
                    "imagePullSecrets": [{"name": "regcred"}],
                    "priorityClassName": "high",
                    "serviceAccountName": "syncer-sa",
                    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}],
                    "containers": [
                        {"name": "syncer", "volumeMounts": [{"name": "data", "mountPath": "/d"}]}
                    ],
                },
            }
        }
    )
    deployment = resources.build_syncer_deployment(JOB, spec)
    template = deployment["spec"]["template"]
    pod = template["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [{"key": "cpu-only", "operator": "Exists"}]
    assert pod["affinity"] == {"nodeAffinity": {"x": 1}}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["priorityClassName"] == "high"
    assert pod["serviceAccountName"] == "syncer-sa"
    volumes = [v["name"] for v in pod["volumes"]]
    assert volumes[-1] == "data" and "state" in volumes and "config" in volumes
    (container,) = pod["containers"]
    assert container["command"] == ["diloco", "syncer"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["data"] == "/d" and mounts["state"] == contract.STATE_MOUNT
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"][resources.COMPONENT_LABEL] == "syncer"
    assert resources.CONFIG_HASH in template["metadata"]["annotations"]
    # Learners are not touched by the syncer's template.
    learner = resources.build_island_statefulset(JOB, spec, 0)["spec"]["template"]["spec"]
    assert "nodeSelector" not in learner and "serviceAccountName" not in learner


def test_syncer_without_template_is_unchanged() -> None:
    spec = _spec()
    assert (
        resources.build_syncer_pod_template(JOB, spec)
        == resources.build_syncer_deployment(JOB, spec)["spec"]["template"]
    )
    assert spec.syncer.template == {}


def test_job_labels_and_annotations_reach_every_pod_but_not_bookkeeping() -> None:
    body = {
        "metadata": {
            "name": "demo",
            "namespace": "ns1",
            "uid": "uid-1",
            "labels": {"kueue.x-k8s.io/queue-name": "team-a", "app.kubernetes.io/name": "mine"},
            "annotations": {
                "scheduling.example.com/pod-group": "demo",
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
                "diloco.dev/last-handled-configuration": "{}",
                "kopf.zalando.org/touch-dummy": "x",
            },
        }
    }
    job = JobRef.from_body(body)
    spec = _spec(islands={"count": 2, "template": {"metadata": {"labels": {"tier": "x"}}}})
    templates = [
        resources.build_island_statefulset(job, spec, 1)["spec"]["template"],
        resources.build_syncer_deployment(job, spec)["spec"]["template"],
    ]
    for template in templates:
        meta = template["metadata"]
        assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        # The operator's own labels win over the job's (selectors and the recommended labels).
        assert meta["labels"]["app.kubernetes.io/name"] == "diloco"
        assert meta["annotations"]["scheduling.example.com/pod-group"] == "demo"
        for key in meta["annotations"]:
            assert not key.startswith(("kubectl.kubernetes.io/", "kopf.zalando.org/")), key
        assert "diloco.dev/last-handled-configuration" not in meta["annotations"]
    assert templates[0]["metadata"]["labels"]["tier"] == "x"
    assert templates[0]["metadata"]["labels"][resources.ISLAND_LABEL] == "island-1"
    # Without labels or annotations on the job the pods are what they were.
    plain = JobRef.from_body({"metadata": {"name": "demo", "namespace": "ns1", "uid": "uid-1"}})
    assert plain == JOB
