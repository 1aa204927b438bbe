"""Names, labels and owner references every child of a DiLoCoJob carries (pure).

The one place the operator's naming scheme lives: the builders, the planner, the health checks
and the kopf watches (by JOB_LABEL) all read it from here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco_trainer.api import contract
from diloco_trainer.api.sharding import join_urls

from diloco_operator import api
from diloco_operator.api import DiLoCoJobSpec

# Annotations the operator reads back.
SPEC_HASH = "diloco.dev/spec-hash"  # on every child: hash of the desired object
TEMPLATE_HASH = "diloco.dev/template-hash"  # on StatefulSets: hash of the pod template
CONFIG_HASH = "diloco.dev/config-hash"  # on pod templates: hash of the config pods depend on
# On pod templates: the fingerprint of the job's credential (a rotation restarts the pods).
CREDENTIAL_HASH = "diloco.dev/credential-hash"
# On a DiLoCoJob: change its value to rotate the generated root token (and all it derives); the
# token Secret carries the value it was made for.
ROTATE_CREDENTIALS = "diloco.dev/rotate-credentials"

JOB_LABEL = "diloco.dev/job"
ISLAND_LABEL = "diloco.dev/island"
# On the pods of shard i of a job with syncer.shards > 1 (absent with one syncer): what each
# shard's Deployment and Service select.
SHARD_LABEL = "diloco.dev/syncer-shard"
COMPONENT_LABEL = "app.kubernetes.io/component"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
MANAGER = "diloco-operator"

COMPONENT_ISLAND = "island"
COMPONENT_LEARNER = "learner"
COMPONENT_SYNCER = "syncer"
COMPONENT_CONFIG = "config"
COMPONENT_TOKEN = "token"
COMPONENT_CREDENTIALS = "credentials"
COMPONENT_NETWORK = "network"


# Annotations of a job that are not passed on to its pods: kubectl's and kopf's bookkeeping and
# the operator's own (diloco.dev/), which change without the user changing anything.
UNPASSED_ANNOTATION_PREFIXES = ("kubectl.kubernetes.io/", "kopf.zalando.org/", "diloco.dev/")

Pairs = tuple[tuple[str, str], ...]


def passed_on(items: Mapping[str, Any] | None, skip: tuple[str, ...] = ()) -> Pairs:
    """The (key, value) pairs of job metadata that every pod of the job carries too."""
    return tuple(sorted((k, str(v)) for k, v in (items or {}).items() if not k.startswith(skip)))


@dataclass(frozen=True)
class JobRef:
    """Identity of one DiLoCoJob object, and the labels and annotations its pods carry too
    (so other schedulers' gang and queue labels set on the job reach every pod)."""

    name: str
    namespace: str
    uid: str
    pod_labels: Pairs = ()
    pod_annotations: Pairs = ()

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobRef:
        """Read name, namespace, uid, labels and annotations from a DiLoCoJob object."""
        meta = body["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            pod_labels=passed_on(meta.get("labels")),
            pod_annotations=passed_on(meta.get("annotations"), UNPASSED_ANNOTATION_PREFIXES),
        )


def island_names(spec: DiLoCoJobSpec) -> list[str]:
    """Names of the desired islands, in index order."""
    return [contract.island_name(spec.islands.name_prefix, i) for i in range(spec.islands.count)]


def island_statefulset_name(job_name: str, island: str) -> str:
    """`NAME-island-I` (or `NAME-PREFIX-island-I`): StatefulSet and headless Service name."""
    return f"{job_name}-{island}"


def syncer_name(job_name: str, shard: int | None = None) -> str:
    """Name of the syncer Deployment and Service: NAME-syncer, or NAME-syncer-I for shard I of
    several (syncer.shards > 1)."""
    return f"{job_name}-syncer" if shard is None else f"{job_name}-syncer-{shard}"


def syncer_shards(spec: DiLoCoJobSpec) -> list[int | None]:
    """The shard of each in-cluster syncer: [None] for the one syncer of syncer.shards 1 (its
    children keep the unsharded names), else 0..N-1."""
    shards = spec.syncer.shards
    return [None] if shards == 1 else list(range(shards))


def config_map_name(job_name: str) -> str:
    """Name of the ConfigMap holding the spec JSON."""
    return f"{job_name}-config"


def generated_token_secret_name(job_name: str) -> str:
    """Name of the token Secret the operator generates when the user gives none."""
    return f"{job_name}-token"


def token_secret_name(job_name: str, spec: DiLoCoJobSpec) -> str:
    """The Secret (key contract.TOKEN_KEY) with the job's credential: the root token the syncer
    holds, or (another cluster of a multi-region job) a region credential."""
    return spec.syncer.token_secret_name or generated_token_secret_name(job_name)


def island_tokens_secret_name(job_name: str) -> str:
    """The Secret of the islands' credentials, one key per island (each pod mounts its own)."""
    return f"{job_name}-island-tokens"


def network_policy_name(job_name: str) -> str:
    """Name of the job's NetworkPolicy."""
    return f"{job_name}-network"


def runs_local_syncer(spec: DiLoCoJobSpec) -> bool:
    """False when the job points at a syncer run elsewhere (syncer.endpoint or, sharded,
    syncer.shardEndpoints)."""
    return not spec.syncer.remote


def syncer_url(job: JobRef, spec: DiLoCoJobSpec) -> str:
    """The URL learners and the operator use: the remote endpoint or the in-cluster Service."""
    if spec.syncer.endpoint:
        return spec.syncer.endpoint.rstrip("/")
    if spec.syncer.shard_endpoints:
        return join_urls([url.rstrip("/") for url in spec.syncer.shard_endpoints])
    scheme = "https" if spec.syncer.tls.secret_name else "http"
    # Several shards: every shard's Service URL in shard order (api/sharding.py); the learners
    # route each fragment by it and the operator's client reads the shards as one syncer.
    return join_urls(
        [
            f"{scheme}://{syncer_name(job.name, shard)}.{job.namespace}.svc:{spec.syncer.port}"
            for shard in syncer_shards(spec)
        ]
    )


def ca_secret_name(spec: DiLoCoJobSpec) -> str | None:
    """Secret with ca.crt to verify the syncer: caSecretName, else the local TLS Secret."""
    return spec.syncer.tls.ca_secret_name or spec.syncer.tls.secret_name


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


def child_metadata(job: JobRef, name: str, lab: dict[str, str]) -> dict[str, Any]:
    """Metadata of a child: name, namespace, labels, empty annotations, owner reference."""
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": dict(lab),
        "annotations": {},
        "ownerReferences": [owner_reference(job)],
    }


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Record the hash of the object's desired content in its own annotations."""
    obj["metadata"]["annotations"].pop(SPEC_HASH, None)
    obj["metadata"]["annotations"][SPEC_HASH] = content_hash(obj)
    return obj
