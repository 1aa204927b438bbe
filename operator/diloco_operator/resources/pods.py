"""Pieces shared by the learner and syncer pod templates, and what restarts them (pure).

Restart discipline: a learner pod's template carries only what running learners depend on.
`islands.count`, `suspend`, `stopAfter`, the outer optimizer and other syncer-side fields are left
out of it (the ConfigMap holds the whole spec, but pods read it only at start), so scaling or
suspending never rolls the pods of islands that stay. The config hashes below are the only spec
content that reaches a pod template's annotations.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from diloco_trainer.api import contract

from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.resources.naming import (
    JobRef,
    config_map_name,
    content_hash,
    token_secret_name,
)

LEARNER_CONTAINER = "learner"
SYNCER_CONTAINER = "syncer"
DIST_PORT_NAME = "dist"
SYNCER_PORT_NAME = "http"
# The syncer's probe listener (contract.SYNCER_HEALTH_PORT; syncer/edge/probe_listener.py): the
# kubelet's probes there cannot queue behind a flood of the syncer port.
SYNCER_PROBE_PORT_NAME = "probes"
# The trainer image's user (the Dockerfile's USER 65532:65532, distroless "nonroot"): a
# volume prepared for the image's user (a hostPath, a pre-provisioned disk: fsGroup does not
# reach those) is writable by the job's pods only when they run as that same uid.
RUN_AS_USER = 65532

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


def env_var(name: str, value: str | int) -> dict[str, Any]:
    """A plain `{name, value}` container environment entry."""
    return {"name": name, "value": str(value)}


def pod_security_context() -> dict[str, Any]:
    """Non-root, RuntimeDefault seccomp: what every pod of a job runs with."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """No privilege escalation, every capability dropped."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def common_volumes(job: JobRef, spec: DiLoCoJobSpec) -> list[dict[str, Any]]:
    """The config and token volumes every pod of the job mounts."""
    return [
        {"name": "config", "configMap": {"name": config_map_name(job.name)}},
        {"name": "token", "secret": {"secretName": token_secret_name(job.name, spec)}},
    ]


def common_mounts() -> list[dict[str, Any]]:
    """Mounts of the config, token and state volumes at the contract's paths."""
    return [
        {"name": "config", "mountPath": contract.CONFIG_MOUNT, "readOnly": True},
        {"name": "token", "mountPath": contract.TOKEN_MOUNT, "readOnly": True},
        {"name": "state", "mountPath": contract.STATE_MOUNT},
    ]


def file_env() -> list[dict[str, Any]]:
    """Environment naming the mounted token, config and state paths."""
    return [
        env_var(contract.TOKEN_FILE, f"{contract.TOKEN_MOUNT}/{contract.TOKEN_KEY}"),
        env_var(contract.CONFIG_FILE, f"{contract.CONFIG_MOUNT}/{contract.CONFIG_KEY}"),
        env_var(contract.STATE_DIR, contract.STATE_MOUNT),
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
