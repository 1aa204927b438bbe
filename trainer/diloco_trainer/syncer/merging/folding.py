"""Each fragment's round folded as its pushes arrive, and the pushes kept encoded.

Memory flat in the number of islands: an accepted push is folded into its fragment's accumulator
(core/fold.py) with the weight and scale its merge will give it (core/contributions.py: they
depend on its own tokens, steps and staleness only; staleness cannot change while its round is
open, as only this fragment's merge moves its clock, and that merge takes the round). The decoded
fp32 copy is then dropped; the contribution keeps its still-encoded tensors (EncodedPayload, the
int8 body at a quarter of fp32) for the rare merge that must leave an offender out, spilled to a
file under the state dir (`RoundFolds.spill_to`), so what a round holds in memory does not grow
with the number of islands; the file is deleted with the contribution.

The merge uses the fold when it holds exactly the round's contributions with the plan's weights
and scales; otherwise (a push replaced by its island's newer one, contributions left out by a
failed merge, a fold that failed) it merges the encoded payloads again the batch way, decoding a
tensor at a time. Either way the result is the batch merge's, up to rounding.

The order of the sum: fp32 addition is not associative, so a fold's bits depend on the order
its pushes are added. A round that will hold every island it spans (K = M), in a job whose
learners apply each merge at a fixed step (the push path gives `order`: SyncState.fold_order),
is folded in that fixed order, by island name (the order of SyncState.peek_round, and so of
the batch merge), never in arrival order: a push that comes before an island ahead of it is
kept encoded (as every folded push is) and folded as soon as the islands ahead of it are, the
rest at the merge. So such a merge's bits are a function of its pushes alone, whatever their
timing (docs/algorithm.md, "What a seed repeats"). The cost: the pushes that came before an
island ahead of them are folded after it arrives, on the merge's path (with random arrival,
(M + 1) / 2 folds on average instead of 1). A round that may merge any K of them (K < M) is
folded in arrival order: which pushes a merge holds depends on timing there anyway, and folding
each at once keeps the merge's path short; so is a K = M round of learners whose apply steps
depend on measured latencies (the default fitted overlap): such a job cannot repeat, and the
order would only cost time.

Synchronous: the push path folds in a worker thread with the fragment's lock held, the merge
takes the fold with the same lock held.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco_trainer.core.contributions import Contributor, MergePlan, plan_merge
from diloco_trainer.core.fold import MergeFold, SlicedVectors
from diloco_trainer.syncer.intake import EncodedPayload
from diloco_trainer.syncer.state import Contribution

log = logging.getLogger("diloco.syncer")

_Vectors = Mapping[str, torch.Tensor] | SlicedVectors


@dataclass
class _Folded:
    fold: MergeFold
    # What went in, in order: the contributions (by identity) and their weight and scale.
    items: list[tuple[Contribution, float, float]] = field(default_factory=list)
    # Folded in a fixed order of islands (a K = M round), not in arrival order.
    ordered: bool = False
    # Of an ordered fold: the pushes waiting for an island ahead of them, by island (their
    # pseudo-gradient still encoded, their weight and scale).
    deferred: dict[str, tuple[Contribution, _Vectors, float, float]] = field(default_factory=dict)


class RoundFolds:
    """The folds of one job's open rounds, one per fragment with pushes (not thread-safe: the
    caller holds the service's lock)."""

    def __init__(
        self, fragments: int, *, rule: str, inner_steps: int, plain_names: frozenset[str]
    ) -> None:
        self.rule = rule
        self.inner_steps = inner_steps
        self.plain_names = plain_names
        self._folds: list[_Folded | None] = [None] * fragments
        self.spill_dir: Path | None = None  # where folded pushes' encoded tensors go (spill_to)
        # Where a fragment's new fold accumulates (global_model.py: the memory its next pull
        # body is written in); None: new tensors.
        self.buffers: Callable[[int], Mapping[str, torch.Tensor]] | None = None

    def spill_to(self, directory: Path) -> None:
        """Spill each folded push's encoded tensors to a file under `directory` (emptied now:
        what a previous process left there belongs to rounds that are gone)."""
        shutil.rmtree(directory, ignore_errors=True)
        self.spill_dir = directory

    def weight_and_scale(
        self, contribution: Contribution, lag_rounds: float
    ) -> tuple[float, float]:
        """The weight ρ and scale s the merge plan gives this contribution (core/contributions)."""
        plan = plan_merge(
            [
                Contributor(
                    contribution.tokens,
                    contribution.steps,
                    lag_rounds,
                    contribution.clip,
                    contribution.credit_steps,
                )
            ],
            rule=self.rule,
            inner_steps=self.inner_steps,
            islands=1,
        )
        return plan.weights[0], plan.scales[0]

    def add(
        self,
        f: int,
        contribution: Contribution,
        decoded: Mapping[str, torch.Tensor] | SlicedVectors,
        lag_rounds: float,
        order: Sequence[str] | None = None,
    ) -> bool:
        """Fold an accepted contribution's pseudo-gradient (decoded, or its EncodedPayload,
        decoded a slice at a time into the accumulator) into fragment f's round;
        False when it cannot be (logged; the fold is dropped and the merge merges the encoded
        payloads, which meets the same error where the merge's guards can handle it).

        `order`: the islands the round will hold, in the order its fold sums them (a K = M
        round, SyncState.fold_order): the push waits, kept encoded, until every island ahead
        of it is folded (the module docstring). None: folded at once (arrival order)."""
        folded = self._folds[f]
        try:
            weight, scale = self.weight_and_scale(contribution, lag_rounds)
            if folded is None:
                buffer = self.buffers(f) if self.buffers is not None else None
                folded = self._folds[f] = _Folded(
                    MergeFold(self.rule, self.plain_names, buffer), ordered=order is not None
                )
            if folded.ordered:
                folded.deferred[contribution.island] = (contribution, decoded, weight, scale)
                self._fold_in_order(folded, order or ())
            else:
                folded.fold.add(decoded, weight, scale)
                folded.items.append((contribution, weight, scale))
            # after its fold, if it was folded now: read from memory, not back from the file
            self._spill(f, contribution)
        except (ValueError, OverflowError) as err:
            log.warning("fragment %d: not folded (%s); its merge reads the pushes again", f, err)
            self._folds[f] = None
            return False
        return True

    def _spill(self, f: int, contribution: Contribution) -> None:
        payload = contribution.payload
        if self.spill_dir is not None and isinstance(payload, EncodedPayload):
            try:
                payload.spill(self.spill_dir)
            except OSError as err:  # a full disk: the push stays in memory, nothing is lost
                log.warning("fragment %d: a push kept in memory (%s)", f, err)

    @staticmethod
    def _fold_in_order(folded: _Folded, order: Sequence[str]) -> None:
        """Fold the waiting pushes of an ordered fold that are next in `order`, up to the first
        island that has not pushed (ValueError as MergeFold.add)."""
        done = {c.island for c, _, _ in folded.items}
        for island in order:
            if island in done:
                continue
            waiting = folded.deferred.pop(island, None)
            if waiting is None:
                return
            contribution, vectors, weight, scale = waiting
            folded.fold.add(vectors, weight, scale)
            folded.items.append((contribution, weight, scale))

    def take(
        self, f: int, contributions: Sequence[Contribution], plan: MergePlan
    ) -> MergeFold | None:
        """Fragment f's fold when it holds exactly `contributions` (by identity) with `plan`'s
        weights and scales; None otherwise. An ordered fold (a K = M round) must have folded a
        prefix of `contributions` in their order, and folds the rest now in that order, so its
        bits are the batch merge's of `contributions` (core/merge.py); an arrival-order fold
        may hold them in any order. The fold leaves either way: a round is merged from it
        once, or from the encoded payloads."""
        folded, self._folds[f] = self._folds[f], None
        if folded is None or len(folded.items) + len(folded.deferred) != len(contributions):
            return None
        planned = {
            id(c): (w, s) for c, w, s in zip(contributions, plan.weights, plan.scales, strict=True)
        }
        held = list(folded.items)
        held += [(c, w, s) for c, _, w, s in folded.deferred.values()]
        for c, w, s in held:
            if planned.get(id(c)) != (w, s):
                return None
        if not folded.ordered:
            return folded.fold
        n = len(folded.items)
        if [id(c) for c, _, _ in folded.items] != [id(c) for c in contributions[:n]]:
            return None  # folded out of this order (an island joined ahead of them): batch
        try:
            self._fold_in_order(folded, [c.island for c in contributions])
        except (ValueError, OverflowError) as err:
            log.warning("fragment %d: not folded (%s); its merge reads the pushes again", f, err)
            return None
        return folded.fold if not folded.deferred else None

    def drop(self, f: int) -> None:
        """Forget fragment f's fold (its round changed in a way a fold cannot follow)."""
        self._folds[f] = None

    def held_bytes(self) -> int:
        """Bytes of the accumulators held (for tests and the benchmark)."""
        return sum(
            t.numel() * t.element_size()
            for folded in self._folds
            if folded is not None
            for t in folded.fold.acc.values()
        )
