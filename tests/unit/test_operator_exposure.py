"""TLS wherever the credentials would leave the cluster, and endpoints that are origins only
(api/exposure.py; the CRD's CEL rules say the same, tests/cluster/test_security.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from diloco_operator import crd
from diloco_trainer.api.exposure import ENDPOINT_PATTERN, endpoint_is_internal
from diloco_trainer.api.spec import ConfigError, parse_spec


def _syncer(**syncer: Any) -> dict[str, Any]:
    return {"syncer": syncer, "islands": {"count": 1}, "sync": {"quorum": 1}}


@pytest.mark.parametrize(
    ("syncer", "field"),
    [
        ({"service": {"type": "LoadBalancer"}}, "syncer.tls.secretName"),
        ({"service": {"type": "NodePort"}}, "syncer.tls.secretName"),
        ({"endpoint": "http://syncer.example.com:8470"}, "syncer.tls.allowInsecureEndpoint"),
        ({"endpoint": "http://10.0.0.7:8470"}, "syncer.endpoint"),
        ({"endpoint": "https://syncer.example.com/internal/admin?x="}, "spec.syncer.endpoint"),
        ({"endpoint": "https://user:pw@syncer.example.com"}, "spec.syncer.endpoint"),
    ],
)
def test_operator_exposure_refuses_insecure_or_odd_syncers(
    syncer: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        parse_spec(_syncer(**syncer))


@pytest.mark.parametrize(
    "syncer",
    [
        {"service": {"type": "LoadBalancer"}, "tls": {"secretName": "syncer-tls"}},
        {"service": {"type": "ClusterIP"}},
        {"endpoint": "https://syncer.example.com:8470"},
        {"endpoint": "https://[2001:db8::1]:8470/"},
        {"endpoint": "https://SYNCER_ADDRESS:8470"},  # examples/multi-region's placeholder
        {"endpoint": "http://127.0.0.1:9"},
        {"endpoint": "http://job-syncer.team-a.svc:8470"},
        {"endpoint": "http://job-syncer.team-a.svc.cluster.local:8470"},
        {"endpoint": "http://10.0.0.7:8470", "tls": {"allowInsecureEndpoint": True}},
    ],
)
def test_operator_exposure_accepts_tls_internal_or_explicitly_insecure(
    syncer: dict[str, Any],
) -> None:
    parse_spec(_syncer(**syncer))


def test_operator_exposure_internal_hosts_are_loopback_and_cluster_services_only() -> None:
    assert endpoint_is_internal("http://localhost:1") and endpoint_is_internal("http://[::1]:2")
    for outside in ("http://svc.example.com", "http://a.svc.example.com", "http://10.1.2.3"):
        assert not endpoint_is_internal(outside), outside
    assert re.match(ENDPOINT_PATTERN, "")  # unset: the job runs its own syncer


def _syncer_rules() -> list[dict[str, str]]:
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return list(schema["properties"]["spec"]["properties"]["syncer"]["x-kubernetes-validations"])


def test_operator_exposure_crd_rules_name_the_fields() -> None:
    rules = {r["message"]: r for r in _syncer_rules()}
    tls = next(r for m, r in rules.items() if "LoadBalancer and NodePort" in m)
    assert tls["fieldPath"] == ".service.type" and "spec.syncer.tls.secretName" in tls["message"]
    insecure = next(r for m, r in rules.items() if "must be https://" in m)
    assert insecure["fieldPath"] == ".endpoint"
    assert "spec.syncer.tls.allowInsecureEndpoint" in insecure["message"]
    assert "\\\\.svc" in insecure["rule"]  # the pattern's backslashes survive as a CEL literal
