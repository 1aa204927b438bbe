"""The sync of one DiLoCoJob: children, syncer membership and status in line with what is seen.

Level-triggered: a sync reads the newest job object and the pods and children the watches
delivered (runtime.JobRuntime), so running it again after any failure finishes the work. The
API server is read only where the watches cannot help: a job's pods and children are listed on
its first sync and again about every RESYNC_INTERVAL (a safety net for missed events), and the
token Secret (not watched: the operator may not list Secrets) is read on the same schedule
(credential_secrets.py). A job that was never synced (no status yet) is not listed on its first
sync: it cannot have pods or children of its own yet, and each child it wants is read before it is
written anyway (its pods are listed all the same until the operator has once read pods:
POD_READS). A child whose name an object the job does not own already has is left alone and
reported (children.py: a NameConflict condition and an Event).

A first reconcile costs three round trips to the API server: the token Secret is created while
every child the job wants is read; then the island credentials Secret is written; then the
children (the Secret still comes first: learner pods mount it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Mapping
from datetime import UTC, datetime
from functools import partial
from typing import Any

import kopf

from diloco_operator import metrics, queueing, resources
from diloco_operator.api import DiLoCoJobSpec, SpecError, parse_job_spec
from diloco_operator.children import UNREAD, Conflict, read_children, write_children
from diloco_operator.credential_secrets import ensure_credentials, read_credential
from diloco_operator.events import post_event
from diloco_operator.final_weights import post_weight_events
from diloco_operator.health import island_health, syncer_pods
from diloco_operator.kube import Kube
from diloco_operator.merge_waits import note_resumed, post_wait_event, read_waits, resumed
from diloco_operator.observation import Observation
from diloco_operator.observed import parse_version
from diloco_operator.phase import FINAL_PHASES
from diloco_operator.planner import MANAGED_KINDS, Key, owned_by, plan_changes
from diloco_operator.preflight import CheckResult, check_job, post_check_event
from diloco_operator.reconcile_slots import FIRST_RECONCILES
from diloco_operator.refusals import post_refusal_events
from diloco_operator.resources import JobRef
from diloco_operator.runtime import JobRuntime
from diloco_operator.status import (
    compute_status,
    islands_should_run,
    status_changed,
    status_patch,
    ttl_expired,
)
from diloco_operator.syncer_calls import poll_syncer_status, update_membership
from diloco_operator.times import parse_time

log = logging.getLogger("diloco_operator")

RECONCILE_INTERVAL = 30.0  # reconcile from what was seen at least this often (drift backstop)
RESYNC_INTERVAL = 300.0  # list the job, its pods and its children again this often
# Jobs created together (a burst of 1,000) would all resync at the same moment, listing the API
# server 8,000 times at once: each job resyncs after RESYNC_INTERVAL less up to this share of
# it, a fixed spread per job name.
RESYNC_SPREAD = 0.25


def resync_interval(namespace: str, name: str) -> float:
    """Seconds between a job's resyncs: RESYNC_INTERVAL less a fixed share for this job."""
    share = zlib.crc32(f"{namespace}/{name}".encode()) / 2**32
    return RESYNC_INTERVAL * (1.0 - RESYNC_SPREAD * share)


def _now() -> datetime:
    return datetime.now(UTC)


async def sync_job(kube: Kube, rt: JobRuntime, *, reconcile: bool, poll_syncer: bool) -> bool:
    """Bring one job's children, syncer membership and status in line with what is observed.

    Returns False when the job turned out to be gone.
    """
    queued_at = time.monotonic()  # a first reconcile's wait counts from here (the lock too)
    async with rt.lock:
        due = resync_interval(rt.namespace, rt.name)
        if poll_syncer and time.monotonic() - rt.resynced_at >= due:
            fresh = await kube.get_job(rt.namespace, rt.name)
            if fresh is None:
                return False
            await rt.see_job(fresh)
            rt.start_resync()
        body = rt.body  # the newest seen, read after any wait for the lock
        if body is None or body["metadata"].get("deletionTimestamp"):
            return True  # not seen yet (its first event syncs it), or GC takes the children
        spec = _valid_spec(rt, body)
        job = JobRef.from_body(body)
        status = dict(body.get("status") or {})
        check = check_job(spec, status)  # a failing check holds a job that has not started
        post_check_event(rt.notes, body, check)
        reconcile_due = reconcile or time.monotonic() - rt.last_reconcile >= RECONCILE_INTERVAL
        if reconcile_due and not check.held:
            await reconcile_children(kube, rt, job, spec, status, queued_at=queued_at)
        if poll_syncer and not check.held:
            await poll_syncer_status(kube, rt, job, spec)
            _read_waits(rt, body, spec, status)
        new_status = await observe(kube, rt, job, body, spec, status, check)
        if new_status is None:
            return False
        post_weight_events(rt.notes, body, spec, new_status)
        rt.refusals = post_refusal_events(
            body, rt.syncer.view, resources.island_names(spec), rt.refusals, rt.notes
        )
        post_wait_event(body, rt.waits, rt.notes)
        if islands_should_run(spec, status) and new_status.get("phase") in FINAL_PHASES:
            await reconcile_children(kube, rt, job, spec, new_status)  # scale islands to 0
            kind = "Normal" if new_status["phase"] == "Succeeded" else "Warning"
            post_event(body, kind, new_status["phase"], new_status.get("message", ""))
        if ttl_expired(spec, new_status, _now()):
            post_event(body, "Normal", "TTLExpired", "deleting the finished job")
            await kube.delete_job(job.namespace, job.name, job.uid)
    return True


