"""kopf handlers for DiLoCoJob: thin wiring around one level-triggered sync of a job.

`sync_job` is the only place work happens. Every trigger ends up there:
- create / update / resume of a DiLoCoJob (reconcile children, then observe);
- a timer task per job every STATUS_INTERVAL seconds (read the syncer's status, observe;
  reconcile every RECONCILE_INTERVAL seconds as the drift backstop);
- events of the job's pods (observe at once: island health -> syncer membership within seconds)
  and of its StatefulSets, Deployments and Services (reconcile when one is deleted or a rollout
  is under way).
Event-driven runs are coalesced per job, and one lock per job keeps runs from interleaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import kopf
from diloco_trainer.api import contract
from diloco_trainer.api.client import SyncerJsonClient
from diloco_trainer.api.protocol import SyncerError
from kubernetes.client.exceptions import ApiException

from diloco_operator import api, metrics, resources
from diloco_operator.api import DiLoCoJobSpec, SpecError, parse_job_spec
from diloco_operator.health import (
    DROPPED,
    Membership,
    MembershipChange,
    island_health,
    pod_view,
    syncer_island_states,
    syncer_pods,
)
from diloco_operator.kube import API_THREADS, Kube, load_config
from diloco_operator.planner import plan_changes
from diloco_operator.resources import JOB_LABEL, JobRef
from diloco_operator.status import (
    FINAL_PHASES,
    Observation,
    compute_status,
    islands_should_run,
    parse_time,
    status_changed,
    status_patch,
    ttl_expired,
)

log = logging.getLogger("diloco_operator")

JOBS = (api.GROUP, api.VERSION, api.PLURAL)
STATUS_INTERVAL = 5.0
RECONCILE_INTERVAL = 30.0
RETRY_DELAY = 5.0
TIMER_INITIAL_DELAY = 1.0


@dataclass
class JobMemory:
    """What the operator remembers about one job between runs (rebuilt after a restart)."""

    uid: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    membership: Membership = field(default_factory=Membership)
    syncer_status: dict[str, Any] | None = None
    syncer_error: str | None = "not contacted yet"
    client: SyncerJsonClient | None = None
    client_key: tuple[str, str, str | None] | None = None
    last_reconcile: float = 0.0
    rollout: list[str] = field(default_factory=list)
    spec_error: str | None = None


@dataclass
class OperatorState:
    """Process-wide state: the API edge, per-job memory and pending event-driven runs."""

    kube: Kube | None = None
    jobs: dict[tuple[str, str], JobMemory] = field(default_factory=dict)
    pending: dict[tuple[str, str], bool] = field(default_factory=dict)
    tasks: dict[tuple[str, str], asyncio.Task[None]] = field(default_factory=dict)
    phases: dict[tuple[str, str], str] = field(default_factory=dict)
    timers: dict[tuple[str, str], asyncio.Task[None]] = field(default_factory=dict)


STATE = OperatorState()


def _now() -> datetime:
    return datetime.now(timezone.utc)


async def _memory(namespace: str, name: str, uid: str) -> JobMemory:
    key = (namespace, name)
    mem = STATE.jobs.get(key)
    if mem is None or mem.uid != uid:  # new job, or deleted and created again
        if mem is not None and mem.client is not None:
            await mem.client.close()
        mem = STATE.jobs[key] = JobMemory(uid=uid)
    return mem


async def _forget(namespace: str, name: str) -> None:
    mem = STATE.jobs.pop((namespace, name), None)
    STATE.phases.pop((namespace, name), None)
    _update_phase_gauge()
    if mem is not None and mem.client is not None:
        await mem.client.close()


def _update_phase_gauge() -> None:
    for phase in api.PHASES:
        metrics.JOBS.labels(phase=phase).set(sum(p == phase for p in STATE.phases.values()))


def _post_event(body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    # LookupError: outside kopf's context (never in the operator): log only.
    with contextlib.suppress(LookupError):
        kopf.event(dict(body), type=kind, reason=reason, message=message)
    log.info(
        "%s/%s: %s %s", body["metadata"]["namespace"], body["metadata"]["name"], reason, message
    )


# ---------------------------------------------------------------------------------------------
# The sync of one job


async def sync_job(namespace: str, name: str, *, reconcile: bool, poll_syncer: bool) -> bool:
    """Bring one job's children, syncer membership and status in line with what is observed.

    Returns False when the job no longer exists.
    """
    kube = STATE.kube
    assert kube is not None, "the startup handler connects to the API first"
    body = await kube.get_job(namespace, name)
    if body is None:
        await _forget(namespace, name)
        return False
    if body["metadata"].get("deletionTimestamp"):
        return True  # garbage collection takes the children
    job = JobRef.from_body(body)
    mem = await _memory(namespace, name, job.uid)
    contended = mem.lock.locked()
    async with mem.lock:
        if contended:  # another run changed things while we waited: read the job again
            fresh = await kube.get_job(namespace, name)
            if fresh is None:
                return False
            body = fresh
        try:
            spec = parse_job_spec(body.get("spec") or {})
        except SpecError as err:
            if mem.spec_error != str(err):
                mem.spec_error = str(err)
                _post_event(body, "Warning", "InvalidSpec", str(err))
            raise kopf.PermanentError(str(err)) from None
        mem.spec_error = None
        status = dict(body.get("status") or {})
        if reconcile or time.monotonic() - mem.last_reconcile >= RECONCILE_INTERVAL:
            await _reconcile_children(kube, job, spec, status, mem)
        if poll_syncer:
            await _poll_syncer(kube, job, spec, mem)
        new_status = await _observe(kube, job, body, spec, status, mem)
        if islands_should_run(spec, status) and new_status.get("phase") in FINAL_PHASES:
            await _reconcile_children(kube, job, spec, new_status, mem)  # scale islands to 0
            kind = "Normal" if new_status["phase"] == "Succeeded" else "Warning"
            _post_event(body, kind, new_status["phase"], new_status.get("message", ""))
        if ttl_expired(spec, new_status, _now()):
            _post_event(body, "Normal", "TTLExpired", "deleting the finished job")
            await kube.delete_job(namespace, name, job.uid)
    return True


async def _reconcile_children(
    kube: Kube, job: JobRef, spec: DiLoCoJobSpec, status: Mapping[str, Any], mem: JobMemory
) -> None:
    started = time.monotonic()
    running = islands_should_run(spec, status)
    if not spec.syncer.token_secret_name:
        name = resources.generated_token_secret_name(job.name)
        if not await kube.exists("Secret", job.namespace, name):
            token = secrets.token_urlsafe(32)
            if await kube.create_if_absent(resources.build_token_secret(job, token)):
                metrics.CHILD_CHANGES.labels(action="create", kind="Secret").inc()
    desired = resources.build_children(job, spec, islands_running=running)
    observed = await kube.list_children(job.namespace, job.name)
    plan = plan_changes(desired, observed, job_uid=job.uid)
    await asyncio.gather(*(kube.apply(obj) for obj in plan.apply))
    await asyncio.gather(*(kube.delete(kind, job.namespace, n) for kind, n in plan.delete))
    for obj in plan.apply:
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
    mem.rollout = [*plan.rolling, *plan.waiting]
    mem.last_reconcile = time.monotonic()
    metrics.RECONCILES.labels(result="ok").inc()
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


async def _client(kube: Kube, job: JobRef, spec: DiLoCoJobSpec, mem: JobMemory) -> SyncerJsonClient:
    url = resources.syncer_url(job, spec)
    secret = resources.token_secret_name(job.name, spec)
    ca = resources.ca_secret_name(spec) if url.startswith("https://") else None
    key = (url, secret, ca)
    if mem.client is not None and mem.client_key == key:
        return mem.client
    token = await kube.read_secret_key(job.namespace, secret, contract.TOKEN_KEY)
    if not token:
        raise SyncerError(0, f"token Secret {secret} (key {contract.TOKEN_KEY}) not found")
    ca_data = await kube.read_secret_key(job.namespace, ca, "ca.crt") if ca else None
    if mem.client is not None:
        await mem.client.close()
    # A few seconds per call: the operator never blocks on a missing syncer, it records a
    # condition and asks again on its next pass (so retries are logged at DEBUG only).
    client = SyncerJsonClient(
        url,
        token,
        ca_data=ca_data,
        retry_deadline=3.0,
        request_timeout=2.0,
        retry_log_level=logging.DEBUG,
    )
    mem.client, mem.client_key = client, key
    return mem.client


async def _drop_client(mem: JobMemory) -> None:
    if mem.client is not None:
        await mem.client.close()
    mem.client = mem.client_key = None


async def _poll_syncer(kube: Kube, job: JobRef, spec: DiLoCoJobSpec, mem: JobMemory) -> None:
    try:
        client = await _client(kube, job, spec, mem)
        mem.syncer_status, mem.syncer_error = (await client.status()).to_json(), None
    except SyncerError as err:
        # Read the token and CA Secrets again next time: either may have been created or
        # rotated since this client was made (a missing CA shows up as "unavailable").
        await _drop_client(mem)
        if mem.syncer_error != str(err):
            log.warning("%s/%s: syncer unreachable: %s", job.namespace, job.name, err)
        mem.syncer_status, mem.syncer_error = None, str(err)
        metrics.SYNCER_UNREACHABLE.inc()


async def _send_membership(
    kube: Kube,
    job: JobRef,
    body: Mapping[str, Any],
    spec: DiLoCoJobSpec,
    mem: JobMemory,
    change: MembershipChange,
) -> bool:
    """PUT one membership change; False when the syncer could not be reached."""
    try:
        client = await _client(kube, job, spec, mem)
        await client.set_membership(change.island, change.state, change.reason)
    except SyncerError as err:
        await _drop_client(mem)  # re-read token and CA next time, as in _poll_syncer
        log.warning(
            "%s/%s: could not set %s %s: %s",
            job.namespace,
            job.name,
            change.island,
            change.state,
            err,
        )
        metrics.ERRORS.labels(where="membership").inc()
        if err.unavailable:  # unreachable or 5xx, not a refusal
            mem.syncer_status, mem.syncer_error = None, str(err)
            return False
        return True  # refused: not acknowledged, tried again on the next run
    mem.membership.acknowledge(change)
    if mem.syncer_status is not None:  # keep the cached view consistent with what we just did
        islands = mem.syncer_status.setdefault("islands", {})
        islands.setdefault(change.island, {})["state"] = change.state
    if change.state == DROPPED:
        metrics.ISLANDS_DROPPED.inc()
        _post_event(body, "Warning", "IslandDropped", f"{change.island}: {change.reason}")
    else:
        metrics.ISLANDS_READDED.inc()
        _post_event(body, "Normal", "IslandReadded", f"{change.island}: {change.reason}")
    return True


def _own_island_pattern(spec: DiLoCoJobSpec) -> re.Pattern[str]:
    prefix = spec.islands.name_prefix
    return re.compile("^" + re.escape(f"{prefix}-" if prefix else "") + r"island-\d+$")


async def _observe(
    kube: Kube,
    job: JobRef,
    body: Mapping[str, Any],
    spec: DiLoCoJobSpec,
    status: Mapping[str, Any],
    mem: JobMemory,
) -> dict[str, Any]:
    pods = [pod_view(p) for p in await kube.list_pods(job.namespace, job.name)]
    statefulsets = {
        island: resources.island_statefulset_name(job.name, island)
        for island in resources.island_names(spec)
    }
    health = island_health(statefulsets, spec.islands.replicas, pods)
    running = islands_should_run(spec, status)
    own = _own_island_pattern(spec)
    changes = mem.membership.decide(
        health,
        syncer_island_states(mem.syncer_status),
        islands_running=running,
        is_own_island=lambda n: bool(own.match(n)),
    )
    for change in changes:
        if not await _send_membership(kube, job, body, spec, mem, change):
            break  # syncer unreachable: the rest waits for the next run, not for more timeouts
    meta = body["metadata"]
    observation = Observation(
        generation=int(meta.get("generation", 0)),
        created=parse_time(meta.get("creationTimestamp")) or _now(),
        spec=spec,
        islands=health,
        syncer_pods=syncer_pods(pods) if resources.runs_local_syncer(spec) else [],
        syncer_status=mem.syncer_status,
        syncer_error=mem.syncer_error,
        rolling=mem.rollout,
        now=_now(),
    )
    new = compute_status(observation, status)
    patch = status_patch(new)
    if status_changed(new, status):
        await kube.patch_job_status(job.namespace, job.name, patch)
        if new.phase != status.get("phase"):
            log.info("%s/%s: phase %s", job.namespace, job.name, new.phase)
    STATE.phases[(job.namespace, job.name)] = new.phase
    _update_phase_gauge()
    return patch


async def _sync_logged(namespace: str, name: str, *, reconcile: bool, poll_syncer: bool) -> bool:
    """sync_job for background runs: errors are logged and counted, never raised.

    Returns False once the job is gone.
    """
    try:
        return await sync_job(namespace, name, reconcile=reconcile, poll_syncer=poll_syncer)
    except kopf.PermanentError as err:
        log.warning("%s/%s: %s", namespace, name, err)
    except Exception:
        metrics.RECONCILES.labels(result="error").inc()
        log.exception("%s/%s: sync failed; the timer retries", namespace, name)
    return True


def request_sync(namespace: str, name: str, *, reconcile: bool) -> None:
    """Schedule a sync of the job soon; bursts of events collapse into one or two runs."""
    key = (namespace, name)
    STATE.pending[key] = STATE.pending.get(key, False) or reconcile
    task = STATE.tasks.get(key)
    if task is None or task.done():
        STATE.tasks[key] = asyncio.create_task(_drain(key))


async def _drain(key: tuple[str, str]) -> None:
    while key in STATE.pending:
        reconcile = STATE.pending.pop(key)
        await _sync_logged(*key, reconcile=reconcile, poll_syncer=False)
    STATE.tasks.pop(key, None)


# ---------------------------------------------------------------------------------------------
# kopf wiring


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Operator settings and the API connection."""
    # Progress and the last-handled spec live in annotations: the status schema is ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration"
    )
    settings.posting.enabled = True
    settings.posting.level = logging.INFO
    settings.watching.connect_timeout = 30
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    # The Kubernetes client is synchronous: its calls run in these threads (asyncio.to_thread).
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=API_THREADS, thread_name_prefix="k8s-api")
    )
    STATE.kube = await Kube.connect(load_config())


