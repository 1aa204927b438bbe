"""The in-cluster syncer's children: its Deployment and its Service (pure).

Absent when the job points at a syncer run elsewhere (spec.syncer.endpoint). With
syncer.shards N > 1, one Deployment and Service per shard (NAME-syncer-I, pods labelled
SHARD_LABEL=I, told their shard by DILOCO_SYNCER_SHARD, their state in the volume's shard-I
directory); with one syncer, `shard` is None and nothing of this is there.
"""

from __future__ import annotations

import copy
from typing import Any

from diloco_trainer.api import contract
from diloco_trainer.api.sharding import SHARD_DIR_PREFIX

from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.resources.naming import (
    COMPONENT_LABEL,
    COMPONENT_SYNCER,
    CONFIG_HASH,
    JOB_LABEL,
    SHARD_LABEL,
    JobRef,
    child_metadata,
    labels,
    stamp,
    syncer_name,
)
from diloco_operator.resources.placement import job_fragment, with_user_fragments
from diloco_operator.resources.pods import (
    SYNCER_CONTAINER,
    SYNCER_PORT_NAME,
    SYNCER_PROBE_PORT_NAME,
    common_mounts,
    common_volumes,
    container_security_context,
    env_var,
    file_env,
    pod_security_context,
    syncer_config_hash,
)

# The kubelet's default probe timeout (1 s) fails a syncer busy merging on a loaded CPU; the
# startup probe allows 10 minutes (120 x 5 s) to load the data and evaluate (real node: 70 s for
# builtin:stdlib-text beside 4 learners on 2 cores, which the liveness probe alone killed).
PROBE_TIMEOUT_SECONDS = 5
STARTUP_PROBE_FAILURES = 120


def _syncer_container(job: JobRef, spec: DiLoCoJobSpec, shard: int | None) -> dict[str, Any]:
    tls = spec.syncer.tls.secret_name
    scheme = "HTTPS" if tls else "HTTP"
    env = [
        env_var(contract.JOB_NAME, job.name),
        env_var(contract.SYNCER_PORT, spec.syncer.port),
        env_var(contract.SYNCER_HEALTH_PORT, contract.health_port_of(spec.syncer.port)),
        *file_env(),
    ]
    mounts = common_mounts()
    if shard is not None:
        env.append(env_var(contract.SYNCER_SHARD, shard))
        # Shards may share one claim: each keeps its checkpoints in its own directory, as
        # `diloco run` does (api/sharding.shard_state_dir), so `diloco export` of the claim's
        # root assembles the model.
        for mount in mounts:
            if mount["name"] == "state":
                mount["subPath"] = f"{SHARD_DIR_PREFIX}{shard}"
    if tls:
        env.append(env_var(contract.TLS_CERT_FILE, f"{contract.TLS_MOUNT}/tls.crt"))
        env.append(env_var(contract.TLS_KEY_FILE, f"{contract.TLS_MOUNT}/tls.key"))
        mounts.append({"name": "tls", "mountPath": contract.TLS_MOUNT, "readOnly": True})
    container: dict[str, Any] = {
        "name": SYNCER_CONTAINER,
        "image": spec.image,
        "command": ["diloco", "syncer"],
        "env": env,
        "ports": [
            {"name": SYNCER_PORT_NAME, "containerPort": spec.syncer.port},
            {
                "name": SYNCER_PROBE_PORT_NAME,
                "containerPort": contract.health_port_of(spec.syncer.port),
            },
        ],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": SYNCER_PROBE_PORT_NAME, "scheme": scheme},
            "periodSeconds": 5,
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
        },
        # The syncer listens only once it has read its data, evaluated the initial weights or
        # resumed from a checkpoint: minutes on a busy node. Liveness starts after that.
        "startupProbe": {
            "httpGet": {"path": "/healthz", "port": SYNCER_PROBE_PORT_NAME, "scheme": scheme},
            "periodSeconds": 5,
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
            "failureThreshold": STARTUP_PROBE_FAILURES,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": SYNCER_PROBE_PORT_NAME, "scheme": scheme},
            "periodSeconds": 10,
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
            "failureThreshold": 6,
        },
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    if spec.syncer.resources:
        container["resources"] = copy.deepcopy(spec.syncer.resources)
    return container


def _syncer_volumes(job: JobRef, spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    claim = spec.syncer.checkpoint.claim_name
    state: dict[str, Any] = (
        {"name": "state", "persistentVolumeClaim": {"claimName": claim}}
        if claim
        else {"name": "state", "emptyDir": {}}
    )
    volumes = [*common_volumes(job, spec), state]
    if spec.syncer.tls.secret_name:
        volumes.append({"name": "tls", "secret": {"secretName": spec.syncer.tls.secret_name}})
    return volumes


def _syncer_labels(job: JobRef, shard: int | None) -> dict[str, str]:
    lab = labels(job.name, COMPONENT_SYNCER)
    if shard is not None:
        lab[SHARD_LABEL] = str(shard)
    return lab


def _syncer_selector(job: JobRef, shard: int | None) -> dict[str, str]:
    selector = {JOB_LABEL: job.name, COMPONENT_LABEL: COMPONENT_SYNCER}
    if shard is not None:
        selector[SHARD_LABEL] = str(shard)
    return selector


def build_syncer_pod_template(
    job: JobRef, spec: DiLoCoJobSpec, shard: int | None = None
) -> dict[str, Any]:
    """The syncer's (or shard `shard`'s) pod template, with spec.syncer.template merged in."""
    lab = _syncer_labels(job, shard)
    template = {
        "metadata": {
            "labels": dict(lab),
            "annotations": {CONFIG_HASH: syncer_config_hash(spec)},
        },
        "spec": {
            "enableServiceLinks": False,
            "securityContext": pod_security_context(),
            "containers": [_syncer_container(job, spec, shard)],
            "volumes": _syncer_volumes(job, spec),
        },
    }
    return with_user_fragments(template, [job_fragment(job), spec.syncer.template], lab)


def build_syncer_deployment(
    job: JobRef, spec: DiLoCoJobSpec, shard: int | None = None
) -> dict[str, Any]:
    """`NAME-syncer` (`NAME-syncer-I` for shard I): one syncer pod (Recreate: never two
    writers of one checkpoint)."""
    lab = _syncer_labels(job, shard)
    return stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": child_metadata(job, syncer_name(job.name, shard), lab),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": _syncer_selector(job, shard)},
                "template": build_syncer_pod_template(job, spec, shard),
            },
        }
    )


def build_syncer_service(
    job: JobRef, spec: DiLoCoJobSpec, shard: int | None = None
) -> dict[str, Any]:
    """`NAME-syncer` (`NAME-syncer-I` for shard I) Service of type spec.syncer.service.type on
    spec.syncer.port."""
    return stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": child_metadata(
                job, syncer_name(job.name, shard), _syncer_labels(job, shard)
            ),
            "spec": {
                "type": spec.syncer.service.type,
                "selector": _syncer_selector(job, shard),
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
