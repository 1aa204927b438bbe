"""Push bodies on their way to the syncer (pure: no I/O, no clock; the caller locks).

A push's request reaches the syncer's handler as soon as its headers are in; its body, a
fragment's pseudo-gradient, may take most of a round more over a slow link. The edge
(edge/http.py) tells this registry when such a body starts to arrive, only for a request whose
bearer credential was verified and is an island's own (so it names the pusher: nothing in the
body is read or trusted for it) and whose declared Content-Length is within the fragment's push
limit; and when the request ends, however it ends. An unauthenticated, oversized or undeclared
body is never registered, so it changes nothing here.

The rounds (rounds.py, merge_due) read it at K < M: a merge whose quorum is met also waits for
the pushes of the same fragment that are on the way from the islands it is missing, each until
core/grace.upload_wait_until (about twice a typical upload from its start: each island's median,
then the lower median over the islands, core/grace.typical_upload; at least the grace
window, at most the heartbeat timeout), so islands that pushed at the same sync point merge
together and their pulls carry one version instead of a chain (docs/algorithm.md, "A merge
waits for the pushes on the way"). A registered body is a hint: whatever it turns out to be
(refused, stalled, never ended), it delays a merge by that bound at most, and an island's bodies
delay one round of a fragment once: the wait counts from the island's first body since the
fragment's last merge (`merged`), so an island that cuts its request and sends another, again
and again, cannot hold the rounds for ever (each new body would otherwise start a new wait).
"""

from __future__ import annotations

import math
from collections import deque

from diloco_trainer.core import grace as window_rules

# Recent accepted push bodies' upload seconds kept per island (recent behaviour matters, not
# history; four rounds of two fragments).
_WINDOW = 8


class Uploads:
    """The push bodies on their way, per fragment and island, and how long recent ones took."""

    def __init__(self, fragments: int) -> None:
        # fragment -> island -> when its body began to arrive (the service's clock)
        self._started: list[dict[str, float]] = [{} for _ in range(fragments)]
        # fragment -> island -> when its first body since the fragment's last merge began: the
        # start a wait counts from (a later body of it in the same round waits no longer)
        self._first: list[dict[str, float]] = [{} for _ in range(fragments)]
        # island -> its recent accepted bodies' upload seconds (core/grace.typical_upload reads
        # each island's own, so no island's trickle sets the wait for the others' bodies)
        self._seconds: dict[str, deque[float]] = {}

    def started(self, fragment: int, island: str, now: float) -> None:
        """`island`'s push body for `fragment` began to arrive at `now` (a second one at once
        from the same island, a retry, stands in for the first, but its wait still counts
        from the island's first body in this round)."""
        self._started[fragment][island] = now
        self._first[fragment].setdefault(island, now)

    def merged(self, fragment: int) -> None:
        """`fragment`'s round closed: the next round's waits count from the bodies still on
        their way (they will be its pushes) or sent from now on."""
        self._first[fragment] = dict(self._started[fragment])

    def ended(self, fragment: int, island: str, started: float, seconds: float | None) -> None:
        """The request registered at `started` ended; `seconds`: how long its body took to
        arrive when the push was accepted (None otherwise: a refused body says nothing of the
        link, and an island's refused pushes must not lengthen others' waits)."""
        if self._started[fragment].get(island) == started:
            del self._started[fragment][island]
        if seconds is not None and math.isfinite(seconds) and seconds >= 0.0:
            self._seconds.setdefault(island, deque(maxlen=_WINDOW)).append(seconds)

    def forget(self, island: str) -> None:
        """An island dropped or forgotten: none of its bodies is waited for any more, and its
        upload times no longer size the wait."""
        for uploads in (*self._started, *self._first):
            uploads.pop(island, None)
        self._seconds.pop(island, None)

    def holding(
        self, fragment: int, missing: set[str], now: float, *, grace: float, cap: float
    ) -> list[float]:
        """The ends of the waits (clock times after `now`) for the bodies of `fragment` on their
        way from the `missing` islands; empty when none holds the merge any more."""
        typical = window_rules.typical_upload(self._seconds)
        ends = [
            window_rules.upload_wait_until(
                started=self._first[fragment].get(island, started),
                typical=typical,
                grace=grace,
                cap=cap,
            )
            for island, started in self._started[fragment].items()
            if island in missing
        ]
        return sorted(end for end in ends if end > now)
