"""The files a job's pods mount: the spec ConfigMap and the generated token Secret (pure)."""

from __future__ import annotations

from typing import Any

from diloco_trainer.api import contract

from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.resources.naming import (
    COMPONENT_CONFIG,
    COMPONENT_TOKEN,
    JobRef,
    child_metadata,
    config_map_name,
    generated_token_secret_name,
    labels,
    stamp,
)


def build_config_map(job: JobRef, spec: DiLoCoJobSpec) -> dict[str, Any]:
    """`NAME-config`: the whole spec as the JSON the trainer reads (contract.CONFIG_KEY)."""
    return stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": child_metadata(
                job, config_map_name(job.name), labels(job.name, COMPONENT_CONFIG)
            ),
            "data": {contract.CONFIG_KEY: spec.to_json()},
        }
    )


def build_token_secret(job: JobRef, token: str) -> dict[str, Any]:
    """`NAME-token`: the generated bearer token. Created once, never overwritten."""
    return stamp(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": child_metadata(
                job, generated_token_secret_name(job.name), labels(job.name, COMPONENT_TOKEN)
            ),
            "type": "Opaque",
            "stringData": {contract.TOKEN_KEY: token},
        }
    )
