"""Pure builders: a DiLoCoJob's spec -> the Kubernetes objects it owns (plain dicts).

Nothing here talks to the API server. Every builder is a function of the job's identity and its
parsed spec, so the reconciler can run it any number of times and compare the result with what
exists (by the `diloco.dev/spec-hash` annotation each child carries).

Restart discipline: a learner pod's template carries only what running learners depend on.
`islands.count`, `suspend`, `stopAfter`, the outer optimizer and other syncer-side fields are left
out of it (the ConfigMap holds the whole spec, but pods read it only at start), so scaling or
suspending never rolls the pods of islands that stay.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco_trainer.api import contract

from diloco_operator import api
from diloco_operator.api import DiLoCoJobSpec

# Annotations the operator reads back.
SPEC_HASH = "diloco.dev/spec-hash"  # on every child: hash of the desired object
TEMPLATE_HASH = "diloco.dev/template-hash"  # on StatefulSets: hash of the pod template
CONFIG_HASH = "diloco.dev/config-hash"  # on pod templates: hash of the config pods depend on

JOB_LABEL = "diloco.dev/job"
ISLAND_LABEL = "diloco.dev/island"
COMPONENT_LABEL = "app.kubernetes.io/component"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
MANAGER = "diloco-operator"

COMPONENT_ISLAND = "island"
COMPONENT_LEARNER = "learner"
COMPONENT_SYNCER = "syncer"
COMPONENT_CONFIG = "config"
COMPONENT_TOKEN = "token"

LEARNER_CONTAINER = "learner"
SYNCER_CONTAINER = "syncer"
DIST_PORT_NAME = "dist"
SYNCER_PORT_NAME = "http"
RUN_AS_USER = 1000

# Spec fields a running learner depends on (camelCase paths into the spec JSON). Changing one of
# them rolls the islands; anything else (islands.count, suspend, stopAfter, outer, quorum, ...)
# reaches the ConfigMap without restarting a learner. Image, resources, template, replicas and the
# syncer's address are in the pod template directly.
LEARNER_CONFIG_FIELDS: tuple[tuple[str, ...], ...] = (
    ("model",),
    ("data",),
    ("inner",),
    ("islands", "shardOffset"),
    ("islands", "totalShards"),
    ("sync", "fragments"),
    ("sync", "overlapSteps"),
    ("sync", "compression"),
    ("sync", "mixAlpha"),
    ("sync", "errorFeedback"),
)
# Spec fields the syncer does not read: changing them never restarts the syncer (whose state
# between checkpoints lives in memory).
SYNCER_IGNORED_FIELDS: tuple[tuple[str, ...], ...] = (
    ("islands",),
    ("suspend",),
    ("ttlSecondsAfterFinished",),
    ("image",),
)


@dataclass(frozen=True)
class JobRef:
    """Identity of one DiLoCoJob object."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobRef:
        """Read name, namespace and uid from a DiLoCoJob object."""
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


# ---------------------------------------------------------------------------------------------
# Names


def island_names(spec: DiLoCoJobSpec) -> list[str]:
    """Names of the desired islands, in index order."""
    return [contract.island_name(spec.islands.name_prefix, i) for i in range(spec.islands.count)]


def island_statefulset_name(job_name: str, island: str) -> str:
    """`NAME-island-I` (or `NAME-PREFIX-island-I`): StatefulSet and headless Service name."""
    return f"{job_name}-{island}"


def syncer_name(job_name: str) -> str:
    """Name of the syncer Deployment and Service."""
    return f"{job_name}-syncer"


def config_map_name(job_name: str) -> str:
    """Name of the ConfigMap holding the spec JSON."""
    return f"{job_name}-config"


def generated_token_secret_name(job_name: str) -> str:
    """Name of the token Secret the operator generates when the user gives none."""
    return f"{job_name}-token"


def token_secret_name(job_name: str, spec: DiLoCoJobSpec) -> str:
    """The Secret (key contract.TOKEN_KEY) every party reads the bearer token from."""
    return spec.syncer.token_secret_name or generated_token_secret_name(job_name)


