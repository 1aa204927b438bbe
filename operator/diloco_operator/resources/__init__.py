"""Pure builders: a DiLoCoJob's spec -> the Kubernetes objects it owns (plain dicts).

Nothing here talks to the API server. Every builder is a function of the job's identity and its
parsed spec, so the reconciler can run it any number of times and compare the result with what
exists (by the `diloco.dev/spec-hash` annotation each child carries).

One module per child kind: `config` (the spec ConfigMap, the token Secret), `islands` (an
island's StatefulSet and headless Service), `syncer` (the syncer's Deployment and Service, one
of each per shard); what they share lives in `naming` (names, labels, owner references) and
`pods` (pod template pieces and the restart discipline). This package re-exports the names its
users need.
"""

from __future__ import annotations

from typing import Any

from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.resources.config import build_config_map, build_token_secret
from diloco_operator.resources.islands import (
    build_island_service,
    build_island_statefulset,
    build_learner_pod_template,
)
from diloco_operator.resources.naming import (
    COMPONENT_CONFIG,
    COMPONENT_CREDENTIALS,
    COMPONENT_ISLAND,
    COMPONENT_LABEL,
    COMPONENT_LEARNER,
    COMPONENT_SYNCER,
    COMPONENT_TOKEN,
    CONFIG_HASH,
    CREDENTIAL_HASH,
    ISLAND_LABEL,
    JOB_LABEL,
    MANAGER,
    POD_INDEX_LABEL,
    ROTATE_CREDENTIALS,
    SHARD_LABEL,
    SPEC_HASH,
    TEMPLATE_HASH,
    JobRef,
    ca_secret_name,
    config_map_name,
    content_hash,
    generated_token_secret_name,
    island_names,
    island_statefulset_name,
    island_tokens_secret_name,
    labels,
    network_policy_name,
    owner_reference,
    runs_local_syncer,
    syncer_name,
    syncer_shards,
    syncer_url,
    token_secret_name,
)
from diloco_operator.resources.placement import island_replicas_by_name
from diloco_operator.resources.pods import (
    LEARNER_CONFIG_FIELDS,
    SYNCER_IGNORED_FIELDS,
    learner_config_hash,
    merge_overrides,
    syncer_config_hash,
)
from diloco_operator.resources.security import (
    NetworkOptions,
    build_island_tokens_secret,
    build_network_policy,
    secure_workload,
    wants_network_policy,
)
from diloco_operator.resources.syncer import (
    build_syncer_deployment,
    build_syncer_pod_template,
    build_syncer_service,
)

__all__ = [
    "COMPONENT_CONFIG",
    "COMPONENT_CREDENTIALS",
    "COMPONENT_ISLAND",
    "COMPONENT_LABEL",
    "COMPONENT_LEARNER",
    "COMPONENT_SYNCER",
    "COMPONENT_TOKEN",
    "CONFIG_HASH",
    "CREDENTIAL_HASH",
    "ISLAND_LABEL",
    "JOB_LABEL",
    "LEARNER_CONFIG_FIELDS",
    "MANAGER",
    "POD_INDEX_LABEL",
    "ROTATE_CREDENTIALS",
    "SHARD_LABEL",
    "SPEC_HASH",
    "SYNCER_IGNORED_FIELDS",
    "TEMPLATE_HASH",
    "JobRef",
    "NetworkOptions",
    "build_children",
    "build_config_map",
    "build_island_service",
    "build_island_statefulset",
    "build_island_tokens_secret",
    "build_learner_pod_template",
    "build_network_policy",
    "build_syncer_deployment",
    "build_syncer_pod_template",
    "build_syncer_service",
    "build_token_secret",
    "ca_secret_name",
    "child_keys",
    "config_map_name",
    "content_hash",
    "generated_token_secret_name",
    "island_names",
    "island_replicas_by_name",
    "island_statefulset_name",
    "island_tokens_secret_name",
    "labels",
    "learner_config_hash",
    "merge_overrides",
    "network_policy_name",
    "owner_reference",
    "runs_local_syncer",
    "syncer_config_hash",
    "syncer_name",
    "syncer_shards",
    "syncer_url",
    "token_secret_name",
]


def build_children(
    job: JobRef,
    spec: DiLoCoJobSpec,
    *,
    islands_running: bool,
    credential: str = "",
    network: NetworkOptions | None = None,
) -> list[dict[str, Any]]:
    """Every child the job should have except its Secrets (security.py and sync.py: the token
    Secret is create-only, the island credentials are never listed).

    `islands_running` is False while the job is suspended or finished: islands scale to zero but
    keep their StatefulSets, so resuming brings back the same names (a Kueue-queued job's are
    then left out altogether: queueing.queued_children says why). `credential` is the
    fingerprint of the job's credential (pods restart when it changes); with `network`, the
    job's NetworkPolicy is among the children when both the operator and the job want one.
    """
    children = [build_config_map(job, spec)]
    if runs_local_syncer(spec):
        for shard in syncer_shards(spec):  # [None]: the one syncer, unsharded names
            children.append(build_syncer_deployment(job, spec, shard))
            children.append(build_syncer_service(job, spec, shard))
    for index in range(spec.islands.count):
        children.append(build_island_service(job, spec, index))
        children.append(build_island_statefulset(job, spec, index, running=islands_running))
    if network is not None and wants_network_policy(spec, network):
        children.append(build_network_policy(job, spec, network))
    return [secure_workload(job, child, credential) for child in children]


def child_keys(
    job: JobRef, spec: DiLoCoJobSpec, *, network: NetworkOptions | None = None
) -> list[tuple[str, str]]:
    """(kind, name) of every child build_children returns, in its order, without building them
    (a job's first reconcile reads these names while its credential is still being made)."""
    keys = [("ConfigMap", config_map_name(job.name))]
    if runs_local_syncer(spec):
        for shard in syncer_shards(spec):
            name = syncer_name(job.name, shard)
            keys += [("Deployment", name), ("Service", name)]
    for island in island_names(spec):
        name = island_statefulset_name(job.name, island)
        keys += [("Service", name), ("StatefulSet", name)]
    if network is not None and wants_network_policy(spec, network):
        keys.append(("NetworkPolicy", network_policy_name(job.name)))
    return keys
