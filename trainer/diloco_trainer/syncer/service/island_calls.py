"""The syncer's membership answers: an island joins, beats, leaves, or the admin sets its state.

Each is one short, P-free change of the membership (membership.py) under the service's lock,
admitted by the gate (gate.py: only the job's own island names), then the merge scheduler is
told (a join or a drop can complete a round). The routes (edge/http.py) call
these on `Syncer.islands`; pushes have their own path (push.py).
"""

from __future__ import annotations

import logging
from typing import Any

from diloco_trainer.api.documents import HeartbeatAnswer, JoinInfo, MembershipAnswer
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.island_rounds import RoundLimits
from diloco_trainer.syncer.intake import Gate, at_most, step_time_limit
from diloco_trainer.syncer.merging import GlobalModel
from diloco_trainer.syncer.service.control import Control
from diloco_trainer.syncer.state import (
    Beat,
    SyncState,
    budget_tokens,
    count_refused,
    done_range,
    horizon_seconds,
    lock_step_weights,
    merged_elsewhere,
    pace_of,
    pace_span_seconds,
    pace_wait_seconds,
    ready_to_split,
    running_islands,
    split_among,
    stop_targets,
)

log = logging.getLogger("diloco.syncer")


class IslandCalls:
    """Join, heartbeat, leave and the admin's membership change of one job's syncer."""

    def __init__(
        self,
        control: Control,
        *,
        state: SyncState,
        gate: Gate,
        model: GlobalModel,
        codec: str,
        spec: JobSpec,
        run: str = "",
        resumed: list[int] | None = None,
    ) -> None:
        """`run`, `resumed`: this syncer run's name and each fragment's version when it started
        (Syncer.run, Syncer.resumed_versions), told in join and heartbeat answers."""
        self.control = control
        self.run = run
        self.resumed = list(resumed or [])
        self.state = state
        self.gate = gate
        self.model = model
        self.codec = codec
        self.spec = spec
        # K < M: each island's stop target once the budget is near (targets.py); K = M islands
        # keep their own share (learner/drain.py) while every round is H, and get targets too,
        # split by tokens per round, once rounds differ (rounds.split; split_budget).
        islands = max(spec.islands.count, spec.total_shards())
        self.lock_step = spec.sync.quorum >= islands
        varies = RoundLimits.from_spec(spec).varies
        self.budget = budget_tokens(spec) if not self.lock_step or varies else None
        self.targets: dict[str, int] = {}
        # K = M: the islands whose answers said the budget is split (join or heartbeat since
        # rounds.split). One that has not heard it yet drains on its share of 1/M
        # (learner/drain.py); targets wait until every island still training has (ready_to_split).
        self.heard_split: set[str] = set()
        # The longest step time a heartbeat may claim (validation.step_time_limit).
        self.max_step_time = step_time_limit(spec.sync.heartbeat_timeout_seconds)

    async def join(self, island: str, replicas: int, keeps_count: bool = False) -> dict[str, Any]:
        """Register an island; the fragment layout, current versions and the island's merged
        tokens (JoinInfo). `keeps_count`: its learner did not restart but joins again because
        this run may lack its last join (Membership.join): its round, step-time readings and
        stop target stay as they are."""
        async with self.control.locked():
            self.gate.admit(self.state.membership, island, self.control.clock())
            members = self.state.membership
            rec = members.join(island, replicas, self.control.clock(), keeps_count=keeps_count)
            rounds = self.gate.rounds
            if not keeps_count:
                rounds.joined(rec, members.active_records(), self.control.clock())
                # A restarted learner counts its tokens from zero again: its target (in the old
                # count) would let it train far past the budget. It trains on without one.
                self.targets.pop(island, None)
                if island in (self.state.split_to or ()):
                    self.state.split_to = frozenset(self.targets) or None
            inner_steps = rounds.steps_of(rec, island)
            if rounds.split:
                self.heard_split.add(island)  # its JoinInfo says so
            merged_tokens = round(rec.merged_tokens)  # read under the lock a merge takes
        self.control.wake()
        log.info(
            "island %s joined (join %d, %d replicas, %s)", island, rec.joins, replicas, rec.state
        )
        return JoinInfo(
            fragments=self.model.fragments,
            versions=self.state.versions,
            outer_step=self.state.outer_step,
            finished=self.control.finished,
            codec=self.codec,
            pull_compression=self.model.pull_compression,
            state=rec.state,
            island_tokens=merged_tokens,
            inner_steps=inner_steps,
            split_budget=rounds.split,
            run=self.run,
            joins=rec.joins,
        ).to_wire()

    async def heartbeat(self, island: str, progress: Beat) -> dict[str, Any]:
        """A learner's sign of life; its membership state and whether the job finished
        (HeartbeatAnswer). A step time beyond the job's limit is refused (400): it is no step
        the job's learners take, only a lever on the work-rate bounds (guards.WorkRate)."""
        at_most(progress.step_time, self.max_step_time, "heartbeat", "stepTime")
        async with self.control.locked():
            rec = self.state.membership.heartbeat(
                island,
                self.control.clock(),
                step=progress.step,
                tokens=progress.tokens,
                loss=progress.loss,
                step_time=progress.step_time,
                holding=progress.holding,
                drained=progress.drained,
                waiting=progress.waiting,
            )
            members = self.state.membership
            rounds = self.gate.rounds
            before = rounds.steps_of(rec, island)
            rounds.last_rule = ""
            rounds.read(rec, members.active_records(), self.control.clock())
            inner_steps = rounds.steps_of(rec, island)
            if inner_steps != before or "probe" in rounds.last_rule:
                # the readings behind a round's change (bench/hetero reads them from this log)
                log.info(
                    "%s: rounds of %d inner steps (was %d) at its step %d, step time %.4fs "
                    "(%s; reference %.4fs; active islands' step times %s)",
                    island,
                    inner_steps,
                    before,
                    progress.step,
                    progress.step_time or 0.0,
                    rounds.last_rule,
                    rounds.last_reference or 0.0,
                    {r.name: round(r.step_time or 0.0, 4) for r in members.active_records()},
                )
            split = rounds.split
            if split:
                self.heard_split.add(island)  # this answer says so
            self._set_targets()
        self.control.wake()
        answer = HeartbeatAnswer(
            state=rec.state,
            finished=self.control.finished,
            versions=self.state.versions,
            stop_at=self.targets.get(island),
            inner_steps=inner_steps,
            split_budget=split,
            run=self.run,
            resumed=self.resumed,
            joins=rec.joins,
        )
        return answer.to_wire()

    def stop_target(self, island: str) -> int | None:
        """The island's stop target, None before the split or for one left out of it."""
        return self.targets.get(island)

    def _set_targets(self) -> None:
        """Fix every active island's stop target once the budget is near (lock held).

        An island that said it drained is done: its merged tokens count as final and it gets
        no target; what is left is split among those still training (running_islands) whose
        pace is known, an island without one waited for only a bounded time after its first
        join (split_among: one that never reports its count holds no other's target). At
        K = M that waits until each of them has heard that the budget is split: until then it
        may drain on its share, which a target above the share would count on (the stall at
        the drain of issues 45/47: docs/algorithm.md, "The drain")."""
        if self.budget is None or self.targets or self.control.finished:
            return
        if self.lock_step and not self.gate.rounds.split:
            return  # every round is H: each island keeps its share of 1/M (learner/drain.py)
        members = self.state.membership
        now = self.control.clock()
        timeout = self.spec.sync.heartbeat_timeout_seconds
        running = running_islands(members.active_records())
        span = pace_span_seconds(timeout)
        # Each island's count is held to what its own record and the spec support (issue 46):
        # growing faster than it could process, it is left out of the split; within that, its
        # part of what is done lies between its merged tokens and a capped push's more.
        bounds = {r.name: self.gate.count_bound(members, r.name) for r in running}
        split = split_among(
            running, now=now, wait=pace_wait_seconds(timeout), min_span=span, bounds=bounds
        )
        if not split:
            return  # a new island's pace is awaited, or no island's is known
        if self.lock_step and not ready_to_split(split, self.heard_split):
            return
        paces = {r.name: p for r in split if (p := pace_of(r, span)) is not None}
        step_tokens = {r.name: self.spec.inner.tokens_per_step * r.replicas for r in split}
        weights = None
        if self.lock_step:
            rounds = {r.name: self.gate.rounds.steps_of(r, r.name) for r in split}
            weights = lock_step_weights(rounds, step_tokens)
        targets = stop_targets(
            paces,
            done_elsewhere=merged_elsewhere(members.islands.values(), set(paces)),
            budget=self.budget,
            step_tokens=step_tokens,
            now=now,
            horizon=horizon_seconds(timeout),
            weights=weights,
            done_ranges={n: done_range(members.islands[n], bounds[n]) for n in paces},
        )
        if targets is not None:
            self.targets = targets
            self.state.split_to = frozenset(targets)  # the others hold no last round nor finish
            log.info("the budget is near: stop targets (tokens each learner counts) %s", targets)
            refused = {
                r.name: why
                for r in running
                if (p := pace_of(r, span)) is not None
                and (why := count_refused(r, p, bounds[r.name])) is not None
            }
            for name, why in sorted(refused.items()):
                log.warning(
                    "island %s: %s; left out of the split, no stop target (its count moves no "
                    "other island's target)",
                    name,
                    why,
                )
            left_out = sorted(
                r.name for r in running if r.name not in targets and r.name not in refused
            )
            if left_out:
                log.warning(
                    "no pace known for %s (no heartbeat with a growing token count within %.0fs "
                    "of its first join): left out of the split, no stop target; it trains on until "
                    "the finish and holds neither the targets nor the finish",
                    ", ".join(left_out),
                    pace_wait_seconds(timeout),
                )

    async def leave(self, island: str) -> dict[str, Any]:
        """An island says goodbye (MembershipAnswer)."""
        async with self.control.locked():
            rec = self.state.membership.leave(island, self.control.clock())
        self.control.wake()
        log.info("island %s left", island)
        return MembershipAnswer(island=island, state=rec.state).to_wire()

    async def set_membership(self, island: str, state: str, reason: str) -> dict[str, Any]:
        """Admin: mark an island active or dropped (MembershipAnswer)."""
        async with self.control.locked():
            members = self.state.membership
            if island not in members.islands:
                self.gate.admit(members, island, self.control.clock())
            rec = members.set_state(island, state, reason, self.control.clock())
        self.control.wake()
        log.info("island %s set %s by admin (%s)", island, state, reason or "no reason given")
        return MembershipAnswer(island=island, state=rec.state, reason=rec.reason).to_wire()