def _read_waits(
    rt: JobRuntime, body: dict[str, Any], spec: DiLoCoJobSpec, status: dict[str, Any]
) -> None:
    """Count one status read in the islands' waits for merges (merge_waits.py); the first since
    the operator started takes up the stored condition, whose Event was posted then."""
    if rt.waits is None:
        rt.waits = resumed(status)
        note_resumed(body, rt.waits, rt.notes)
    rt.waits = read_waits(rt.waits, rt.syncer.view, resources.island_names(spec))


def _valid_spec(rt: JobRuntime, body: dict[str, Any]) -> DiLoCoJobSpec:
    """The parsed spec; an invalid one is reported once (Event) and raised as permanent."""
    try:
        spec = parse_job_spec(body.get("spec") or {})
    except SpecError as err:
        if rt.spec_error != str(err):
            rt.spec_error = str(err)
            post_event(body, "Warning", "InvalidSpec", str(err))
        raise kopf.PermanentError(str(err)) from None
    rt.spec_error = None
    return spec


def _report_conflicts(rt: JobRuntime, conflicts: list[Conflict]) -> None:
    """Keep the conflicts for the status; post an Event for each one not reported yet."""
    messages = [c.message() for c in conflicts]
    for message in messages:
        if message not in rt.conflicts:
            metrics.ERRORS.labels(where="name_conflict").inc()
            post_event(rt.body or {}, "Warning", "NameConflict", message)
    rt.conflicts = messages


def never_synced(body: dict[str, Any]) -> bool:
    """The job has no status: no sync finished for it, so it holds no pods or children of its
    own yet (a child of its name is read before it is written: children.py)."""
    return not body.get("status")


async def _list_children(kube: Kube, rt: JobRuntime, job: JobRef) -> None:
    """List every managed kind once per resync; the watches keep the cache fresh in between."""
    if rt.children_listed:
        return
    if rt.body is not None and never_synced(rt.body):
        rt.children_listed = True  # nothing of its own to list; the watches bring the rest
        return
    listings = await asyncio.gather(
        *(kube.list_labelled(kind, job.namespace, job.name) for kind in MANAGED_KINDS)
    )
    for kind, listing in zip(MANAGED_KINDS, listings, strict=True):
        listed = {(kind, o["metadata"]["name"]): o for o in listing.items}
        rt.children.replace(listed, parse_version(listing.version), partial(_of_kind, kind))
    rt.children_listed = True


def _of_kind(kind: str, key: Key) -> bool:
    """Whether a child's key is of this kind (the scope of one kind's list answer)."""
    return key[0] == kind


class PodReads:
    """Whether this operator has read pods since it started: a listing answered, or the pod
    watch delivered an event. Until then a new job's pods are listed too, so an operator that
    may not read pods (RBAC) fails before it writes a status it could not have seen."""

    confirmed: bool = False

    def confirm(self) -> None:
        self.confirmed = True


POD_READS = PodReads()


async def _list_pods(kube: Kube, rt: JobRuntime, job: JobRef) -> None:
    """List the job's pods once per resync; the pod watch keeps the cache fresh in between."""
    if rt.pods_listed:
        return
    if rt.body is not None and never_synced(rt.body) and POD_READS.confirmed:
        rt.pods_listed = True  # its StatefulSets were just written: the pod watch has the pods
        return
    listing = await kube.list_labelled("Pod", job.namespace, job.name)
    POD_READS.confirm()
    listed = {o["metadata"]["name"]: o for o in listing.items}
    rt.pods.replace(listed, parse_version(listing.version))
    rt.pods_listed = True


async def reconcile_children(
    kube: Kube,
    rt: JobRuntime,
    job: JobRef,
    spec: DiLoCoJobSpec,
    status: dict[str, Any],
    *,
    queued_at: float | None = None,
) -> None:
    """Create, update and delete children until they match the spec (one rollout at a time).

    A job's first reconcile (it writes every child) waits for a slot first (reconcile_slots.py);
    later ones change little and run at once.
    """
    if rt.last_reconcile:
        await _reconcile_children(kube, rt, job, spec, status)
        return
    async with FIRST_RECONCILES.slot(time.monotonic() if queued_at is None else queued_at):
        await _reconcile_children(kube, rt, job, spec, status)


