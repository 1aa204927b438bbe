"""The operator's own options that the chart sets through its environment (pure parsing).

- DILOCO_OPERATOR_NETWORK_POLICIES: "false" keeps the operator from creating NetworkPolicies
  (chart value networkPolicy.enabled; default true). A job can also opt out on its own
  (spec.networkPolicy.enabled).
- DILOCO_OPERATOR_NAMESPACE and DILOCO_OPERATOR_POD_LABELS ("k=v,k=v"): where the operator's
  pods run and their labels, so a job's NetworkPolicy lets them reach the syncer. Unset (the
  operator runs outside the cluster), no rule for the operator is written.
"""

from __future__ import annotations

from collections.abc import Mapping

from diloco_operator.resources import NetworkOptions

NETWORK_POLICIES = "DILOCO_OPERATOR_NETWORK_POLICIES"
OPERATOR_NAMESPACE = "DILOCO_OPERATOR_NAMESPACE"
OPERATOR_POD_LABELS = "DILOCO_OPERATOR_POD_LABELS"


class OptionsError(ValueError):
    """An option the operator cannot use; the message names the variable."""


def parse_labels(raw: str) -> dict[str, str]:
    """'k=v,k2=v2' -> {k: v, k2: v2}; OptionsError on an entry without '='."""
    labels: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in raw.split(","))):
        name, sep, value = entry.partition("=")
        if not sep or not name:
            raise OptionsError(f"{OPERATOR_POD_LABELS}: {entry!r} is not name=value")
        labels[name.strip()] = value.strip()
    return labels


def network_options(env: Mapping[str, str]) -> NetworkOptions:
    """The NetworkPolicy options from the operator's environment."""
    enabled = env.get(NETWORK_POLICIES, "true").strip().lower()
    if enabled not in ("true", "false", "1", "0", ""):
        raise OptionsError(f"{NETWORK_POLICIES} must be true or false, got {enabled!r}")
    return NetworkOptions(
        enabled=enabled in ("true", "1", ""),
        operator_namespace=env.get(OPERATOR_NAMESPACE, "").strip(),
        operator_labels=parse_labels(env.get(OPERATOR_POD_LABELS, "")),
    )
