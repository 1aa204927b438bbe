"""A FIFO bound on the first reconciles that run at once.

A job's first reconcile writes all its children (about 20 requests at 8 islands). When 1,000
jobs arrive together, letting every first reconcile start at once puts 20,000 requests into the
API threads' queue together: each job then waits for everyone's requests and none finishes
early. Admitting a few at a time, in arrival order, lets the early jobs finish first; the wait
for a slot is measured apart (diloco_operator_reconcile_queue_seconds) from the reconcile's own
time (diloco_operator_reconcile_seconds, from when its work starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from diloco_operator import metrics

# First reconciles running at once. With about 20 requests a round each, 8 keep the 32 API
# threads (kube.API_THREADS) busy while still finishing jobs in arrival order; 4 left them idle
# between rounds (200 jobs x 8 islands on a loaded 2-core kwok cluster: every job's children
# after 245 s with 4 slots, 159 s with 8; bench/operator_scale.py).
FIRST_RECONCILE_SLOTS = 8


class ReconcileSlots:
    """A semaphore made for the running event loop (tests run several loops in one process)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def _current(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:
            self._loop, self._semaphore = loop, asyncio.Semaphore(self.slots)
        return self._semaphore

    @contextlib.asynccontextmanager
    async def slot(self, queued_at: float) -> AsyncIterator[None]:
        """Hold one slot (waiters are served in arrival order); the wait since `queued_at`
        (time.monotonic()) is observed once the slot is held."""
        async with self._current():
            metrics.RECONCILE_QUEUE_SECONDS.observe(time.monotonic() - queued_at)
            yield


FIRST_RECONCILES = ReconcileSlots(FIRST_RECONCILE_SLOTS)
