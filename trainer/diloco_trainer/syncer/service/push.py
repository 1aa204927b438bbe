"""The push path: a pushed pseudo-gradient from its body to its fragment's round, in one place.

In order (receive):

1. authenticate: the body's safetensors header is read once, and the credential must be allowed
   to push as the island its metadata names (credentials.require_push; the root may push as any);
2. parse the metadata into typed, bounded fields (validation.parse_push_meta) and take the
   still-encoded tensors;
3. admit: the island is known and not dropped, the push's base version neither stale nor ahead
   (rounds.check_push), unless the job finished or this pushId was answered already (the first
   answer again, marked duplicate);
4. guard the work it claims (steps, tokens for its replicas; gate.check_work), then, measured in
   a worker thread off the lock (decoded a slice at a time: no decoded copy), its values (finite,
   norm bounds; gate.check_delta), with 3 checked again (a merge or a drop may have happened
   while it was measured);
5. record it in the fragment's round (rounds.accept_push), which answers it, and fold it into
   the round's merge (folding.py, in a worker thread, holding the fragment's lock but not the
   service's): the round keeps it encoded.

A refusal of its content (400 from decoding, 422 from the guards) counts towards the island's
refusals in a row (gate.refused: maxRefusals in a row drop it); a refusal of the body or its
metadata (1, 2) does not, as the island is not known to be the pusher then. A push changes
nothing until 5.
"""

from __future__ import annotations

import asyncio

import torch

from diloco_trainer.api.credentials import Principal
from diloco_trainer.api.documents import PushAnswer
from diloco_trainer.api.protocol import PushMeta
from diloco_trainer.syncer.edge.access import require_push
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.intake.gate import Gate
from diloco_trainer.syncer.intake.payload import EncodedPayload
from diloco_trainer.syncer.intake.validation import (
    measure_push,
    parse_push_meta,
    push_contribution,
    read_push_header,
    read_push_tensors,
)
from diloco_trainer.syncer.merging.global_model import GlobalModel
from diloco_trainer.syncer.service.control import Control
from diloco_trainer.syncer.state.gauges import SyncerMetrics
from diloco_trainer.syncer.state.rounds import SyncState


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

    async def receive(
        self, fragment: int, body: bytes | bytearray, principal: Principal
    ) -> PushAnswer:
        """Steps 1-5 (the module docstring); Refused, with nothing changed, on a problem."""
        raw_meta = read_push_header(body)
        require_push(principal, raw_meta)  # 1.
        meta = parse_push_meta(raw_meta, self.codec)  # 2.
        flat = await asyncio.to_thread(read_push_tensors, body)  # P-sized: off the loop
        try:
            return await self._admit_guard_record(fragment, flat, meta, len(body))
        except Refused as err:
            if err.status in (400, 422):
                await self._refused(fragment, meta.island, err)
            raise

    async def _admit_guard_record(
        self, fragment: int, flat: dict[str, torch.Tensor], meta: PushMeta, size: int
    ) -> PushAnswer:
        """Steps 3-5."""
        control, members = self.control, self.state.membership
        async with control.locked():
            early = self._finished_or_duplicate(fragment, meta)
            if early is not None:
                return early
            self.state.check_push(fragment, meta.island, meta.base_version)  # 3.
            self.gate.check_work(members, meta.island, tokens=meta.tokens, steps=meta.steps)  # 4.
        # Kept encoded (folding.py): checked and measured, then folded, a slice at a time.
        payload = EncodedPayload(flat, self.codec, self.model.expected[fragment])
        stats = await asyncio.to_thread(measure_push, fragment, payload)
        async with control.fragment_lock(fragment):  # its fold, apart from its merge only
            async with control.locked():
                early = self._finished_or_duplicate(fragment, meta)
                if early is not None:
                    return early
                now = control.clock()
                lag = self.state.check_push(fragment, meta.island, meta.base_version)  # 3. again
                self.gate.check_delta(fragment, meta.island, stats)  # 4.
                contribution = push_contribution(meta, lag=lag, payload=payload, now=now)
                answer = self.state.accept_push(fragment, contribution, now)  # 5.
                self.gate.accepted(fragment, meta.island, stats)
                self.bytes_in += size
                self.metrics.bytes_in.inc(size)
                lag_rounds = self.state.lag_rounds(fragment, meta.base_version)
            # Folded into its round off the loop and off the service's lock; the fragment's lock
            # keeps its merge out until it is (a cancelled request too: the lock goes only once
            # the thread is done).
            folding = asyncio.ensure_future(
                asyncio.to_thread(self.model.fold_push, fragment, contribution, payload, lag_rounds)
            )
            try:
                await asyncio.shield(folding)
            except asyncio.CancelledError:
                await folding
                raise
        control.wake()
        return answer

    async def _refused(self, fragment: int, island: str, err: Refused) -> None:
        async with self.control.locked():
            members = self.state.membership
            dropped = self.gate.refused(members, fragment, island, err, self.control.clock())
        if dropped:
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
