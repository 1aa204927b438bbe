"""When a job is synced: on its timer, and soon after events of its pods and children.

Every trigger ends in sync.sync_job:
- a timer task per job every STATUS_INTERVAL seconds (poll the syncer, observe; the sync itself
  reconciles every RECONCILE_INTERVAL as the drift backstop and re-lists on the slow resync);
- events of the job's pods (observe at once: island health -> syncer membership within seconds)
  and of its children (reconcile when one is deleted or a rollout is under way).
Event-driven runs are coalesced per job (a burst of events makes one or two runs), and the job's
lock keeps runs from interleaving. Background runs log and count their errors, never raise.
"""

from __future__ import annotations

import asyncio
import logging
import time

import kopf

from diloco_operator import metrics
from diloco_operator.runtime import JobRuntime, Registry
from diloco_operator.sync import sync_job

log = logging.getLogger("diloco_operator")

STATUS_INTERVAL = 5.0
TIMER_INITIAL_DELAY = 1.0


# Every sync ends by exporting the phase counts, and counting walks every job: at 1,000 jobs,
# each syncing every few seconds, that was O(jobs^2) and 9% of the operator's core (py-spy). The
# counts are taken at most once a second; each job's timer syncs every STATUS_INTERVAL, so the
# gauge is never older than that.
PHASE_GAUGE_INTERVAL = 1.0
_PHASE_GAUGE = {"at": float("-inf")}


def update_phase_gauge(
    registry: Registry, *, force: bool = False, now: float | None = None
) -> None:
    """Export how many jobs are in each phase (at most once per PHASE_GAUGE_INTERVAL unless
    `force`)."""
    at = time.monotonic() if now is None else now
    if not force and at - _PHASE_GAUGE["at"] < PHASE_GAUGE_INTERVAL:
        return
    _PHASE_GAUGE["at"] = at
    for phase, count in registry.phase_counts().items():
        metrics.JOBS.labels(phase=phase).set(count)


async def sync_logged(
    registry: Registry, rt: JobRuntime, *, reconcile: bool, poll_syncer: bool
) -> None:
    """sync_job for background runs: errors are logged and counted, never raised; a job found
    gone is forgotten."""
    assert registry.kube is not None, "the startup handler connects to the API first"
    try:
        present = await sync_job(registry.kube, rt, reconcile=reconcile, poll_syncer=poll_syncer)
    except kopf.PermanentError as err:
        log.warning("%s/%s: %s", rt.namespace, rt.name, err)
    except Exception:
        metrics.RECONCILES.labels(result="error").inc()
        log.exception("%s/%s: sync failed; the timer retries", rt.namespace, rt.name)
    else:
        if not present and registry.find(*rt.key) is rt:
            await registry.forget(*rt.key)
    update_phase_gauge(registry)


def request_sync(registry: Registry, rt: JobRuntime, *, reconcile: bool) -> None:
    """Schedule a sync of the job soon; bursts of events collapse into one or two runs."""
    rt.pending = bool(rt.pending) or reconcile
    if rt.drain is None or rt.drain.done():
        rt.drain = asyncio.create_task(_drain(registry, rt))


async def _drain(registry: Registry, rt: JobRuntime) -> None:
    while rt.pending is not None:
        reconcile, rt.pending = rt.pending, None
        await sync_logged(registry, rt, reconcile=reconcile, poll_syncer=False)


def ensure_timer(registry: Registry, rt: JobRuntime) -> None:
    """Start the job's timer unless it runs.

    The timer is a plain task rather than a kopf.timer: kopf puts a finalizer on every object
    with a timer, and a finalizer would keep jobs from being deleted whenever the operator is
    not running. Owner references already clean up the children, so no finalizer is needed.
    Created from kopf's per-object context, so kopf.event() works inside it.
    """
    if rt.timer is None or rt.timer.done():
        rt.timer = asyncio.create_task(_timer(registry, rt))


async def _timer(registry: Registry, rt: JobRuntime) -> None:
    """Every STATUS_INTERVAL while the job is known: read the syncer's progress, check health
    and drift, write status."""
    await asyncio.sleep(TIMER_INITIAL_DELAY)
    while registry.find(*rt.key) is rt:
        await sync_logged(registry, rt, reconcile=False, poll_syncer=True)
        await asyncio.sleep(STATUS_INTERVAL)
