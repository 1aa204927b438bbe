"""What the service's sequences share: its locks, its clock, whether the job finished or the
syncer failed, and the merge scheduler's wake-up. The push path (push.py), the island calls
(island_calls.py) and the merge scheduler (service.py) each hold this one object, so none calls
back into the service.

Concurrency (service.py's docstring): one asyncio lock (`locked()`) makes every state change
atomic and is held only for short, P-free steps; one lock per fragment (`fragment_lock`) keeps a
fragment's fold and its merge apart; `merging` lets one merge run at a time (a stop or a digest
waits for the running one). They are created on the serving loop (`start()`). Lock order: a
fragment's lock before `locked()`, never after.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from diloco_trainer.syncer.errors import Refused


class Control:
    """The locks, clock and run state one job's syncer shares between its sequences."""

    def __init__(self, fragments: int, clock: Callable[[], float], *, finished: bool) -> None:
        self.fragments = fragments
        self.clock = clock
        self.finished = finished  # the job reached its stop: pushes are answered `finished`
        # Set when a merge failed half-way: the state can no longer be trusted, so the syncer
        # refuses work (503) and reports unhealthy until it is restarted from its checkpoint.
        self.failure: str | None = None
        self.stopping = False  # the scheduler ends at its next pass even if a cancel is lost
        self.lock: asyncio.Lock | None = None
        self.merging: asyncio.Lock | None = None
        self._fragment_locks: list[asyncio.Lock] = []
        self.poke: asyncio.Event | None = None

    def start(self) -> None:
        """Create the loop-bound primitives (call on the serving loop)."""
        self.lock = asyncio.Lock()
        self.merging = asyncio.Lock()
        self._fragment_locks = [asyncio.Lock() for _ in range(self.fragments)]
        self.poke = asyncio.Event()

    def locked(self) -> asyncio.Lock:
        """The lock every state change holds; Refused(503) once the syncer failed."""
        assert self.lock is not None, "Syncer.start() was not called"
        if self.failure:
            raise Refused(503, f"the syncer failed and must be restarted: {self.failure}")
        return self.lock

    def fragment_lock(self, fragment: int) -> asyncio.Lock:
        """The lock of one fragment's fold and merge (taken before `locked()`, never after)."""
        return self._fragment_locks[fragment]

    def wake(self) -> None:
        """Membership or rounds changed (a push recorded, an island joined or dropped): the
        merge scheduler looks again (a join or a drop can complete a round)."""
        if self.poke is not None:
            self.poke.set()