@kopf.on.cleanup()
async def close_clients(**_: Any) -> None:
    """Stop the timers and close syncer HTTP sessions on shutdown."""
    for task in [*STATE.timers.values(), *STATE.tasks.values()]:
        task.cancel()
    for mem in STATE.jobs.values():
        if mem.client is not None:
            await mem.client.close()


@kopf.on.create(*JOBS, backoff=RETRY_DELAY)
@kopf.on.update(*JOBS, backoff=RETRY_DELAY)
@kopf.on.resume(*JOBS, backoff=RETRY_DELAY)
async def reconcile(name: str, namespace: str, **_: Any) -> None:
    """Spec created or changed, or the operator (re)started: make the children match."""
    try:
        await sync_job(namespace, name, reconcile=True, poll_syncer=False)
    except ApiException as err:
        metrics.RECONCILES.labels(result="error").inc()
        raise kopf.TemporaryError(
            f"API error {err.status}: {err.reason}", delay=RETRY_DELAY
        ) from err


@kopf.on.event(*JOBS)
async def job_event(name: str, namespace: str, type: str | None, **_: Any) -> None:
    """Keep one timer task per existing job; forget a deleted job.

    The timer is a plain task rather than a kopf.timer: kopf puts a finalizer on every object
    with a timer, and a finalizer would keep jobs from being deleted whenever the operator is
    not running. Owner references already clean up the children, so no finalizer is needed.
    """
    key = (namespace, name)
    if type == "DELETED":
        task = STATE.timers.pop(key, None)
        if task is not None:
            task.cancel()
        await _forget(namespace, name)
        return
    task = STATE.timers.get(key)
    if task is None or task.done():
        # Created from kopf's per-object context, so kopf.event() works inside it.
        STATE.timers[key] = asyncio.create_task(_timer(namespace, name))