def runs_local_syncer(spec: DiLoCoJobSpec) -> bool:
    """False when the job points at a syncer run elsewhere (spec.syncer.endpoint)."""
    return not spec.syncer.endpoint


def syncer_url(job: JobRef, spec: DiLoCoJobSpec) -> str:
    """The URL learners and the operator use: the remote endpoint or the in-cluster Service."""
    if spec.syncer.endpoint:
        return spec.syncer.endpoint.rstrip("/")
    scheme = "https" if spec.syncer.tls.secret_name else "http"
    return f"{scheme}://{syncer_name(job.name)}.{job.namespace}.svc:{spec.syncer.port}"


def ca_secret_name(spec: DiLoCoJobSpec) -> str | None:
    """Secret with ca.crt to verify the syncer: caSecretName, else the local TLS Secret."""
    return spec.syncer.tls.ca_secret_name or spec.syncer.tls.secret_name


# ---------------------------------------------------------------------------------------------
# Metadata helpers


def labels(job_name: str, component: str, island: str | None = None) -> dict[str, str]:
    """The recommended app.kubernetes.io labels plus the diloco.dev selectors."""
    out = {
        "app.kubernetes.io/name": "diloco",
        "app.kubernetes.io/instance": job_name,
        COMPONENT_LABEL: component,
        "app.kubernetes.io/managed-by": MANAGER,
        "app.kubernetes.io/part-of": "diloco",
        JOB_LABEL: job_name,
    }
    if island is not None:
        out[ISLAND_LABEL] = island
    return out


def owner_reference(job: JobRef) -> dict[str, Any]:
    """Controller owner reference: garbage collection deletes children with the job."""
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def content_hash(value: Any) -> str:
    """A short, stable hash of JSON-able content."""
    raw = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _metadata(job: JobRef, name: str, lab: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": dict(lab),
        "annotations": {},
        "ownerReferences": [owner_reference(job)],
    }


def _stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Record the hash of the object's desired content in its own annotations."""
    obj["metadata"]["annotations"].pop(SPEC_HASH, None)
    obj["metadata"]["annotations"][SPEC_HASH] = content_hash(obj)
    return obj


def _spec_json(spec: DiLoCoJobSpec) -> dict[str, Any]:
    return spec.model_dump(by_alias=True, mode="json")


def _pick(doc: Mapping[str, Any], paths: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = doc
        for part in path:
            node = node.get(part) if isinstance(node, Mapping) else None
        out[".".join(path)] = node
    return out


def _omit(doc: Mapping[str, Any], paths: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    out = copy.deepcopy(dict(doc))
    for path in paths:
        node: Any = out
        for part in path[:-1]:
            node = node.get(part, {})
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return out


def learner_config_hash(spec: DiLoCoJobSpec) -> str:
    """Hash of the spec fields running learners depend on (see LEARNER_CONFIG_FIELDS)."""
    return content_hash(_pick(_spec_json(spec), LEARNER_CONFIG_FIELDS))


def syncer_config_hash(spec: DiLoCoJobSpec) -> str:
    """Hash of the spec fields the syncer depends on (all but SYNCER_IGNORED_FIELDS)."""
    return content_hash(_omit(_spec_json(spec), SYNCER_IGNORED_FIELDS))


# ---------------------------------------------------------------------------------------------
# Pod template pieces


def _env(name: str, value: str | int) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def _pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _common_volumes(job: JobRef, spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    return [
        {"name": "config", "configMap": {"name": config_map_name(job.name)}},
        {"name": "token", "secret": {"secretName": token_secret_name(job.name, spec)}},
    ]


def _common_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "config", "mountPath": contract.CONFIG_MOUNT, "readOnly": True},
        {"name": "token", "mountPath": contract.TOKEN_MOUNT, "readOnly": True},
        {"name": "state", "mountPath": contract.STATE_MOUNT},
    ]


def _file_env() -> list[dict[str, Any]]:
    return [
        _env(contract.TOKEN_FILE, f"{contract.TOKEN_MOUNT}/{contract.TOKEN_KEY}"),
        _env(contract.CONFIG_FILE, f"{contract.CONFIG_MOUNT}/{contract.CONFIG_KEY}"),
        _env(contract.STATE_DIR, contract.STATE_MOUNT),
    ]


def merge_overrides(base: Any, override: Any) -> Any:
    """Deep-merge a user override into a generated object.

    Maps merge key by key (the override wins); lists whose items are all maps with a `name`
    (containers, volumes, env, ports) merge item by item on the name; other lists are replaced.
    """
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge_overrides(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(override, list) and _named(base) and _named(override):
        merged = [copy.deepcopy(item) for item in base]
        index = {item["name"]: i for i, item in enumerate(merged)}
        for item in override:
            if item["name"] in index:
                merged[index[item["name"]]] = merge_overrides(merged[index[item["name"]]], item)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(override)


def _named(items: list[Any]) -> bool:
    return all(isinstance(item, dict) and "name" in item for item in items)


# ---------------------------------------------------------------------------------------------
# Builders


def build_config_map(job: JobRef, spec: DiLoCoJobSpec) -> dict[str, Any]:
    """`NAME-config`: the whole spec as the JSON the trainer reads (contract.CONFIG_KEY)."""
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(
                job, config_map_name(job.name), labels(job.name, COMPONENT_CONFIG)
            ),
            "data": {contract.CONFIG_KEY: spec.to_json()},
        }
    )


