"""Island membership at the syncer: who is in the job, who counts towards the quorum, and who
is still awaited (pure: no I/O, no clock, no torch; every method takes `now` from the caller).

The states and what moves an island between them are described in records.py. This room keeps
the records and applies those transitions; the round machine (rounds.py) owns it and is told of
every change through MembershipEvents, so a quorum is re-evaluated at once (a drop may undo a
quorum, a shrinking active set may complete a round) without this room knowing about rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from diloco_trainer.api.documents import IslandStatus
from diloco_trainer.api.manifest import SavedCount, SavedMergedPush
from diloco_trainer.api.protocol import dropped_for_refusals
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.state.records import (
    ACTIVE,
    DROPPED,
    LEFT,
    TIMED_OUT,
    AheadRefusal,
    IslandRecord,
    MergedPush,
    ahead_carried,
    carried_again,
)


class MembershipEvents(Protocol):
    """What the owner of the membership (the round machine) hears of its changes."""

    def withdrawn(self, island: str, now: float, *, forgotten: bool) -> None:
        """An island's pending work must leave the open rounds: an admin drop, or its record
        was forgotten to make room for another island (`forgotten`)."""

    def membership_changed(self, now: float) -> None:
        """Something that counts towards the quorum changed."""


class Membership:
    """The island records of one job's syncer. Not thread-safe: the caller locks."""

    def __init__(
        self, *, heartbeat_timeout: float, startup_timeout: float, events: MembershipEvents
    ) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.islands: dict[str, IslandRecord] = {}
        self._events = events
        # Islands the job has but the syncer has not heard of yet (see expect()).
        self._expected = 0
        self._expect_until = 0.0

    # ----- views -------------------------------------------------------------------------------

    def active(self) -> set[str]:
        """Islands that count towards the quorum."""
        return {n for n, r in self.islands.items() if r.state == ACTIVE and r.joins > 0}

    def active_records(self) -> list[IslandRecord]:
        """The records of the active islands."""
        active = self.active()
        return [r for n, r in self.islands.items() if n in active]

    def awaited(self) -> int:
        """Islands of the job not joined yet nor dropped, until the start-up timeout (records)."""
        heard = sum(1 for r in self.islands.values() if r.joins > 0 or r.state == DROPPED)
        return max(0, self._expected - heard)

    def island(self, name: str) -> IslandRecord:
        """A known island; Refused(404) for one that never joined."""
        rec = self.islands.get(name)
        if rec is None or rec.joins == 0:
            raise Refused(
                404, f"island {name!r} has not joined; POST /v1/join first", "unknown_island"
            )
        return rec

    # ----- transitions -------------------------------------------------------------------------

    def revive(self, rec: IslandRecord, now: float) -> None:
        """A sign of life (a heartbeat, join or push): timedOut and left islands are active
        again."""
        rec.last_seen = now
        if rec.state in (TIMED_OUT, LEFT):
            rec.state = ACTIVE
            rec.reason = ""

    def expect(self, count: int, now: float) -> None:
        """The job has `count` islands: the ones that have not joined count towards the quorum
        as if active until they join or are dropped, so the first island up does not merge alone
        when K > 1 just because its peers are slower to start, however slow. Only if nobody
        drops them are they given up on, the start-up timeout after `now` (expire)."""
        self._expected = count
        self._expect_until = now + self.startup_timeout
        self._events.membership_changed(now)

    def join(
        self, name: str, replicas: int, now: float, *, keeps_count: bool = False
    ) -> IslandRecord:
        """An island (re)starts: counts a join and makes it active unless an admin dropped it.

        `keeps_count`: its learner did not restart; it joins again because this syncer run
        resumed from a checkpoint that may lack its last join (learner/join_marks.join_unknown)
        and keeps counting from that join. The count's base is then the island's merged tokens
        in that checkpoint (restored_merged): the tokens it merged before that join and after
        the checkpoint are lost with the restart, and those merged since the restart are in
        its count already (as the base of its join, at the run's first merge of its pushes
        they were counted twice). Only once, on a record this run restored and that has not
        joined since; otherwise the join is an ordinary one (the island's merged tokens now)."""
        rec = self.islands.setdefault(name, IslandRecord(name=name))
        rec.joins += 1
        rec.replicas = replicas
        rec.reported_step = rec.reported_at = None  # a restarted learner's schedule starts anew
        # ...and its count of tokens: from the island's merged work (JoinInfo.island_tokens).
        rec.reported_tokens, rec.first_report = None, None
        restored, rec.restored_merged = rec.restored_merged, None
        restored_refused, rec.restored_refused = rec.restored_refused, 0.0
        if keeps_count and restored is not None:
            rec.count_base = restored
            # Refused by this run since its restore (the pushes refused as ahead pending too):
            # pushes of the learner's count, which goes on; the checkpoint's may be an older
            # join's (in no count of this learner's): dropped, as a join drops them.
            rec.refused_tokens = max(0.0, rec.refused_tokens - restored_refused)
        else:
            rec.count_base = rec.merged_tokens
            rec.refused_tokens = 0.0  # refused before this join: not in the new count either
            rec.ahead_refused.clear()
            rec.merged_pushes.clear()  # the new learner's pushes are on versions since the join
        # Its pace is measured afresh, but the split waits for it from its first join only
        # (targets.split_among): an island that rejoined every few seconds held it for ever.
        if rec.pace_since is None:
            rec.pace_since = now
        self.revive(rec, now)
        self._events.membership_changed(now)
        return rec

    def heartbeat(
        self,
        name: str,
        now: float,
        *,
        step: int = 0,
        tokens: int = 0,
        loss: float | None = None,
        step_time: float | None = None,
        holding: bool = False,
        drained: bool = False,
        waiting: float | None = None,
    ) -> IslandRecord:
        """A sign of life with progress figures; Refused(404) if the island never joined."""
        rec = self.island(name)
        self.revive(rec, now)
        rec.step = max(rec.step, step)
        if step != rec.reported_step:
            rec.reported_since = now
        rec.reported_step, rec.reported_at = step, now
        rec.tokens = max(rec.tokens, tokens)
        rec.reported_tokens = tokens
        if rec.first_report is None:
            rec.first_report = (tokens, now)
        if loss is not None:
            rec.loss = loss
        if step_time:
            rec.step_time = step_time
        rec.holding = holding
        rec.drained = drained
        rec.waiting = waiting  # each heartbeat's own: one without it (an older learner) is unknown
        self._events.membership_changed(now)
        return rec

    def refused_push(
        self, name: str, tokens: float, *, fragment: int, base: int, ahead: bool = False
    ) -> None:
        """A push of the island to `fragment` on version `base` was refused: `tokens` (the
        caller bounds the claim and averages it over fragments) its learner will not train
        again (IslandRecord.refused_tokens). `ahead` (409 `ahead`): its learner pushes it again
        unless the syncer merged past its base meanwhile, which its next push to the fragment
        tells (pushed: IslandRecord.ahead_refused), so it is counted only then."""
        rec = self.islands.get(name)
        if rec is None or rec.joins == 0:
            return
        self.pushed(name, fragment, base)
        # A push made again over one of its merged pushes (records.carried_again) loses only
        # the steps since that one: those of the merged push are in the island's merged tokens.
        tokens = max(0.0, tokens - carried_again(rec.merged_pushes.get(fragment), base))
        if ahead:
            rec.ahead_refused[fragment] = AheadRefusal(base, tokens)
        else:
            rec.refused_tokens += tokens

    def pushed(self, name: str, fragment: int, base: int) -> None:
        """A push of the island to `fragment` on version `base` came (accepted, or refused:
        refused_push): its push refused there as ahead, if any, is counted as refused unless
        this one carries its steps (records.ahead_carried)."""
        rec = self.islands.get(name)
        if rec is None:
            return
        pending = rec.ahead_refused.pop(fragment, None)
        if pending is not None and not ahead_carried(pending, base):
            rec.refused_tokens += pending.tokens

    def leave(self, name: str, now: float) -> IslandRecord:
        """The island says goodbye (e.g. it finished); it stops counting towards the quorum."""
        rec = self.island(name)
        rec.last_seen = now
        if rec.state != DROPPED:
            rec.state = LEFT
            rec.reason = "left"
        self._events.membership_changed(now)
        return rec

    def set_state(self, name: str, state: str, reason: str, now: float) -> IslandRecord:
        """Admin: mark an island active or dropped (pre-registering one that never joined).
        Dropping takes its pending contributions out of the open rounds. An admin drop keeps
        the syncer's own drop reason for refused pushes (the operator reads it)."""
        if state not in (ACTIVE, DROPPED):
            raise Refused(400, f"state must be 'active' or 'dropped', got {state!r}")
        rec = self.islands.setdefault(name, IslandRecord(name=name, last_seen=now))
        if not (state == DROPPED and dropped_for_refusals(rec.state, rec.reason)):
            rec.reason = reason
        rec.state = state
        if state == DROPPED:
            self._events.withdrawn(name, now, forgotten=False)
        else:
            rec.last_seen = now  # the timeout clock restarts when an admin re-adds it
        self._events.membership_changed(now)
        return rec

    def forget(self, name: str, now: float) -> None:
        """Remove an island's record (a new island takes its place; admission.evictable)."""
        self.islands.pop(name, None)
        self._events.withdrawn(name, now, forgotten=True)
        self._events.membership_changed(now)

    def expire(self, now: float) -> list[str]:
        """Mark active islands silent for longer than the heartbeat timeout as timedOut (and,
        after the start-up timeout, stop awaiting islands that never joined)."""
        gone = []
        if self._expected and now > self._expect_until:
            self._expected = 0
            self._events.membership_changed(now)
        for name, rec in self.islands.items():
            silent = now - rec.last_seen
            if rec.state == ACTIVE and rec.joins > 0 and silent > self.heartbeat_timeout:
                rec.state = TIMED_OUT
                rec.reason = f"no heartbeat or push for {silent:.1f}s"
                gone.append(name)
        if gone:
            self._events.membership_changed(now)
        return gone

    # ----- persistence -------------------------------------------------------------------------

    def statuses(self) -> dict[str, IslandStatus]:
        """Per-island records for status and checkpoints."""
        return {n: r.to_status() for n, r in sorted(self.islands.items())}

    def counts(self) -> dict[str, SavedCount]:
        """Per island that joined, its heartbeat count's frame, for checkpoints (SavedCount)."""
        return {
            n: SavedCount(
                base=r.count_base,
                refused=r.refused_tokens,
                merged=[
                    SavedMergedPush(fragment=f, base=m.base, tokens=m.tokens)
                    for f, m in sorted(r.merged_pushes.items())
                ],
            )
            for n, r in sorted(self.islands.items())
            if r.joins > 0
        }

    def restore(
        self,
        doc: Mapping[str, IslandStatus],
        now: float,
        counts: Mapping[str, SavedCount] | None = None,
    ) -> None:
        """Load island records from a checkpoint; their timeout clocks restart at `now`. Each
        count's frame (`counts`, SavedCount) too: a learner rides out a syncer restart without
        joining again and its count goes on from the base of its last join, so a base read as
        0 put a learner restarted mid-job (base: its merged tokens then) that far below its
        merged tokens, and its stop target that far past its share (adv17)."""
        counts = counts or {}
        for name, status in doc.items():
            rec = IslandRecord.from_status(name, status)
            rec.last_seen = now
            rec.pace_since = now  # its learner's next heartbeats measure its pace anew
            rec.restored_merged = rec.merged_tokens  # a join this checkpoint lacks counts from it
            saved = counts.get(name)
            if saved is not None:
                rec.count_base = max(0.0, saved.base)
                rec.refused_tokens = rec.restored_refused = max(0.0, saved.refused)
                rec.merged_pushes = {
                    m.fragment: MergedPush(m.base, max(0.0, m.tokens)) for m in saved.merged
                }
            self.islands[name] = rec
        self._events.membership_changed(now)
