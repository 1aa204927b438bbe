"""kopf wiring for DiLoCoJob: each handler records what it was told and asks for a sync.

The work happens in plain functions: sync.sync_job (the sync of one job), triggers (when a job
is synced: its timer, coalesced event-driven runs) and runtime (one record per job). The pod and
child watches double as the operator's view of those objects: their events are kept in the job's
record, so a sync never lists them in the steady state.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import kopf
import urllib3
from kubernetes.client.exceptions import ApiException

from diloco_operator import api, metrics, probes
from diloco_operator.kube import ApiUnavailable, Kube, load_config
from diloco_operator.options import network_options
from diloco_operator.resources import JOB_LABEL
from diloco_operator.runtime import DELETED, Registry
from diloco_operator.sync import POD_READS, sync_job
from diloco_operator.triggers import ensure_timer, request_sync, update_phase_gauge

JOBS = (api.GROUP, api.VERSION, api.PLURAL)
RETRY_DELAY = 5.0
OWNED = {JOB_LABEL: kopf.PRESENT}

REGISTRY = Registry()
# The health server and the API probe, started once (a startup handler may be retried).
_HEALTH: dict[str, Any] = {}


def namespaced(namespace: str | None) -> str:
    """kopf types `namespace` as optional (cluster-scoped resources have none); every resource
    these handlers watch is namespaced, so an event without one is a broken invariant."""
    assert namespace is not None, "a namespaced resource's event carries its namespace"
    return namespace


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Operator settings, the health endpoints and the API connection."""
    # Progress and the last-handled spec live in annotations: the status schema is ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration"
    )
    settings.posting.enabled = True
    # Our own Events are posted explicitly (events.py); kopf's bookkeeping lines ("Handler ...
    # succeeded", "Creation is processed") would be two more writes per job: only its warnings
    # and errors become Events.
    settings.posting.level = logging.WARNING
    # Every API call of kopf's has a deadline too: watches end after client_timeout at the
    # latest (the server is asked to end them sooner) and are restarted.
    settings.watching.connect_timeout = 10
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.connect_timeout = 10
    settings.networking.request_timeout = 30
    REGISTRY.network = network_options(os.environ)
    port = int(getattr(memo, "health_port", 0) or 0)
    if port and "runner" not in _HEALTH:
        _HEALTH["runner"] = await probes.serve(port, probes.API_HEALTH)
    try:
        kube = await asyncio.wait_for(Kube.connect(load_config()), 60)
    except (TimeoutError, OSError, urllib3.exceptions.HTTPError) as err:
        probes.API_HEALTH.unanswered(f"API discovery failed: {type(err).__name__}")
        raise kopf.TemporaryError("the API server did not answer discovery", delay=5) from err
    REGISTRY.kube = kube
    if "probe" not in _HEALTH:
        _HEALTH["probe"] = asyncio.create_task(probes.probe_forever(kube.ping, probes.API_HEALTH))


@kopf.on.cleanup()
async def close_clients(**_: Any) -> None:
    """Stop the timers, the API probe and the health server; close syncer HTTP sessions."""
    await REGISTRY.close()
    probe = _HEALTH.pop("probe", None)
    if probe is not None:
        probe.cancel()
    runner = _HEALTH.pop("runner", None)
    if runner is not None:
        await runner.cleanup()


@kopf.on.create(*JOBS, backoff=RETRY_DELAY)
@kopf.on.update(*JOBS, backoff=RETRY_DELAY)
@kopf.on.resume(*JOBS, backoff=RETRY_DELAY)
async def reconcile(body: kopf.Body, name: str, namespace: str | None, **_: Any) -> None:
    """Spec created or changed, or the operator (re)started: make the children match."""
    assert REGISTRY.kube is not None, "the startup handler connects to the API first"
    rt = REGISTRY.job(namespaced(namespace), name)
    await rt.see_job(body)
    try:
        await sync_job(REGISTRY.kube, rt, reconcile=True, poll_syncer=False)
    except ApiException as err:
        metrics.RECONCILES.labels(result="error").inc()
        raise kopf.TemporaryError(
            f"API error {err.status}: {err.reason}", delay=RETRY_DELAY
        ) from err
    except ApiUnavailable as err:
        metrics.RECONCILES.labels(result="error").inc()
        raise kopf.TemporaryError(str(err), delay=RETRY_DELAY) from err
    finally:
        update_phase_gauge(REGISTRY)


@kopf.on.event(*JOBS)
async def job_event(
    event: kopf.RawEvent, name: str, namespace: str | None, type: str | None, **_: Any
) -> None:
    """Keep the newest job object and one timer task per job; forget a deleted job."""
    if type == DELETED:
        await REGISTRY.forget(namespaced(namespace), name)
        update_phase_gauge(REGISTRY, force=True)
        return
    rt = REGISTRY.job(namespaced(namespace), name)
    await rt.see_job(event["object"])
    ensure_timer(REGISTRY, rt)


@kopf.on.event("", "v1", "pods", labels=OWNED)
async def pod_event(
    event: kopf.RawEvent, labels: kopf.Labels, namespace: str | None, type: str | None, **_: Any
) -> None:
    """A pod of a job changed: keep it, and re-check island health and membership at once."""
    POD_READS.confirm()  # the pod watch works: a new job's first sync need not list pods
    rt = REGISTRY.for_object_event(namespaced(namespace), labels[JOB_LABEL], type)
    if rt is None:
        return
    rt.see_pod(type, event["object"])
    if rt.body is None:
        REGISTRY.drop_if_orphan(rt)  # pods of a job not seen (yet, or any more)
        return
    request_sync(REGISTRY, rt, reconcile=bool(rt.rollout))


@kopf.on.event("apps", "v1", "statefulsets", labels=OWNED)
@kopf.on.event("apps", "v1", "deployments", labels=OWNED)
@kopf.on.event("", "v1", "services", labels=OWNED)
@kopf.on.event("", "v1", "configmaps", labels=OWNED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=OWNED)
async def child_event(
    event: kopf.RawEvent, labels: kopf.Labels, namespace: str | None, type: str | None, **_: Any
) -> None:
    """A child changed: keep it; reconcile soon when it was deleted (drift) or is rolling."""
    rt = REGISTRY.for_object_event(namespaced(namespace), labels[JOB_LABEL], type)
    if rt is None:
        return
    rt.see_child(type, event["object"])
    if rt.body is None:
        REGISTRY.drop_if_orphan(rt)
        return
    if type == DELETED or rt.rollout:
        request_sync(REGISTRY, rt, reconcile=True)
