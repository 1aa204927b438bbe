"""Event-driven syncs coalesce per job; the timer stops once the job is forgotten."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from diloco_operator import triggers
from diloco_operator.runtime import Registry


def test_request_sync_collapses_a_burst_into_two_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[bool] = []

    async def scenario() -> None:
        release = asyncio.Event()

        async def fake_sync(kube: Any, rt: Any, *, reconcile: bool, poll_syncer: bool) -> bool:
            runs.append(reconcile)
            await release.wait()
            return True

        monkeypatch.setattr(triggers, "sync_job", fake_sync)
        registry = Registry(kube=object())  # type: ignore[arg-type]
        rt = registry.job("ns1", "demo")
        triggers.request_sync(registry, rt, reconcile=False)
        await asyncio.sleep(0)  # the first run starts and waits
        for index in range(20):
            triggers.request_sync(registry, rt, reconcile=index == 7)
        release.set()
        assert rt.drain is not None
        await rt.drain

    asyncio.run(scenario())
    assert runs == [False, True]  # one run for the burst, which asked for a reconcile once


def test_timer_stops_once_the_job_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    polls: list[bool] = []

    async def scenario() -> None:
        registry = Registry(kube=object())  # type: ignore[arg-type]

        async def fake_sync(kube: Any, rt: Any, *, reconcile: bool, poll_syncer: bool) -> bool:
            polls.append(poll_syncer)
            return len(polls) < 3  # the third run finds the job gone

        monkeypatch.setattr(triggers, "sync_job", fake_sync)
        monkeypatch.setattr(triggers, "STATUS_INTERVAL", 0.0)
        monkeypatch.setattr(triggers, "TIMER_INITIAL_DELAY", 0.0)
        rt = registry.job("ns1", "demo")
        triggers.ensure_timer(registry, rt)
        timer = rt.timer
        assert timer is not None
        await asyncio.wait_for(asyncio.gather(timer, return_exceptions=True), timeout=10)
        assert registry.find("ns1", "demo") is None

    asyncio.run(scenario())
    assert polls == [True, True, True]


def test_sync_logged_counts_errors_and_keeps_going(monkeypatch: pytest.MonkeyPatch) -> None:
    async def failing(kube: Any, rt: Any, *, reconcile: bool, poll_syncer: bool) -> bool:
        raise RuntimeError("boom")

    monkeypatch.setattr(triggers, "sync_job", failing)
    registry = Registry(kube=object())  # type: ignore[arg-type]
    rt = registry.job("ns1", "demo")
    before = triggers.metrics.RECONCILES.labels(result="error")._value.get()
    asyncio.run(triggers.sync_logged(registry, rt, reconcile=True, poll_syncer=False))
    assert triggers.metrics.RECONCILES.labels(result="error")._value.get() == before + 1
    assert registry.find("ns1", "demo") is rt  # an error is not a deleted job
