"""What keeps 1,000 jobs from swamping the API server and the operator's one core: FIFO
admission of first reconciles with their wait measured apart, backoff (without Secret reads) for
a syncer that does not answer, and the phase gauge counted at most once a second."""

from __future__ import annotations

import asyncio
import time
from typing import cast

from diloco_operator import metrics
from diloco_operator.kube import Kube
from diloco_operator.reconcile_slots import ReconcileSlots
from diloco_operator.runtime import JobRuntime, Registry
from diloco_operator.sync import sync_job
from diloco_operator.syncer_calls import POLL_BACKOFF_CAP, forget_client, poll_backoff
from diloco_operator.syncer_errors import credentials_error
from diloco_operator.triggers import PHASE_GAUGE_INTERVAL, update_phase_gauge
from diloco_trainer.api.protocol import SyncerError

from .operator_fakes import FakeKube, job_body


def _queue_count() -> float:
    samples = metrics.RECONCILE_QUEUE_SECONDS.collect()[0].samples
    return next(s.value for s in samples if s.name.endswith("_count"))


def test_operator_admission_bounds_and_keeps_arrival_order() -> None:
    admission = ReconcileSlots(2)
    running, most, entered = 0, 0, []

    async def one(i: int, gate: asyncio.Event) -> None:
        nonlocal running, most
        async with admission.slot(time.monotonic()):
            entered.append(i)
            running += 1
            most = max(most, running)
            await gate.wait()
            running -= 1

    async def run() -> None:
        gates = [asyncio.Event() for _ in range(5)]
        tasks = [asyncio.create_task(one(i, g)) for i, g in enumerate(gates)]
        while len(entered) < 2:
            await asyncio.sleep(0)
        assert entered == [0, 1]  # the others wait for a slot
        for gate in gates:  # every slot is handed on, in arrival order
            gate.set()
        await asyncio.gather(*tasks)

    before = _queue_count()
    asyncio.run(run())
    assert most == 2 and entered == [0, 1, 2, 3, 4]
    assert _queue_count() - before == 5  # every admitted reconcile's wait is observed


def test_operator_admission_works_across_event_loops() -> None:
    admission = ReconcileSlots(1)

    async def enter() -> bool:
        async with admission.slot(time.monotonic()):
            return True

    assert asyncio.run(enter()) and asyncio.run(enter())  # a new loop gets a new semaphore


def test_operator_poll_backoff_doubles_to_its_cap() -> None:
    assert [poll_backoff(n) for n in range(1, 6)] == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert POLL_BACKOFF_CAP == 30.0


def _rt_checked() -> JobRuntime:
    rt = JobRuntime(namespace="ns1", name="demo")
    rt.credentials.checked = True
    return rt


def test_operator_failed_call_rereads_credentials_only_when_they_may_be_why() -> None:
    cases: list[tuple[SyncerError, str, bool]] = [
        (SyncerError(0, "no answer"), "http://demo-syncer.ns1.svc:8470", True),  # kept
        (SyncerError(0, "no answer"), "https://demo-syncer.ns1.svc:8470", False),  # CA?
        (SyncerError(401, "who are you"), "http://demo-syncer.ns1.svc:8470", False),
        (SyncerError(500, "oops"), "http://demo-syncer.ns1.svc:8470", False),
        (credentials_error("token Secret tok not found"), "http://x:1", False),
    ]
    for err, url, kept in cases:
        rt = _rt_checked()
        asyncio.run(forget_client(rt, err, url))
        assert rt.credentials.checked is kept, (err, url)
        assert rt.syncer.client is None


def test_operator_unanswering_syncer_is_not_polled_again_before_its_backoff() -> None:
    body = job_body()  # syncer at http://127.0.0.1:9: nothing answers there
    kube = FakeKube(body)
    kube.secrets["tok"] = {"metadata": {"name": "tok"}, "data": {"token": "t" * 32}}
    rt = JobRuntime(namespace="ns1", name="demo")
    asyncio.run(rt.see_job(body))

    def sync() -> None:
        asyncio.run(sync_job(cast(Kube, kube), rt, reconcile=False, poll_syncer=True))

    sync()
    assert rt.syncer.failures == 1 and rt.syncer.status is None and rt.syncer.error
    assert rt.syncer.retry_at - time.monotonic() > poll_backoff(1) - 1
    reads = [c for c in kube.calls if c[0] == "read_secret"]
    assert reads == [("read_secret", "tok")]
    kube.calls.clear()
    error = rt.syncer.error
    sync()  # within the backoff: no poll, no Secret read, the error kept
    assert rt.syncer.failures == 1 and rt.syncer.error == error
    assert not [c for c in kube.calls if c[0] == "read_secret"]
    rt.syncer.retry_at = 0.0  # the backoff over: polled again, the Secret not re-read
    sync()
    assert rt.syncer.failures == 2
    assert not [c for c in kube.calls if c[0] == "read_secret"]


def _exported(phase: str) -> float:
    samples = metrics.JOBS.collect()[0].samples
    return next(s.value for s in samples if s.labels["phase"] == phase)


def test_operator_phase_gauge_counted_at_most_once_a_second_unless_forced() -> None:
    registry = Registry()
    registry.job("ns1", "a").phase = "Running"
    update_phase_gauge(registry, force=True, now=100.0)
    assert _exported("Running") == 1
    registry.job("ns1", "b").phase = "Running"
    update_phase_gauge(registry, now=100.5)  # within the interval: not counted again
    assert _exported("Running") == 1
    update_phase_gauge(registry, now=100.0 + PHASE_GAUGE_INTERVAL)
    assert _exported("Running") == 2
    registry.jobs.clear()
    update_phase_gauge(registry, force=True, now=101.1)  # a deletion is exported at once
    assert _exported("Running") == 0
