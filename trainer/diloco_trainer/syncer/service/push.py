"""The push path: a pushed pseudo-gradient from its body to its fragment's round, in one place.

`PushPath.receive` is the whole sequence, one call a step (ARCHITECTURE.md, "The path of a
push", lists it with the merge that makes it pullable):

1. read (validation.read_push, a worker thread): the body's safetensors header once, the
   credential allowed to push as the island its metadata names (rights.require_push; the root
   may push as any), the metadata parsed into typed, bounded fields, the still-encoded tensors;
2. admit (gate.admit_push, the service's lock): the island known and not dropped, the push's
   base version neither stale nor ahead, the work it claims (steps, tokens for its replicas)
   within the guards' bounds; unless the job finished or this pushId was answered already (the
   first answer again, marked duplicate);
3. measure (validation.measure_push, a worker thread, off the lock): its names, shapes and
   encodings, and its values' stats, decoded a slice at a time (no decoded copy);
4. judge (gate.judge_push, the fragment's lock and the service's): admitted again (a merge or a
   drop may have happened while it was measured), its values within the guards' bounds (finite,
   norm bounds) -> the round's Contribution;
5. record (rounds.accept_push): the round takes it and answers it; the guards' history takes
   its norm;
6. fold (global_model.fold_push, a worker thread, holding the fragment's lock but not the
   service's): folded into the round's merge, kept encoded; in a K = M round in island order,
   not arrival order, when its learners apply merges at fixed steps (SyncState.fold_order,
   merging/folding.py), so its merge is repeatable.

A refusal of its content (400 from decoding, 422 from the guards) counts towards the island's
refusals in a row (gate.refused: maxRefusals in a row drop it); a refusal of the body or its
metadata (1) does not, as the island is not known to be the pusher then. A push changes nothing
until 5. The path holds the service's Control (its locks, clock and run state), not the service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from diloco_trainer.api.client import RETRY_STATUSES
from diloco_trainer.api.credentials import Principal
from diloco_trainer.api.documents import PushAnswer
from diloco_trainer.api.protocol import PushMeta
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.intake import (
    MAX_SECONDS,
    DeltaStats,
    EncodedPayload,
    Gate,
    IncomingPush,
    measure_push,
    read_push,
)
from diloco_trainer.syncer.merging import GlobalModel
from diloco_trainer.syncer.service.control import Control
from diloco_trainer.syncer.state import Contribution, SyncerMetrics, SyncState


class PushPath:
    """Pushes of one job's syncer, from body to round."""

    def __init__(
        self,
        control: Control,
        *,
        state: SyncState,
        gate: Gate,
        model: GlobalModel,
        codec: str,
        metrics: SyncerMetrics,
    ) -> None:
        self.control = control
        self.state = state
        self.gate = gate
        self.model = model
        self.codec = codec
        self.metrics = metrics
        self.bytes_in = 0  # the bodies of accepted pushes
        # The longest stepTime a push may claim (validation.step_time_limit; the service sets it).
        self.max_step_time = MAX_SECONDS
        # An island's stop target, None before the split (IslandCalls.stop_target; the service
        # sets it): each answer carries it (PushAnswer.stop_at).
        self.stop_target: Callable[[str], int | None] = lambda island: None

    async def receive(
        self, fragment: int, body: bytes | bytearray, principal: Principal
    ) -> PushAnswer:
        """Steps 1-6 (the module docstring); Refused, with nothing changed, on a problem."""
        push = await asyncio.to_thread(
            read_push, body, principal, self.codec, self.max_step_time
        )  # 1. P-sized
        meta = push.meta
        control = self.control
        try:
            async with control.locked():
                early = self._finished_or_duplicate(fragment, meta)
                if early is not None:
                    return self._with_target(early, meta.island)
                self.gate.admit_push(self.state, fragment, meta)  # 2.
            payload = EncodedPayload(push.flat, self.codec, self.model.expected[fragment])
            stats = await asyncio.to_thread(measure_push, fragment, payload)  # 3.
            async with control.fragment_lock(fragment):  # its fold, apart from its merge only
                async with control.locked():
                    early = self._finished_or_duplicate(fragment, meta)
                    if early is not None:
                        return self._with_target(early, meta.island)
                    now = control.clock()
                    contribution = self.gate.judge_push(  # 4.
                        self.state, fragment, meta, payload, stats, now
                    )
                    answer = self._record(fragment, push, contribution, stats, now)  # 5.
                    lag_rounds = self.state.lag_rounds(fragment, meta.base_version)
                    order = self.state.fold_order(fragment)
                await self._fold(fragment, contribution, payload, lag_rounds, order)  # 6.
        except Refused as err:
            await self._refused(fragment, meta, err)
            raise
        control.wake()
        return self._with_target(answer, meta.island)

    def _with_target(self, answer: PushAnswer, island: str) -> PushAnswer:
        """The answer with the island's stop target, as it is now (not the saved answer's:
        a replay says the target then)."""
        target = self.stop_target(island)
        return answer if target is None else answer.model_copy(update={"stop_at": target})

    def _record(
        self,
        fragment: int,
        push: IncomingPush,
        contribution: Contribution,
        stats: DeltaStats,
        now: float,
    ) -> PushAnswer:
        """Step 5 (the service's lock held): the round takes the contribution and answers it;
        the guards' history takes its norm and the island's refusals in a row reset."""
        island = push.meta.island
        # the island's round now, in its answer (a replay of the answer says the same)
        inner_steps = self.gate.rounds.steps_of(self.state.membership.islands.get(island), island)
        answer = self.state.accept_push(fragment, contribution, now, inner_steps=inner_steps)
        # settles a push of it refused as ahead (gate.refused_push): carried by this one or not
        self.state.membership.pushed(island, fragment, push.meta.base_version)
        self.gate.guard.accepted(fragment, island, stats, push.meta.steps)
        self.bytes_in += push.size
        self.metrics.bytes_in.inc(push.size)
        return answer

    async def _fold(
        self,
        fragment: int,
        contribution: Contribution,
        payload: EncodedPayload,
        lag_rounds: float,
        order: list[str] | None,
    ) -> None:
        """Step 6, off the loop and off the service's lock; the fragment's lock (held by the
        caller) keeps its merge out until it is done (a cancelled request too: the lock goes
        only once the thread is done)."""
        folding = asyncio.ensure_future(
            asyncio.to_thread(
                self.model.fold_push, fragment, contribution, payload, lag_rounds, order
            )
        )
        try:
            await asyncio.shield(folding)
        except asyncio.CancelledError:
            await folding
            raise

    async def _refused(self, fragment: int, meta: PushMeta, err: Refused) -> None:
        """A push refused after its metadata was read: a refusal its learner does not retry
        (api/client.RETRY_STATUSES) leaves its tokens untrained for good, and its heartbeat
        count ahead of its merged tokens by them (gate.refused_push: the stop targets' bound on
        that count; one refused as ahead only once its next push tells that the learner did
        not push its steps again); a refusal of its content (400, 422) counts towards a drop."""
        island = meta.island
        async with self.control.locked():
            members = self.state.membership
            if err.status not in RETRY_STATUSES:
                self.gate.refused_push(members, fragment, meta, err.code)
            if err.status not in (400, 422):
                return
            now = self.control.clock()
            dropped = self.gate.refused(members, fragment, island, err, now)
            # this refusal may have named its island unsupported: the quorum no longer counts it
            left_out = self.gate.update_unsupported(self.state, now)
        if dropped or left_out:
            self.control.wake()

    def _finished_or_duplicate(self, fragment: int, meta: PushMeta) -> PushAnswer | None:
        if self.control.finished:
            return PushAnswer(
                accepted=False,
                finished=True,
                version=self.state.versions[fragment],
                pending=0,
                reason="the job has finished",
            )
        prev = self.state.previous_answer(fragment, meta.island, meta.push_id)
        return prev.model_copy(update={"duplicate": True}) if prev is not None else None
