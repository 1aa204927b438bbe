"""The operator's calls to a job's syncer: read its status, tell it which islands count.

Island health -> membership: the pure decision is health.MembershipDecisions.decide; this module
sends what it decides (PUT /v1/islands/{island}) and keeps the job's SyncerConnection (client,
last status, last error) up to date. The syncer is polled by the job's timer, never waited for:
a failed call is recorded (SyncerReachable=False, with a fixed message per class of failure:
syncer_errors.py) and tried again on the next pass. The operator calls the syncer with the admin
credential (or its region's): credential_secrets.py.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from typing import Any

from diloco_trainer.api.client import SyncerJsonClient
from diloco_trainer.api.credentials import CredentialError
from diloco_trainer.api.protocol import SyncerError

from diloco_operator import metrics, resources
from diloco_operator.api import DiLoCoJobSpec
from diloco_operator.credential_secrets import job_issuer
from diloco_operator.events import post_event
from diloco_operator.health import DROPPED, IslandHealth, MembershipChange
from diloco_operator.kube import Kube
from diloco_operator.resources import JobRef
from diloco_operator.runtime import JobRuntime
from diloco_operator.syncer_errors import CODE_CREDENTIALS, condition_message, credentials_error

log = logging.getLogger("diloco_operator")

# A few seconds per call: the operator never blocks on a missing syncer, it records a condition
# and asks again on its next pass (so retries are logged at DEBUG only).
RETRY_DEADLINE = 3.0
REQUEST_TIMEOUT = 2.0
# An unanswering syncer is polled again after 5, 10, 20, then every 30 s (STATUS_INTERVAL is
# 5 s): its condition still flips within 30 s of it answering, far inside the 900 s deadline.
POLL_BACKOFF_BASE = 5.0
POLL_BACKOFF_CAP = 30.0


async def syncer_client(
    kube: Kube, rt: JobRuntime, job: JobRef, spec: DiLoCoJobSpec
) -> SyncerJsonClient:
    """The job's syncer client, made (credential and CA read from their Secrets) when needed."""
    url = resources.syncer_url(job, spec)
    try:
        issuer = await job_issuer(kube, rt, job, spec)
    except CredentialError as err:
        raise credentials_error(str(err)) from None
    ca = resources.ca_secret_name(spec) if url.startswith("https://") else None
    key = (url, issuer.fingerprint(), ca)
    link = rt.syncer
    if link.client is not None and link.client_key == key:
        return link.client
    token = issuer.operator_token()
    ca_data = await kube.read_secret_key(job.namespace, ca, "ca.crt") if ca else None
    await link.drop_client()
    link.client = SyncerJsonClient(
        url,
        token,
        ca_data=ca_data,
        retry_deadline=RETRY_DEADLINE,
        request_timeout=REQUEST_TIMEOUT,
        retry_log_level=logging.DEBUG,
    )
    link.client_key = key
    return link.client


async def forget_client(rt: JobRuntime, err: SyncerError, url: str) -> None:
    """After a failed call: a new client next time, and the token and CA Secrets read again
    when they may be why it failed (either may have been created or rotated since).

    A plain-HTTP syncer that did not answer (not started yet, no such host) says nothing about
    the credential: re-reading the Secret then would cost one API read per job and pass (at
    1,000 jobs whose syncers are not up, 200 reads a second). Over HTTPS a missing or rotated CA
    looks like no answer, so there it is read again.
    """
    await rt.syncer.drop_client()
    unanswered = err.status == 0 and err.code != CODE_CREDENTIALS
    if not (unanswered and url.startswith("http://")):
        rt.credentials.checked = False


def poll_backoff(failures: int) -> float:
    """Seconds until a syncer that did not answer `failures` times in a row is polled again."""
    return min(POLL_BACKOFF_CAP, POLL_BACKOFF_BASE * 2 ** max(failures - 1, 0))


async def poll_syncer_status(kube: Kube, rt: JobRuntime, job: JobRef, spec: DiLoCoJobSpec) -> None:
    """Read the syncer's /v1/status into the job's SyncerConnection (or the error why not).

    A syncer that does not answer is polled less and less often (poll_backoff), so that jobs
    whose syncers are down do not each cost a few seconds of retries every pass; the error
    stays in the link meanwhile.
    """
    link = rt.syncer
    if time.monotonic() < link.retry_at:
        return
    try:
        client = await syncer_client(kube, rt, job, spec)
        link.read(await client.status())
        link.failures, link.retry_at = 0, 0.0
    except SyncerError as err:
        if err.unavailable:
            link.failures += 1
            link.retry_at = time.monotonic() + poll_backoff(link.failures)
        await forget_client(rt, err, resources.syncer_url(job, spec))
        message = condition_message(err, resources.syncer_url(job, spec))
        if link.error != message:
            log.warning("%s/%s: syncer unreachable: %s", job.namespace, job.name, err)
        link.lost(message)
        metrics.SYNCER_UNREACHABLE.inc()


async def send_membership(
    kube: Kube,
    rt: JobRuntime,
    job: JobRef,
    spec: DiLoCoJobSpec,
    change: MembershipChange,
) -> bool:
    """PUT one membership change; False when the syncer could not be reached."""
    link = rt.syncer
    try:
        client = await syncer_client(kube, rt, job, spec)
        await client.set_membership(change.island, change.state, change.reason)
    except SyncerError as err:
        await forget_client(rt, err, resources.syncer_url(job, spec))
        log.warning(
            "%s/%s: could not set %s %s: %s", job.namespace, job.name, change.island,
            change.state, err,
        )  # fmt: skip
        metrics.ERRORS.labels(where="membership").inc()
        if err.unavailable:  # unreachable or 5xx, not a refusal
            link.lost(condition_message(err, resources.syncer_url(job, spec)))
            return False
        return True  # refused: not acknowledged, tried again on the next run
    rt.membership.acknowledge(change)
    link.acknowledge(change.island, change.state)  # the policies see it before the next read
    _report(rt.body or {}, change)
    return True


def _report(body: Mapping[str, Any], change: MembershipChange) -> None:
    if not body:
        return
    if change.state == DROPPED:
        metrics.ISLANDS_DROPPED.inc()
        post_event(body, "Warning", "IslandDropped", f"{change.island}: {change.reason}")
    else:
        metrics.ISLANDS_READDED.inc()
        post_event(body, "Normal", "IslandReadded", f"{change.island}: {change.reason}")


def own_island_pattern(spec: DiLoCoJobSpec) -> re.Pattern[str]:
    """Island names of this job among those a (possibly multi-region) syncer reports."""
    prefix = spec.islands.name_prefix
    return re.compile("^" + re.escape(f"{prefix}-" if prefix else "") + r"island-\d+$")


async def update_membership(
    kube: Kube,
    rt: JobRuntime,
    job: JobRef,
    spec: DiLoCoJobSpec,
    health: Mapping[str, IslandHealth],
    *,
    islands_running: bool,
) -> None:
    """Decide membership changes from fresh island health and send them to the syncer."""
    own = own_island_pattern(spec)
    syncer = rt.syncer.view
    changes = rt.membership.decide(
        health,
        syncer.island_states() if syncer is not None else None,
        islands_running=islands_running,
        is_own_island=lambda n: bool(own.match(n)),
        syncer_dropped=syncer.dropped_for_refusals() if syncer is not None else frozenset(),
    )
    for change in changes:
        if not await send_membership(kube, rt, job, spec, change):
            break  # syncer unreachable: the rest waits for the next run, not for more timeouts