def build_token_secret(job: JobRef, token: str) -> dict[str, Any]:
    """`NAME-token`: the generated bearer token. Created once, never overwritten."""
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _metadata(
                job, generated_token_secret_name(job.name), labels(job.name, COMPONENT_TOKEN)
            ),
            "type": "Opaque",
            "stringData": {contract.TOKEN_KEY: token},
        }
    )


def build_learner_pod_template(job: JobRef, spec: DiLoCoJobSpec, index: int) -> dict[str, Any]:
    """The pod template of island `index` (all its ranks), with spec.islands.template merged in."""
    island = contract.island_name(spec.islands.name_prefix, index)
    sts = island_statefulset_name(job.name, island)
    env = [
        _env(contract.JOB_NAME, job.name),
        _env(contract.ISLAND, island),
        _env(contract.ISLAND_INDEX, spec.islands.shard_offset + index),
        {
            "name": contract.RANK,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
        },
        _env(contract.WORLD_SIZE, spec.islands.replicas),
        _env(contract.MASTER_ADDR, f"{sts}-0.{sts}"),
        _env(contract.MASTER_PORT, contract.DEFAULT_MASTER_PORT),
        _env(contract.SYNCER_URL, syncer_url(job, spec)),
        *_file_env(),
    ]
    mounts = _common_mounts()
    volumes = [*_common_volumes(job, spec), {"name": "state", "emptyDir": {}}]
    ca = ca_secret_name(spec)
    if ca:
        env.append(_env(contract.CA_FILE, f"{contract.CA_MOUNT}/ca.crt"))
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
        "securityContext": _container_security_context(),
    }
    if spec.islands.resources:
        container["resources"] = copy.deepcopy(spec.islands.resources)
    pod_labels = labels(job.name, COMPONENT_LEARNER, island)
    template: dict[str, Any] = {
        "metadata": {
            "labels": dict(pod_labels),
            "annotations": {CONFIG_HASH: learner_config_hash(spec)},
        },
        "spec": {
            "enableServiceLinks": False,
            "securityContext": _pod_security_context(),
            "containers": [container],
            "volumes": volumes,
        },
    }
    template = merge_overrides(template, spec.islands.template)
    # The selector labels are not the user's to change.
    template["metadata"]["labels"].update(pod_labels)
    return template


