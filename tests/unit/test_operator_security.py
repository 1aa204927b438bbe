"""What keeps a job's pods to themselves (resources/security.py): each pod's own credential, no
ServiceAccount token, a read-only root filesystem, and the job's NetworkPolicy."""

from __future__ import annotations

import base64
from typing import Any

from diloco_operator import api, resources
from diloco_operator.resources import JobRef, NetworkOptions
from diloco_trainer.api import contract, credentials
from diloco_trainer.api.credentials import Issuer

JOB = JobRef(name="demo", namespace="ns1", uid="uid-1")
ROOT = "root-token-of-the-demo-job-0123456789"
OPERATOR = NetworkOptions(
    enabled=True,
    operator_namespace="diloco-system",
    operator_labels={"app.kubernetes.io/name": "diloco-operator"},
)


def _spec(**overrides: Any) -> api.DiLoCoJobSpec:
    return api.parse_job_spec({"image": "trainer:1", "islands": {"count": 2}, **overrides})


def _children(spec: api.DiLoCoJobSpec, **kw: Any) -> dict[tuple[str, str], dict[str, Any]]:
    built = resources.build_children(JOB, spec, islands_running=True, **kw)
    return {(c["kind"], c["metadata"]["name"]): c for c in built}


def _pod(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def test_operator_security_pods_get_no_service_account_token_and_a_read_only_root() -> None:
    kids = _children(_spec())
    for key in (("StatefulSet", "demo-island-0"), ("Deployment", "demo-syncer")):
        pod = _pod(kids[key])
        assert pod["automountServiceAccountToken"] is False, key
        (container,) = pod["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, key
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        # Writable: /tmp (HOME in the image: caches) and the state dir (checkpoints, scratch).
        for path in ("/tmp", contract.STATE_MOUNT):
            assert (
                "emptyDir" in volumes[mounts[path]]
                or "persistentVolumeClaim" in volumes[mounts[path]]
            ), (key, path)
        read_only = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
        assert {contract.TOKEN_MOUNT, contract.CONFIG_MOUNT} <= read_only


def test_operator_security_learners_mount_only_their_islands_credential() -> None:
    kids = _children(_spec())
    for index in range(2):
        pod = _pod(kids[("StatefulSet", f"demo-island-{index}")])
        token = next(v for v in pod["volumes"] if v["name"] == "token")
        assert token == {
            "name": "token",
            "secret": {
                "secretName": "demo-island-tokens",
                "items": [{"key": f"island-{index}", "path": contract.TOKEN_KEY}],
            },
        }
    syncer = _pod(kids[("Deployment", "demo-syncer")])
    token = next(v for v in syncer["volumes"] if v["name"] == "token")
    assert token["secret"] == {"secretName": "demo-token"}  # the root: the syncer only


def test_operator_security_user_template_may_turn_hardening_off_explicitly() -> None:
    template = {
        "spec": {
            "automountServiceAccountToken": True,
            "containers": [
                {"name": "learner", "securityContext": {"readOnlyRootFilesystem": False}}
            ],
        }
    }
    kids = _children(_spec(islands={"count": 1, "template": template}))
    pod = _pod(kids[("StatefulSet", "demo-island-0")])
    assert pod["automountServiceAccountToken"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False


def test_operator_security_credential_fingerprint_rolls_every_pod() -> None:
    spec = _spec()
    first = _children(spec, credential=Issuer.of(ROOT).fingerprint())
    again = _children(spec, credential=Issuer.of(ROOT).fingerprint())
    rotated = _children(spec, credential=Issuer.of(ROOT + "-rotated").fingerprint())
    for key in (("StatefulSet", "demo-island-0"), ("Deployment", "demo-syncer")):
        annotations = first[key]["spec"]["template"]["metadata"]["annotations"]
        assert annotations[resources.CREDENTIAL_HASH] == Issuer.of(ROOT).fingerprint()
        spec_hash = first[key]["metadata"]["annotations"][resources.SPEC_HASH]
        assert spec_hash == again[key]["metadata"]["annotations"][resources.SPEC_HASH]
        assert spec_hash != rotated[key]["metadata"]["annotations"][resources.SPEC_HASH]
    sts = ("StatefulSet", "demo-island-0")
    hashes = [k[sts]["metadata"]["annotations"][resources.TEMPLATE_HASH] for k in (first, rotated)]
    assert hashes[0] != hashes[1]  # the planner rolls islands by this hash
    assert ROOT not in str(first)


def test_operator_security_island_tokens_secret_holds_each_islands_own() -> None:
    spec = _spec(islands={"count": 2, "namePrefix": "eu"})
    region = Issuer.of(credentials.region_token(ROOT, "eu"))
    secret = resources.build_island_tokens_secret(JOB, spec, region)
    assert secret["metadata"]["name"] == "demo-island-tokens"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data == {
        "eu-island-0": credentials.island_token(ROOT, "eu-island-0"),
        "eu-island-1": credentials.island_token(ROOT, "eu-island-1"),
    }
    for island, token in data.items():
        assert credentials.verify(ROOT, token) == credentials.Principal("island", island)


def _rules(policy: dict[str, Any]) -> list[tuple[list[dict[str, Any]] | None, set[int]]]:
    # None for "any port" (a rule without ports).
    return [
        (r.get("from"), {p["port"] for p in r["ports"]} if "ports" in r else None)
        for r in policy["spec"]["ingress"]
    ]


def test_operator_security_network_policy_admits_the_job_and_the_operator_only() -> None:
    kids = _children(_spec(), network=OPERATOR)
    policy = kids[("NetworkPolicy", "demo-network")]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"diloco.dev/job": "demo"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    own = [{"podSelector": {"matchLabels": {"diloco.dev/job": "demo"}}}]
    operator = [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "diloco-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "diloco-operator"}},
        }
    ]
    # The job's own pods on any port (DDP's rank-to-rank connections use run-time ports); the
    # operator on the syncer port only.
    assert _rules(policy) == [(own, None), (operator, {8470})]


def test_operator_security_network_policy_opens_an_exposed_syncer_port_only() -> None:
    spec = _spec(
        syncer={"port": 9000, "service": {"type": "LoadBalancer"}, "tls": {"secretName": "t"}}
    )
    policy = _children(spec, network=OPERATOR)[("NetworkPolicy", "demo-network")]
    rules = _rules(policy)
    assert (None, {9000}) in rules  # anyone, syncer port only: TLS and credentials guard it
    assert all(
        ports is not None and contract.DEFAULT_MASTER_PORT not in ports
        for src, ports in rules
        if src is None
    )


def test_operator_security_network_policy_off_by_job_or_operator() -> None:
    assert ("NetworkPolicy", "demo-network") not in _children(
        _spec(networkPolicy={"enabled": False}), network=OPERATOR
    )
    assert ("NetworkPolicy", "demo-network") not in _children(
        _spec(), network=NetworkOptions(enabled=False)
    )
    assert ("NetworkPolicy", "demo-network") in _children(_spec(), network=NetworkOptions())
