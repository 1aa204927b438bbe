"""The syncer's membership answers: an island joins, beats, leaves, or the admin sets its state.

Each is one short, P-free change of the membership (membership.py) under the service's lock,
admitted by the gate (gate.py: only the job's own island names), then the service's gauges and
merge scheduler are told (a join or a drop can complete a round). The service (service.Syncer)
answers the routes by delegating here; pushes have their own path (push.py).
"""

from __future__ import annotations

import logging
from typing import Any

from diloco_trainer.api.documents import HeartbeatAnswer, JoinInfo, MembershipAnswer
from diloco_trainer.syncer.gate import Gate
from diloco_trainer.syncer.global_model import GlobalModel
from diloco_trainer.syncer.push import PushHost
from diloco_trainer.syncer.records import Beat
from diloco_trainer.syncer.rounds import SyncState

log = logging.getLogger("diloco.syncer")


class MembershipRoutes:
    """Join, heartbeat, leave and the admin's membership change of one job's syncer."""

    def __init__(
        self, host: PushHost, *, state: SyncState, gate: Gate, model: GlobalModel, codec: str
    ) -> None:
        self.host = host
        self.state = state
        self.gate = gate
        self.model = model
        self.codec = codec

    async def join(self, island: str, replicas: int) -> dict[str, Any]:
        """Register an island; the fragment layout, current versions and the island's merged
        tokens (JoinInfo)."""
        async with self.host.locked():
            self.gate.admit(self.state.membership, island, self.host.clock())
            rec = self.state.membership.join(island, replicas, self.host.clock())
            merged_tokens = round(rec.merged_tokens)  # read under the lock a merge takes
        self.host.changed()
        log.info(
            "island %s joined (join %d, %d replicas, %s)", island, rec.joins, replicas, rec.state
        )
        return JoinInfo(
            fragments=self.model.fragments,
            versions=self.state.versions,
            outer_step=self.state.outer_step,
            finished=self.host.finished,
            codec=self.codec,
            pull_compression=self.model.pull_compression,
            state=rec.state,
            island_tokens=merged_tokens,
        ).to_wire()

    async def heartbeat(self, island: str, progress: Beat) -> dict[str, Any]:
        """A learner's sign of life; its membership state and whether the job finished
        (HeartbeatAnswer)."""
        async with self.host.locked():
            rec = self.state.membership.heartbeat(
                island,
                self.host.clock(),
                step=progress.step,
                tokens=progress.tokens,
                loss=progress.loss,
                step_time=progress.step_time,
                holding=progress.holding,
                drained=progress.drained,
            )
        self.host.changed()
        answer = HeartbeatAnswer(
            state=rec.state, finished=self.host.finished, versions=self.state.versions
        )
        return answer.to_wire()

    async def leave(self, island: str) -> dict[str, Any]:
        """An island says goodbye (MembershipAnswer)."""
        async with self.host.locked():
            rec = self.state.membership.leave(island, self.host.clock())
        self.host.changed()
        log.info("island %s left", island)
        return MembershipAnswer(island=island, state=rec.state).to_wire()

    async def set_membership(self, island: str, state: str, reason: str) -> dict[str, Any]:
        """Admin: mark an island active or dropped (MembershipAnswer)."""
        async with self.host.locked():
            members = self.state.membership
            if island not in members.islands:
                self.gate.admit(members, island, self.host.clock())
            rec = members.set_state(island, state, reason, self.host.clock())
        self.host.changed()
        log.info("island %s set %s by admin (%s)", island, state, reason or "no reason given")
        return MembershipAnswer(island=island, state=rec.state, reason=rec.reason).to_wire()