def build_island_statefulset(
    job: JobRef, spec: DiLoCoJobSpec, index: int, *, running: bool = True
) -> dict[str, Any]:
    """Island `index`: a StatefulSet of spec.islands.replicas DDP ranks (0 when not running)."""
    island = contract.island_name(spec.islands.name_prefix, index)
    name = island_statefulset_name(job.name, island)
    lab = labels(job.name, COMPONENT_ISLAND, island)
    template = build_learner_pod_template(job, spec, index)
    meta = _metadata(job, name, lab)
    meta["annotations"][TEMPLATE_HASH] = content_hash(template)
    return _stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": meta,
            "spec": {
                "replicas": spec.islands.replicas if running else 0,
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
    lab = labels(job.name, COMPONENT_ISLAND, island)
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(job, name, lab),
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


def build_syncer_deployment(job: JobRef, spec: DiLoCoJobSpec) -> dict[str, Any]:
    """`NAME-syncer`: one syncer pod (Recreate: never two writers of one checkpoint)."""
    lab = labels(job.name, COMPONENT_SYNCER)
    tls = spec.syncer.tls.secret_name
    scheme = "HTTPS" if tls else "HTTP"
    env = [
        _env(contract.JOB_NAME, job.name),
        _env(contract.SYNCER_PORT, spec.syncer.port),
        *_file_env(),
    ]
    mounts = _common_mounts()
    claim = spec.syncer.checkpoint.claim_name
    state: dict[str, Any] = (
        {"name": "state", "persistentVolumeClaim": {"claimName": claim}}
        if claim
        else {"name": "state", "emptyDir": {}}
    )
    volumes = [*_common_volumes(job, spec), state]
    if tls:
        env.append(_env(contract.TLS_CERT_FILE, f"{contract.TLS_MOUNT}/tls.crt"))
        env.append(_env(contract.TLS_KEY_FILE, f"{contract.TLS_MOUNT}/tls.key"))
        mounts.append({"name": "tls", "mountPath": contract.TLS_MOUNT, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": tls}})
    container: dict[str, Any] = {
        "name": SYNCER_CONTAINER,
        "image": spec.image,
        "command": ["diloco", "syncer"],
        "env": env,
        "ports": [{"name": SYNCER_PORT_NAME, "containerPort": spec.syncer.port}],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": SYNCER_PORT_NAME, "scheme": scheme},
            "periodSeconds": 5,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": SYNCER_PORT_NAME, "scheme": scheme},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "volumeMounts": mounts,
        "securityContext": _container_security_context(),
    }
    if spec.syncer.resources:
        container["resources"] = copy.deepcopy(spec.syncer.resources)
    return _stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _metadata(job, syncer_name(job.name), lab),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {
                    "matchLabels": {JOB_LABEL: job.name, COMPONENT_LABEL: COMPONENT_SYNCER}
                },
                "template": {
                    "metadata": {
                        "labels": dict(lab),
                        "annotations": {CONFIG_HASH: syncer_config_hash(spec)},
                    },
                    "spec": {
                        "enableServiceLinks": False,
                        "securityContext": _pod_security_context(),
                        "containers": [container],
                        "volumes": volumes,
                    },
                },
            },
        }
    )


def build_syncer_service(job: JobRef, spec: DiLoCoJobSpec) -> dict[str, Any]:
    """`NAME-syncer` Service of type spec.syncer.service.type on spec.syncer.port."""
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(job, syncer_name(job.name), labels(job.name, COMPONENT_SYNCER)),
            "spec": {
                "type": spec.syncer.service.type,
                "selector": {JOB_LABEL: job.name, COMPONENT_LABEL: COMPONENT_SYNCER},
                "ports": [
                    {
                        "name": SYNCER_PORT_NAME,
                        "port": spec.syncer.port,
                        "targetPort": SYNCER_PORT_NAME,
                    }
                ],
            },
        }
    )


def build_children(job: JobRef, spec: DiLoCoJobSpec, *, islands_running: bool) -> list[dict]:
    """Every child the job should have except the token Secret (which is create-only).

    `islands_running` is False while the job is suspended or finished: islands scale to zero but
    keep their StatefulSets, so resuming brings back the same names.
    """
    children = [build_config_map(job, spec)]
    if runs_local_syncer(spec):
        children += [build_syncer_deployment(job, spec), build_syncer_service(job, spec)]
    for index in range(spec.islands.count):
        children.append(build_island_service(job, spec, index))
        children.append(build_island_statefulset(job, spec, index, running=islands_running))
    return children
