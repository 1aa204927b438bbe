"""A fresh decoupled job's islands take their first inner step together.

Learners of a decoupled job (K < M: a merge needs K pushes, not every island's) keep the phase
they start with, whether they block for their own merge (no overlap) or not: each times its
pushes by its own step count, so an island whose processes started seconds after the others'
pushes every fragment that much later, round after round, until phase alignment
(phase_alignment.py) has moved it a few steps at a time. Where rounds are short that is whole
rounds: in bench/decoupled_quality (gpt-tiny, rounds of about a second on two shared cores) two
of four islands joined 2.9 s after the others, the first merges held two islands' work, the late
two pushed 60 and 90 steps at once, and K = 2 ended 3.6% behind K = M, where its runs whose
islands joined together were within 1% (bench/log/2026-11-27.md, "a fresh job's islands started
together").

So in a fresh job (every fragment at version 0) rank 0 waits, once it has joined and taken the
global weights, until the syncer has heard of every island of the job (its status's
awaitedIslands is 0), for at most sync.heartbeatTimeoutSeconds: the time after which the syncer
stops waiting for a silent island too, so an island whose pods wait for quota or a node holds
the others that long at most. A job at K = M needs none of it: every merge waits for every
island, which lines them up at the first one. A learner that joins a running job starts in
phase with its merges instead (schedule.schedule_start).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence

from diloco_trainer.api.protocol import SyncerError
from diloco_trainer.learner.syncer_link import SyncerLink

log = logging.getLogger("diloco.learner")

# How often rank 0 asks the syncer whether every island has joined: the islands start within
# this of each other (0.1 s is 3 steps of the benchmark's 0.03 s, under phase alignment's dead
# band of an eighth of a round).
START_POLL_SECONDS = 0.1


def starts_together(versions: Sequence[int], *, lock_step: bool) -> bool:
    """Whether a learner that joined with these fragment versions waits for the job's other
    islands before its first step: a fresh job (no merge yet) whose merges do not wait for
    every island (K < M). Not whether the learner blocks for its merge: at K < M with no
    overlap it does, but its merge needs only K pushes, so a late island's phase is kept as
    much as a non-blocking one's."""
    return not lock_step and not any(versions)


def wait_for_peers(
    link: SyncerLink,
    *,
    budget: float,
    stop: threading.Event,
    poll: float = START_POLL_SECONDS,
) -> int:
    """Ask the syncer every `poll` seconds until it awaits no island, `budget` seconds have
    passed, a stop, or the syncer does not answer (then start at once: phase alignment is the
    fallback); the number of islands still awaited when it returns (-1: not known)."""
    started = time.monotonic()
    awaited, said = -1, False
    while not stop.is_set():
        try:
            awaited = link.submit(link.awaited()).result(timeout=max(poll, 10.0))
        except (SyncerError, concurrent.futures.TimeoutError) as err:
            log.info("could not ask the syncer which islands have joined (%s): starting now", err)
            return -1
        waited = time.monotonic() - started
        if awaited <= 0:
            if said:
                log.info("every island has joined after %.1fs: starting together", waited)
            return awaited
        if waited >= budget:
            log.warning(
                "starting without %d island(s) that have not joined after %.0fs "
                "(sync.heartbeatTimeoutSeconds); they start in phase with the merges they meet",
                awaited,
                waited,
            )
            return awaited
        if not said:
            log.info(
                "waiting for %d island(s) to join before the first step, at most %.0fs: a fresh "
                "job's islands start together, so their pushes meet in the same merges",
                awaited,
                budget,
            )
            said = True
        stop.wait(poll)
    return awaited