def _unread(rt: JobRuntime, job: JobRef, keys: list[Key]) -> list[Key]:
    """The children (and the island credentials Secret) the job may not own: read before any
    write (children.py), all at once. While a listing is due (after a restart or a resync) the
    children are not read here: the listing shows which are the job's, and only the others are
    read, by write_child, after it."""
    unread: list[Key] = []
    if rt.children_listed or never_synced(rt.body or {}):
        mine = {k for k in keys if (c := rt.children.get(k)) is not None and owned_by(c, job.uid)}
        unread = [k for k in keys if k not in mine]
    creds = rt.credentials
    if creds.written is None and not (creds.checked and creds.issuer is None):
        # (a credential known to be unusable writes no Secret: nothing to read for it)
        unread.append(("Secret", resources.island_tokens_secret_name(job.name)))
    return unread


async def _reconcile_children(
    kube: Kube, rt: JobRuntime, job: JobRef, spec: DiLoCoJobSpec, status: dict[str, Any]
) -> None:
    started = time.monotonic()
    running = islands_should_run(spec, status)
    spec_data = (rt.body or {}).get("spec") or {}
    keys = queueing.queued_keys(
        job, resources.child_keys(job, spec, network=rt.network), islands_running=running
    )
    # The credential, the children's listing and the reads of children the job may not own are
    # independent: one round trip, not three.
    issuer, _, read = await asyncio.gather(
        read_credential(kube, rt, job, spec),
        _list_children(kube, rt, job),
        read_children(kube, job.namespace, _unread(rt, job, keys)),
    )
    secret = read.pop(("Secret", resources.island_tokens_secret_name(job.name)), UNREAD)
    credential, conflict = await ensure_credentials(
        kube, rt, job, spec, issuer=issuer, existing=secret
    )
    desired = rt.desired.build(
        job, spec_data, spec, running=running, credential=credential, network=rt.network
    )
    observed: list[Mapping[str, Any]] = list(rt.children.values())
    plan = plan_changes(desired, observed, job_uid=job.uid)
    stored, conflicts = await write_children(kube, plan.apply, observed, job_uid=job.uid, read=read)
    for obj in stored:  # the write's answer is the newest state: no need to wait for its event
        rt.see_child(None, obj)
    _report_conflicts(rt, [*conflicts, *([conflict] if conflict else [])])
    await asyncio.gather(*(kube.delete(kind, job.namespace, n) for kind, n in plan.delete))
    for key in plan.delete:
        rt.children.forget(key)
    for obj in stored:
        metrics.CHILD_CHANGES.labels(action="apply", kind=obj["kind"]).inc()
    for kind, _ in plan.delete:
        metrics.CHILD_CHANGES.labels(action="delete", kind=kind).inc()
    if plan.apply or plan.delete:
        log.info(
            "%s/%s: applied %s; deleted %s; rolling %s; waiting %s",
            job.namespace,
            job.name,
            [f"{o['kind']}/{o['metadata']['name']}" for o in plan.apply],
            [f"{k}/{n}" for k, n in plan.delete],
            plan.rolling,
            plan.waiting,
        )
    rt.rollout = [*plan.rolling, *plan.waiting]
    rt.last_reconcile = time.monotonic()
    metrics.RECONCILES.labels(result="ok").inc()
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


async def observe(
    kube: Kube,
    rt: JobRuntime,
    job: JobRef,
    body: dict[str, Any],
    spec: DiLoCoJobSpec,
    status: dict[str, Any],
    check: CheckResult | None = None,
) -> dict[str, Any] | None:
    """Island health -> syncer membership, then write the status; the status written (None
    when the job is gone)."""
    await _list_pods(kube, rt, job)
    pods = rt.pods.values()
    statefulsets = {
        island: resources.island_statefulset_name(job.name, island)
        for island in resources.island_names(spec)
    }
    health = island_health(statefulsets, resources.island_replicas_by_name(spec), pods)
    running = islands_should_run(spec, status)
    await update_membership(kube, rt, job, spec, health, islands_running=running)
    local_syncer = syncer_pods(pods) if resources.runs_local_syncer(spec) else []
    ready = sum(p.ready for p in local_syncer)
    if ready > rt.syncer_pods_ready:
        rt.syncer.retry_at = 0.0  # a syncer pod just became Ready: poll it on the next pass
    rt.syncer_pods_ready = ready
    meta = body["metadata"]
    observation = Observation(
        generation=int(meta.get("generation", 0)),
        created=parse_time(meta.get("creationTimestamp")) or _now(),
        spec=spec,
        islands=health,
        syncer_pods=local_syncer,
        syncer=rt.syncer.view,
        syncer_error=rt.syncer.error,
        rolling=rt.rollout,
        now=_now(),
        conflicts=rt.conflicts,
        check=check,
        waits=rt.waits,
    )
    new = compute_status(observation, status)
    patch = status_patch(new)
    if status_changed(new, status):
        written = await kube.patch_job_status(job.namespace, job.name, patch)
        if written is None:
            return None
        await rt.see_job(written)  # the next sync compares with this, not an older event
        if new.phase != status.get("phase"):
            log.info("%s/%s: phase %s", job.namespace, job.name, new.phase)
    rt.phase = new.phase
    return patch
