"""The operator's NetworkPolicy options from its environment (options.py)."""

from __future__ import annotations

import pytest
from diloco_operator.options import OptionsError, network_options
from diloco_operator.resources import NetworkOptions


def test_operator_options_default_on_without_an_operator_rule() -> None:
    assert network_options({}) == NetworkOptions(enabled=True)


def test_operator_options_from_the_charts_environment() -> None:
    env = {
        "DILOCO_OPERATOR_NETWORK_POLICIES": "false",
        "DILOCO_OPERATOR_NAMESPACE": "diloco-system",
        "DILOCO_OPERATOR_POD_LABELS": "app.kubernetes.io/name=diloco-operator, a=b",
    }
    assert network_options(env) == NetworkOptions(
        enabled=False,
        operator_namespace="diloco-system",
        operator_labels={"app.kubernetes.io/name": "diloco-operator", "a": "b"},
    )


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"DILOCO_OPERATOR_NETWORK_POLICIES": "maybe"}, "DILOCO_OPERATOR_NETWORK_POLICIES"),
        ({"DILOCO_OPERATOR_POD_LABELS": "app"}, "DILOCO_OPERATOR_POD_LABELS"),
    ],
)
def test_operator_options_refuse_what_they_cannot_read(env: dict[str, str], named: str) -> None:
    with pytest.raises(OptionsError, match=named):
        network_options(env)
