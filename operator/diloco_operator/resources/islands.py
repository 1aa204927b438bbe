"""An island's children: its StatefulSet of DDP ranks and its headless Service (pure)."""

from __future__ import annotations

from typing import Any

from diloco_trainer.api import contract

from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.resources.naming import (
    COMPONENT_ISLAND,
    COMPONENT_LEARNER,
    CONFIG_HASH,
    ISLAND_LABEL,
    JOB_LABEL,
    POD_INDEX_LABEL,
    TEMPLATE_HASH,
    JobRef,
    ca_secret_name,
    child_metadata,
    content_hash,
    island_statefulset_name,
    labels,
    stamp,
    syncer_url,
)
from diloco_operator.resources.placement import (
    island_resources,
    island_template_fragments,
    with_user_fragments,
)
from diloco_operator.resources.pods import (
    DIST_PORT_NAME,
    LEARNER_CONTAINER,
    common_mounts,
    common_volumes,
    container_security_context,
    env_var,
    file_env,
    learner_config_hash,
    pod_security_context,
)


def _learner_env(job: JobRef, spec: DiLoCoJobSpec, index: int) -> list[dict[str, Any]]:
    island = contract.island_name(spec.islands.name_prefix, index)
    sts = island_statefulset_name(job.name, island)
    return [
        env_var(contract.JOB_NAME, job.name),
        env_var(contract.ISLAND, island),
        env_var(contract.ISLAND_INDEX, spec.islands.shard_offset + index),
        {
            "name": contract.RANK,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
        },
        env_var(contract.WORLD_SIZE, spec.islands.replicas_of(index)),
        env_var(contract.MASTER_ADDR, f"{sts}-0.{sts}"),
        env_var(contract.MASTER_PORT, contract.DEFAULT_MASTER_PORT),
        env_var(contract.SYNCER_URL, syncer_url(job, spec)),
        *file_env(),
    ]


def build_learner_pod_template(job: JobRef, spec: DiLoCoJobSpec, index: int) -> dict[str, Any]:
    """The pod template of island `index` (all its ranks), with spec.islands.template and the
    island's entry of spec.islands.overrides merged in."""
    island = contract.island_name(spec.islands.name_prefix, index)
    env = _learner_env(job, spec, index)
    mounts = common_mounts()
    volumes = [*common_volumes(job, spec), {"name": "state", "emptyDir": {}}]
    ca = ca_secret_name(spec)
    if ca:
        env.append(env_var(contract.CA_FILE, f"{contract.CA_MOUNT}/ca.crt"))
        mounts.append({"name": "ca", "mountPath": contract.CA_MOUNT, "readOnly": True})
        volumes.append(
            {
                "name": "ca",
                "secret": {"secretName": ca, "items": [{"key": "ca.crt", "path": "ca.crt"}]},
            }
        )
    container: dict[str, Any] = {
        "name": LEARNER_CONTAINER,
        "image": spec.image,
        "command": ["diloco", "learner"],
        "env": env,
        "ports": [{"name": DIST_PORT_NAME, "containerPort": contract.DEFAULT_MASTER_PORT}],
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    resources = island_resources(spec, index)
    if resources:
        container["resources"] = resources
    pod_labels = labels(job.name, COMPONENT_LEARNER, island)
    template: dict[str, Any] = {
        "metadata": {
            "labels": dict(pod_labels),
            "annotations": {CONFIG_HASH: learner_config_hash(spec)},
        },
        "spec": {
            "enableServiceLinks": False,
            "securityContext": pod_security_context(),
            "containers": [container],
            "volumes": volumes,
        },
    }
    return with_user_fragments(template, island_template_fragments(job, spec, index), pod_labels)


def build_island_statefulset(
    job: JobRef, spec: DiLoCoJobSpec, index: int, *, running: bool = True
) -> dict[str, Any]:
    """Island `index`: a StatefulSet of its DDP ranks (islands.replicas or its override's; 0
    when not running)."""
    island = contract.island_name(spec.islands.name_prefix, index)
    name = island_statefulset_name(job.name, island)
    template = build_learner_pod_template(job, spec, index)
    meta = child_metadata(job, name, labels(job.name, COMPONENT_ISLAND, island))
    meta["annotations"][TEMPLATE_HASH] = content_hash(template)
    return stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": meta,
            "spec": {
                "replicas": spec.islands.replicas_of(index) if running else 0,
                "serviceName": name,
                # Ranks of one island start together: DDP waits for all of them anyway.
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": {JOB_LABEL: job.name, ISLAND_LABEL: island}},
                "updateStrategy": {"type": "RollingUpdate"},
                "template": template,
            },
        }
    )


def build_island_service(job: JobRef, spec: DiLoCoJobSpec, index: int) -> dict[str, Any]:
    """Headless Service giving island `index`'s pods DNS names (MASTER_ADDR = pod 0)."""
    island = contract.island_name(spec.islands.name_prefix, index)
    name = island_statefulset_name(job.name, island)
    return stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": child_metadata(job, name, labels(job.name, COMPONENT_ISLAND, island)),
            "spec": {
                "clusterIP": "None",
                # Rank 0 must resolve before it is Ready: DDP rendezvous comes first.
                "publishNotReadyAddresses": True,
                "selector": {JOB_LABEL: job.name, ISLAND_LABEL: island},
                "ports": [
                    {
                        "name": DIST_PORT_NAME,
                        "port": contract.DEFAULT_MASTER_PORT,
                        "targetPort": DIST_PORT_NAME,
                    }
                ],
            },
        }
    )
