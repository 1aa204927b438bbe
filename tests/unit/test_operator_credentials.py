"""The job's credentials in the cluster (operator credential_secrets.py): the generated root, its
rotation, a user's root or region credential, and what the operator calls the syncer with."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from diloco_operator import resources
from diloco_operator.api import parse_job_spec
from diloco_operator.credential_secrets import ensure_credentials, job_issuer, read_credential
from diloco_operator.kube import Kube
from diloco_operator.resources import JobRef
from diloco_operator.runtime import JobRuntime
from diloco_trainer.api import credentials
from diloco_trainer.api.credentials import ADMIN, CredentialError, Principal

from .operator_fakes import FakeKube, job_body

JOB = JobRef(name="demo", namespace="ns1", uid="uid-1")
ROOT = "a-user-made-root-token-0123456789"


def _setup(**spec: Any) -> tuple[FakeKube, JobRuntime]:
    body = job_body(**spec)
    kube = FakeKube(body)
    rt = JobRuntime(namespace="ns1", name="demo")
    asyncio.run(rt.see_job(body))
    return kube, rt


def _ensure(kube: FakeKube, rt: JobRuntime) -> tuple[str, Any]:
    spec = parse_job_spec((rt.body or {})["spec"])
    return asyncio.run(ensure_credentials(cast(Kube, kube), rt, JOB, spec))


def _island_tokens(kube: FakeKube) -> dict[str, str]:
    return dict(kube.secrets["demo-island-tokens"]["data"])


def _root(kube: FakeKube) -> str:
    return str(kube.secrets["demo-token"]["data"]["token"])


def test_operator_credentials_generated_root_derives_the_islands() -> None:
    kube, rt = _setup(syncer={})
    fingerprint, conflict = _ensure(kube, rt)
    root = _root(kube)
    assert conflict is None and len(root) >= 32 and fingerprint
    assert _island_tokens(kube) == {
        name: credentials.island_token(root, name) for name in ("island-0", "island-1")
    }
    assert rt.credentials.issuer is not None
    operator = rt.credentials.issuer.operator_token()
    assert credentials.verify(root, operator) == Principal(ADMIN)  # never the root itself


def test_operator_credentials_rotation_replaces_the_root_and_everything_derived() -> None:
    kube, rt = _setup(syncer={})
    before, _ = _ensure(kube, rt)
    old_root, old_islands = _root(kube), _island_tokens(kube)
    assert rt.body is not None
    rt.body["metadata"]["annotations"] = {resources.ROTATE_CREDENTIALS: "2025-01-01"}
    after, _ = _ensure(kube, rt)
    assert ("patch_secret", "demo-token") in kube.calls
    new_root = _root(kube)
    assert new_root != old_root and after != before
    annotations = kube.secrets["demo-token"]["metadata"]["annotations"]
    assert annotations[resources.ROTATE_CREDENTIALS] == "2025-01-01"
    islands = _island_tokens(kube)
    assert all(credentials.verify(new_root, t) for t in islands.values())
    assert not any(credentials.verify(new_root, t) for t in old_islands.values())
    kube.calls.clear()
    assert _ensure(kube, rt)[0] == after and kube.calls == []  # done once


def test_operator_credentials_user_region_credential_issues_its_prefix_only() -> None:
    region = credentials.region_token(ROOT, "eu")
    kube, rt = _setup(islands={"count": 1, "namePrefix": "eu"})
    kube.secrets["tok"] = {"metadata": {"name": "tok"}, "data": {"token": region}}
    _ensure(kube, rt)
    assert _island_tokens(kube) == {"eu-island-0": credentials.island_token(ROOT, "eu-island-0")}
    assert rt.credentials.issuer is not None
    assert rt.credentials.issuer.operator_token() == region
    assert ("patch_secret", "tok") not in kube.calls  # a user's Secret is never written


@pytest.mark.parametrize(
    ("token", "islands", "problem"),
    [
        (credentials.region_token(ROOT, "us"), {"count": 1, "namePrefix": "eu"}, "namePrefix"),
        (credentials.island_token(ROOT, "island-0"), {"count": 1}, "island credential"),
        ("", {"count": 1}, "not found"),
    ],
)
def test_operator_credentials_unusable_credential_is_reported_not_used(
    token: str, islands: dict[str, Any], problem: str
) -> None:
    kube, rt = _setup(islands=islands)
    if token:
        kube.secrets["tok"] = {"metadata": {"name": "tok"}, "data": {"token": token}}
    fingerprint, conflict = _ensure(kube, rt)
    assert (fingerprint, conflict) == ("", None)
    assert "demo-island-tokens" not in kube.secrets
    assert rt.credentials.reported is not None and problem in rt.credentials.reported


@pytest.mark.parametrize("token", [credentials.island_token(ROOT, "island-0"), ""])
def test_operator_credentials_no_issuer_from_an_island_credential_or_none(token: str) -> None:
    kube, rt = _setup(islands={"count": 1})
    if token:
        kube.secrets["tok"] = {"metadata": {"name": "tok"}, "data": {"token": token}}
    spec = parse_job_spec((rt.body or {})["spec"])
    with pytest.raises(CredentialError, match=r"token Secret tok[ :]"):
        asyncio.run(job_issuer(cast(Kube, kube), rt, JOB, spec))
    assert rt.credentials.issuer is None and rt.credentials.checked


def test_operator_credentials_island_tokens_secret_follows_scaling() -> None:
    kube, rt = _setup(syncer={})
    _ensure(kube, rt)
    assert rt.body is not None
    rt.body["spec"]["islands"]["count"] = 3
    _ensure(kube, rt)
    assert set(_island_tokens(kube)) == {"island-0", "island-1", "island-2"}
    rt.body["spec"]["islands"]["count"] = 1
    _ensure(kube, rt)
    assert set(_island_tokens(kube)) == {"island-0"}  # a removed island's credential goes


def test_operator_credentials_issuer_and_secret_read_beforehand_are_not_read_again() -> None:
    kube, rt = _setup(syncer={})
    spec = parse_job_spec((rt.body or {})["spec"])
    issuer = asyncio.run(read_credential(cast(Kube, kube), rt, JOB, spec))
    assert kube.methods() == ["create"]  # a job never synced: its token Secret created at once
    kube.calls.clear()
    fingerprint, conflict = asyncio.run(
        ensure_credentials(cast(Kube, kube), rt, JOB, spec, issuer=issuer, existing=None)
    )
    assert rt.credentials.issuer is not None and conflict is None
    assert fingerprint == rt.credentials.issuer.fingerprint()
    # Neither the token Secret nor the island Secret is read again: only the write remains.
    assert kube.calls == [("apply", "Secret/demo-island-tokens")]
    unusable = asyncio.run(
        ensure_credentials(
            cast(Kube, kube), rt, JOB, spec, issuer=CredentialError("token Secret x: bad")
        )
    )
    assert unusable == ("", None) and rt.credentials.reported == "token Secret x: bad"
