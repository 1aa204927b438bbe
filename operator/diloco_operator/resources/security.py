"""What keeps a job's pods to themselves (pure): each pod's own credential, no ServiceAccount
token, a read-only root filesystem, and who may reach the syncer and the DDP port.

`secure_workload` finishes a workload the per-kind builders made (their pod templates already
hold the user's fragments, so an explicit automountServiceAccountToken or readOnlyRootFilesystem
there wins): learners mount only their own island's key of the island credentials Secret, the
syncer the job's root token; every pod gets a writable emptyDir at /tmp (HOME in the image:
caches) beside the state volume, and the fingerprint of the job's credential, so a rotation
restarts the pods that hold the old one. `build_network_policy` lets only the job's own pods and
the operator reach the syncer port and the islands' DDP port (and anyone the syncer port when
its Service is a LoadBalancer or NodePort: other clusters' learners, behind TLS and their
credentials).
"""

from __future__ import annotations

import base64
import copy
from dataclasses import dataclass, field
from typing import Any

from diloco_trainer.api import contract
from diloco_trainer.api.credentials import Issuer
from diloco_trainer.api.exposure import EXTERNAL_SERVICE_TYPES

from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.resources.naming import (
    COMPONENT_CREDENTIALS,
    COMPONENT_NETWORK,
    CREDENTIAL_HASH,
    ISLAND_LABEL,
    JOB_LABEL,
    TEMPLATE_HASH,
    JobRef,
    child_metadata,
    content_hash,
    island_names,
    island_tokens_secret_name,
    labels,
    network_policy_name,
    runs_local_syncer,
    stamp,
)
from diloco_operator.resources.pods import LEARNER_CONTAINER, SYNCER_CONTAINER

TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"
TOKEN_VOLUME = "token"  # pods.common_volumes' name for the credential volume


@dataclass(frozen=True)
class NetworkOptions:
    """The operator's side of the NetworkPolicies (chart values, read at start)."""

    enabled: bool = True
    operator_namespace: str = ""  # "" when the operator does not run in a pod
    operator_labels: dict[str, str] = field(default_factory=dict)


def build_island_tokens_secret(job: JobRef, spec: DiLoCoJobSpec, issuer: Issuer) -> dict[str, Any]:
    """`NAME-island-tokens`: one key per desired island, its credential (derived by `issuer`)."""
    data = {
        island: base64.b64encode(issuer.island_token(island).encode()).decode()
        for island in island_names(spec)
    }
    meta = child_metadata(
        job, island_tokens_secret_name(job.name), labels(job.name, COMPONENT_CREDENTIALS)
    )
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"}
    return stamp({**secret, "data": data})


def _container(pod: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in pod.get("containers") or [] if c.get("name") == name), None)


def _harden_pod(pod: dict[str, Any], container_name: str) -> None:
    pod.setdefault("automountServiceAccountToken", False)
    container = _container(pod, container_name)
    if container is None:
        return
    container.setdefault("securityContext", {}).setdefault("readOnlyRootFilesystem", True)
    mounts = container.setdefault("volumeMounts", [])
    if not any(m.get("mountPath") == TMP_MOUNT for m in mounts):
        mounts.append({"name": TMP_VOLUME, "mountPath": TMP_MOUNT})
        volumes = pod.setdefault("volumes", [])
        if not any(v.get("name") == TMP_VOLUME for v in volumes):
            volumes.append({"name": TMP_VOLUME, "emptyDir": {}})


def _island_credential_volume(pod: dict[str, Any], job: JobRef, island: str) -> None:
    """The learner's credential volume: only its island's key, as the file learners read."""
    for volume in pod.get("volumes") or []:
        if volume.get("name") == TOKEN_VOLUME:
            volume.clear()
            volume["name"] = TOKEN_VOLUME
            volume["secret"] = {
                "secretName": island_tokens_secret_name(job.name),
                "items": [{"key": island, "path": contract.TOKEN_KEY}],
            }


def secure_workload(job: JobRef, obj: dict[str, Any], fingerprint: str) -> dict[str, Any]:
    """A learner StatefulSet or syncer Deployment, finished as the module docstring says (other
    objects are returned unchanged)."""
    if obj["kind"] not in ("StatefulSet", "Deployment"):
        return obj
    out = copy.deepcopy(obj)
    template = out["spec"]["template"]
    pod = template.setdefault("spec", {})
    learners = obj["kind"] == "StatefulSet"
    _harden_pod(pod, LEARNER_CONTAINER if learners else SYNCER_CONTAINER)
    if learners:
        _island_credential_volume(pod, job, template["metadata"]["labels"][ISLAND_LABEL])
    if fingerprint:
        template["metadata"].setdefault("annotations", {})[CREDENTIAL_HASH] = fingerprint
    if learners:  # the planner rolls islands one at a time by this hash
        out["metadata"]["annotations"][TEMPLATE_HASH] = content_hash(template)
    return stamp(out)


def _port(number: int) -> dict[str, Any]:
    return {"protocol": "TCP", "port": number}


def build_network_policy(
    job: JobRef, spec: DiLoCoJobSpec, options: NetworkOptions
) -> dict[str, Any]:
    """`NAME-network`: ingress to the job's pods only from the job's pods (any port) and the
    operator (syncer port), and from anywhere to an exposed syncer's port."""
    own = {"podSelector": {"matchLabels": {JOB_LABEL: job.name}}}
    syncer_port = [_port(spec.syncer.port)]
    # The job's own pods on any port: gloo and NCCL rendezvous on the DDP port, then connect the
    # ranks' pairs on ports chosen at run time; a port list here stalls every island of two or
    # more ranks once a plugin enforces it (found by tests/node/test_network_policy.py).
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    if options.operator_namespace:
        operator = {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": options.operator_namespace}
            },
            "podSelector": {"matchLabels": dict(options.operator_labels)},
        }
        ingress.append({"from": [operator], "ports": syncer_port})
    if runs_local_syncer(spec) and spec.syncer.service.type in EXTERNAL_SERVICE_TYPES:
        ingress.append({"ports": syncer_port})  # other clusters' learners: TLS + credentials
    meta = child_metadata(job, network_policy_name(job.name), labels(job.name, COMPONENT_NETWORK))
    return stamp(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta,
            "spec": {
                "podSelector": {"matchLabels": {JOB_LABEL: job.name}},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }
    )


def wants_network_policy(spec: DiLoCoJobSpec, options: NetworkOptions) -> bool:
    """Both the operator (chart value) and the job (spec.networkPolicy.enabled) want one."""
    return options.enabled and spec.network_policy.enabled
