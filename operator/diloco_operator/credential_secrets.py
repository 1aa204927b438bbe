"""A job's credentials in the cluster (api/credentials.py says what each one may do).

- The token Secret (`NAME-token`, generated with 32 random bytes, or the user's
  spec.syncer.tokenSecretName) holds the job's credential: the root token in the syncer's cluster,
  or a region credential in another cluster of a multi-region job. Only the syncer pod mounts it;
  the operator reads it once per resync (and after a failed syncer call) and derives the rest.
- The island credentials Secret (`NAME-island-tokens`) holds one key per island; each learner pod
  mounts only its own island's key (resources/security.py).
- The operator calls the syncer with the admin credential (from a root) or the region credential
  itself: never as an island.

Rotation: set (or change) the annotation `diloco.dev/rotate-credentials` on the DiLoCoJob. The
operator gives a generated token Secret a new root token and records the annotation's value on
it; a user's token Secret is rotated by the user (the operator reads it again on its next resync,
or at once after changing the annotation). Either way the island credentials follow, and the
syncer and learner pods carry the credential's fingerprint, so they restart with the new ones.
"""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Mapping
from typing import Any

from diloco_trainer.api import contract
from diloco_trainer.api.credentials import CredentialError, Issuer

from diloco_operator import metrics, resources
from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.children import UNREAD, Conflict, write_child
from diloco_operator.events import post_event
from diloco_operator.kube import Kube
from diloco_operator.planner import owned_by
from diloco_operator.resources import JobRef
from diloco_operator.runtime import JobRuntime

log = logging.getLogger("diloco_operator")


def rotation_requested(body: Mapping[str, Any]) -> str:
    """The value of the job's rotate-credentials annotation ('' when unset)."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(resources.ROTATE_CREDENTIALS, ""))


def rotation_done(secret: Mapping[str, Any]) -> str:
    """The rotation value the generated token Secret was made for."""
    annotations = (secret.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(resources.ROTATE_CREDENTIALS, ""))


def new_root() -> str:
    """A fresh root token: 32 random bytes, URL-safe."""
    return secrets.token_urlsafe(32)


async def _generated_secret(
    kube: Kube, rt: JobRuntime, job: JobRef, name: str
) -> dict[str, Any] | None:
    """The generated token Secret: created when missing, rotated when the job asks for it.

    A job without a status was never synced, so its Secret is almost surely missing: it is
    created first (a create that finds one costs what a read does), one round trip less for
    each new job.
    """
    wanted = rotation_requested(rt.body or {})
    never_synced = not (rt.body or {}).get("status")
    secret = None if never_synced else await kube.read_secret(job.namespace, name)
    if secret is None:
        token = new_root()
        body = resources.build_token_secret(job, token)
        body["metadata"]["annotations"][resources.ROTATE_CREDENTIALS] = wanted
        created = await kube.create(body)
        if created is not None:
            metrics.CHILD_CHANGES.labels(action="create", kind="Secret").inc()
            # What was just written, without reading it back.
            return {**created, "data": {contract.TOKEN_KEY: token}}
        secret = await kube.read_secret(job.namespace, name)  # it exists: use what is stored
        if secret is None:
            return None
    if rotation_done(secret) != wanted and owned_by(secret, job.uid):
        token = new_root()
        patch = {
            "metadata": {"annotations": {resources.ROTATE_CREDENTIALS: wanted}},
            "data": {contract.TOKEN_KEY: base64.b64encode(token.encode()).decode()},
        }
        await kube.patch_secret(job.namespace, name, patch)
        metrics.CHILD_CHANGES.labels(action="rotate", kind="Secret").inc()
        post_event(rt.body or {}, "Normal", "CredentialsRotated", f"new root token in {name}")
        return {**secret, "data": {**secret.get("data", {}), contract.TOKEN_KEY: token}}
    return secret


async def job_issuer(kube: Kube, rt: JobRuntime, job: JobRef, spec: DiLoCoJobSpec) -> Issuer:
    """The job's issuer (root or region credential), read once per resync; CredentialError
    (its message names the Secret) when there is none to use."""
    creds = rt.credentials
    if creds.checked:
        if creds.issuer is None:
            raise CredentialError(creds.error or "no credential")
        return creds.issuer
    name = resources.token_secret_name(job.name, spec)
    if spec.syncer.token_secret_name:
        secret = await kube.read_secret(job.namespace, name)
    else:
        secret = await _generated_secret(kube, rt, job, name)
    token = ((secret or {}).get("data") or {}).get(contract.TOKEN_KEY, "").strip()
    creds.checked, creds.issuer, creds.error = True, None, None
    try:
        if not token:
            raise CredentialError(f"token Secret {name} (key {contract.TOKEN_KEY}) not found")
        creds.issuer = Issuer.of(token)
    except CredentialError as err:
        named = str(err).startswith(f"token Secret {name} ")
        creds.error = str(err) if named else f"token Secret {name}: {err}"
        raise CredentialError(creds.error) from None
    creds.rotation = rotation_requested(rt.body or {})
    return creds.issuer


async def read_credential(
    kube: Kube, rt: JobRuntime, job: JobRef, spec: DiLoCoJobSpec
) -> Issuer | CredentialError:
    """The job's issuer (job_issuer, read again when the job asked for a rotation since), or
    why there is none."""
    creds = rt.credentials
    if creds.checked and creds.rotation != rotation_requested(rt.body or {}):
        creds.checked = False  # the job asked for a rotation since the last read
    try:
        return await job_issuer(kube, rt, job, spec)
    except CredentialError as err:
        return err


async def ensure_credentials(
    kube: Kube,
    rt: JobRuntime,
    job: JobRef,
    spec: DiLoCoJobSpec,
    *,
    issuer: Issuer | CredentialError | None = None,
    existing: Any = UNREAD,
) -> tuple[str, Conflict | None]:
    """Read the job's credential and write the island credentials Secret when it changed; the
    fingerprint for the pod templates ('' without a credential) and a name conflict, if any.

    `issuer`: what read_credential answered just before (then it is not read again);
    `existing`: the island credentials Secret as read just before (children.write_child).
    """
    creds = rt.credentials
    if issuer is None:
        issuer = await read_credential(kube, rt, job, spec)
    try:
        if isinstance(issuer, CredentialError):
            raise issuer
        secret = resources.build_island_tokens_secret(job, spec, issuer)
    except CredentialError as err:
        if creds.reported != str(err):
            creds.reported = str(err)
            post_event(rt.body or {}, "Warning", "InvalidCredentials", str(err))
        return "", None
    creds.reported = None
    digest = secret["metadata"]["annotations"][resources.SPEC_HASH]
    if digest != creds.written:
        result = await write_child(
            kube, secret, job_uid=job.uid, owned=creds.written is not None, existing=existing
        )
        if isinstance(result, Conflict):
            return issuer.fingerprint(), result
        creds.written = digest
        metrics.CHILD_CHANGES.labels(action="apply", kind="Secret").inc()
    return issuer.fingerprint(), None
