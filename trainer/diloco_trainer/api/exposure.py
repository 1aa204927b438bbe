"""Who can reach a job's syncer, and over what (torch-free; part of the job spec).

TLS is required wherever the credentials would cross a network the cluster does not control: a
syncer Service of type LoadBalancer or NodePort must serve HTTPS (syncer.tls.secretName), and a
remote syncer.endpoint must be https:// unless it is on loopback or a cluster-internal Service
name (`*.svc`, `*.svc.cluster.local`), or syncer.tls.allowInsecureEndpoint says otherwise. An
endpoint is an origin only (scheme, host, port): the operator and the learners call the syncer's
API paths on it and nothing else. The CRD says the same in CEL (operator/diloco_operator/crd.py),
so the API server refuses such a manifest with the field named.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from diloco_trainer.api.base import SpecModel

ServiceType = Literal["ClusterIP", "LoadBalancer", "NodePort"]
EXTERNAL_SERVICE_TYPES = ("LoadBalancer", "NodePort")

# scheme://host[:port][/]: a DNS name (underscores allowed: placeholders, some DNS records) or an
# IPv4 address, or an IPv6 address in brackets; no user info, path, query or fragment.
ENDPOINT_PATTERN = (
    r"^(https?://([A-Za-z0-9_]([-A-Za-z0-9_.]*[A-Za-z0-9_])?|\[[0-9A-Fa-f:.]+\])"
    r"(:[0-9]{1,5})?/?)?$"
)
# Plain http:// stays inside the machine or the cluster network at these hosts.
INTERNAL_HTTP_PATTERN = (
    r"^http://(localhost|127\.[0-9.]+|\[::1\]|[A-Za-z0-9.-]+\.svc(\.cluster\.local)?)"
    r"(:[0-9]{1,5})?/?$"
)
_INTERNAL_HTTP = re.compile(INTERNAL_HTTP_PATTERN)


class ServiceSpec(SpecModel):
    """How the syncer is exposed."""

    type: ServiceType = Field(
        "ClusterIP",
        description="Kubernetes Service type of the syncer. LoadBalancer and NodePort reach "
        "outside the cluster: they need syncer.tls.secretName.",
    )


class TLSSpec(SpecModel):
    """TLS for the syncer."""

    secret_name: str | None = Field(
        None, description="kubernetes.io/tls Secret: the syncer serves HTTPS with it."
    )
    ca_secret_name: str | None = Field(
        None, description="Secret with ca.crt that learners use to verify the syncer."
    )
    allow_insecure_endpoint: bool = Field(
        False,
        description="Allow an http:// syncer.endpoint outside loopback and the cluster's own "
        "Service names: the learners' and the operator's credentials then cross the network in "
        "clear. Only for networks that are private end to end.",
    )


class NetworkPolicySpec(SpecModel):
    """A NetworkPolicy the operator keeps beside the job's pods."""

    enabled: bool = Field(
        True,
        description="Let only the job's own pods and the operator reach the syncer port and the "
        "islands' DDP port (and anyone the syncer port, when its Service is a LoadBalancer or "
        "NodePort). Also needs the operator's networkPolicy.enabled (chart value).",
    )


def endpoint_is_internal(endpoint: str) -> bool:
    """Whether an http:// endpoint stays on loopback or inside the cluster's network."""
    return bool(_INTERNAL_HTTP.match(endpoint))


def exposure_problem(endpoint: str, service_type: str, tls: TLSSpec) -> str | None:
    """Why this exposure of the syncer is refused (naming the field), or None."""
    if service_type in EXTERNAL_SERVICE_TYPES and not endpoint and not tls.secret_name:
        return (
            f"syncer.service.type {service_type} reaches outside the cluster: set "
            "syncer.tls.secretName so the syncer serves HTTPS"
        )
    insecure = endpoint.startswith("http://") and not endpoint_is_internal(endpoint)
    if insecure and not tls.allow_insecure_endpoint:
        return (
            "syncer.endpoint must be https:// (credentials would cross the network in clear), "
            "or set syncer.tls.allowInsecureEndpoint"
        )
    return None