async def _timer(namespace: str, name: str) -> None:
    """Every STATUS_INTERVAL: read the syncer's progress, check health and drift, write status."""
    await asyncio.sleep(TIMER_INITIAL_DELAY)
    while await _sync_logged(namespace, name, reconcile=False, poll_syncer=True):
        await asyncio.sleep(STATUS_INTERVAL)
    STATE.timers.pop((namespace, name), None)


@kopf.on.event("", "v1", "pods", labels={JOB_LABEL: kopf.PRESENT})
async def pod_event(labels: Mapping[str, str], namespace: str, **_: Any) -> None:
    """A pod of a job changed: re-check island health and membership at once."""
    job = labels[JOB_LABEL]
    mem = STATE.jobs.get((namespace, job))
    request_sync(namespace, job, reconcile=bool(mem and mem.rollout))


@kopf.on.event("apps", "v1", "statefulsets", labels={JOB_LABEL: kopf.PRESENT})
@kopf.on.event("apps", "v1", "deployments", labels={JOB_LABEL: kopf.PRESENT})
@kopf.on.event("", "v1", "services", labels={JOB_LABEL: kopf.PRESENT})
async def child_event(
    labels: Mapping[str, str], namespace: str, type: str | None, **_: Any
) -> None:
    """A child was deleted (drift) or is rolling: reconcile soon."""
    job = labels[JOB_LABEL]
    mem = STATE.jobs.get((namespace, job))
    if type == "DELETED" or (mem is not None and mem.rollout):
        request_sync(namespace, job, reconcile=True)
