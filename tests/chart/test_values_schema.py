"""values.schema.json: wrong values fail `helm template` with the schema's message."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from .helm_tool import CHART

SCHEMA_ERROR = "values don't meet the specifications of the schema"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"operator": {"replicaCount": "two"}},
            "at '/operator/replicaCount': got string, want integer",
        ),
        ({"operator": {"replicaCount": 2}}, "at '/operator/replicaCount': maximum: got 2, want 1"),
        ({"operator": {"resources": "big"}}, "at '/operator/resources': got string, want object"),
        (
            {"operator": {"resources": {"limits": {"memory": "lots"}}}},
            "at '/operator/resources/limits/memory'",
        ),
        (
            {"operator": {"resources": {"limit": {"memory": "1Gi"}}}},
            "at '/operator/resources': additional properties 'limit' not allowed",
        ),
        (
            {"operator": {"replicas": 1}},
            "at '/operator': additional properties 'replicas' not allowed",
        ),
        (
            {"rbac": {"scope": "everywhere"}},
            "at '/rbac/scope': value must be one of 'cluster', 'namespace'",
        ),
        ({"watchNamespaces": "team-a"}, "at '/watchNamespaces': got string, want array"),
        (
            {"watchNamespaces": ["Team_A"]},
            "at '/watchNamespaces/0': 'Team_A' does not match pattern",
        ),
        ({"watchNamespaces": ["a", "a"]}, "at '/watchNamespaces'"),
        ({"operator": {"healthPort": 70000}}, "at '/operator/healthPort': maximum"),
        ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy': value must be one of"),
        ({"image": {"digest": "latest"}}, "at '/image/digest'"),
        (
            {"metrics": {"serviceMonitor": {"interval": "often"}}},
            "at '/metrics/serviceMonitor/interval'",
        ),
        ({"metrics": {"serviceMonitor": {"enabled": "yes"}}}, "got string, want boolean"),
        ({"replicaCount": 1}, "additional properties 'replicaCount' not allowed"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else "",
)
def test_values_schema_should_refuse_with_field_named_when_value_wrong(
    render_error: Callable[..., str], values: dict[str, Any], message: str
) -> None:
    error = render_error(values)
    assert SCHEMA_ERROR in error, error
    assert message in error, error


def test_values_schema_should_be_strict_draft07_when_read() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"

    def walk(node: dict[str, Any], path: str) -> None:
        # Every object of our own values is closed; Kubernetes objects passed through are open.
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False or path.endswith(("Probe", "env")), (
                f"{path} accepts unknown keys"
            )
        for key, child in node.get("properties", {}).items():
            assert "description" in child, f"{path}.{key} has no description"
            walk(child, f"{path}.{key}")

    walk(schema, "values")
