"""The global model: exact weights, published weights, fragments and the outer optimizer.

It holds the fp32 global weights (θ_exact, `weights`: what the outer optimizer steps), split
into fragments by bytes, and the copy learners hold (θ_pub, `published`; the same tensors when
sync.pullCompression is none). A merge (prepare_merge, then commit_merge) combines one
fragment's round of pseudo-gradients as core/contributions.py plans it, applies the outer step
(Delayed Nesterov folded per round of work, core/outer.py) to θ_exact and moves θ_pub towards it
by one encoded update (see core/published.py).

In a job of fewer than three islands each merge's pseudo-gradient per round of work is clipped
to syncer.guards.movementFactor x one honest AdamW round (intake/guards.movement_caps, issue 46):
its norm is read in slices once the merge is computed, and the clip is one more divisor of each
tensor, applied where the outer step reads each slice (no pass, no buffer of its own).

Synchronous and free of asyncio and HTTP: the service calls it while holding its lock, the heavy
methods (prepare_merge, digest, snapshots) from a worker thread.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from diloco_trainer.api.spec import ConfigError, JobSpec
from diloco_trainer.core.contributions import Contributor, MergePlan, plan_merge
from diloco_trainer.core.fold import SLICE as FOLD_SLICE
from diloco_trainer.core.fragments import split_fragments
from diloco_trainer.core.merge import merge_pseudo_gradients
from diloco_trainer.core.outer import BUFFER_PREFIX, FusedSlice, OuterOptimizer
from diloco_trainer.core.payloads import body_data, body_layout
from diloco_trainer.core.published import UpdateWriter, WeightUpdate, publish_update
from diloco_trainer.syncer.intake import EncodedPayload, clip_scale, movement_caps
from diloco_trainer.syncer.merging.folding import RoundFolds
from diloco_trainer.syncer.merging.heap import release_compiler_pages
from diloco_trainer.syncer.merging.merge_checks import MAX_MERGED_ABS, MergeInputError, check_merged
from diloco_trainer.syncer.state import Contribution
from diloco_trainer.syncer.storage import checkpoint as ckpt

log = logging.getLogger("diloco.syncer")

# Which merges of plain rounds run core/fused_update's compiled loop rather than the torch path
# (the same bits): "auto" (the default) when a fragment this process merges holds at least
# FUSED_MIN_VALUES values, "1" always, "0" never (a benchmark's baseline:
# DILOCO_FUSED_MERGE=0 python -m bench.syncer_scale ...). Only with int8 pulls.
FUSED_MERGE_ENV = "DILOCO_FUSED_MERGE"
# Below this a merge takes milliseconds either way, and the loop's compile (about 1.5 s of CPU
# at start-up, ~50 MB of memory) would not pay for itself.
FUSED_MIN_VALUES = 1 << 22


def use_fused_merge(pull_compression: str, largest_fragment: int, setting: str) -> bool:
    """Whether plain rounds merge in the fused loop (FUSED_MERGE_ENV's rule); ConfigError for
    a setting it does not know."""
    if setting not in ("", "auto", "0", "1"):
        raise ConfigError(f"{FUSED_MERGE_ENV}={setting!r}: use auto, 1 or 0")
    if pull_compression != "int8" or setting == "0":
        return False
    return setting == "1" or largest_fragment >= FUSED_MIN_VALUES


Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class MergeResult:
    """What one merge (commit_merge) did, for the merge log."""

    plan: MergePlan  # weights, scales, work, discounts and the work fraction φ
    rounds: int  # the fragment's completed rounds of work after the merge
    clock: float  # its rounds of work merged so far (rounds + the open round's fraction)
    update: WeightUpdate | None  # θ_pub's encoded update; None when θ_pub is θ_exact
    # The merged pseudo-gradient per round's norm (None: not read, no movement cap) and what
    # the movement clip multiplied it by (1: not clipped), for the merge log.
    movement: float | None = None
    clip: float = 1.0


@dataclass(frozen=True)
class PreparedMerge:
    """A merge computed but not applied (GlobalModel.prepare_merge)."""

    plan: MergePlan
    merged: Tensors  # the merged pseudo-gradient g, once divided by `divisors`
    # Tensors of `merged` still to be divided by these (fold.result_undivided, and the movement
    # clip): commit_merge divides each slice as the outer step reads it; emptied once done.
    divisors: dict[str, float] = field(default_factory=dict)
    # What the movement clip multiplied g by (1: not clipped; intake/guards.movement_caps).
    movement_scale: float = 1.0
    movement: float | None = None  # g's norm per round before the clip (None: not read)

    def divide(self, name: str, sl: slice) -> None:
        """Finish one slice of `merged[name]` (core/outer.OuterOptimizer.step's `before`)."""
        divisor = self.divisors.get(name)
        if divisor is not None:
            self.merged[name].view(-1)[sl].div_(divisor)

    def finish(self) -> Tensors:
        """`merged`, every tensor divided (once) as fold.result divides it."""
        for name, divisor in self.divisors.items():
            flat = self.merged[name].view(-1)
            for start in range(0, flat.numel(), FOLD_SLICE):
                flat[start : start + FOLD_SLICE].div_(divisor)
        self.divisors.clear()
        return self.merged


@dataclass(frozen=True)
class TensorSnapshot:
    """The global tensors a checkpoint writes (GlobalModel.live_tensors)."""

    weights: Tensors
    momentum: Tensors
    published: Tensors | None  # None when θ_pub is θ_exact


class GlobalModel:
    """θ_exact, θ_pub, their fragments and the outer optimizer of one job."""

    def __init__(
        self,
        spec: JobSpec,
        model: nn.Module,
        plain_merge_names: frozenset[str],
        owned: Sequence[int] | None = None,
    ) -> None:
        """`owned`: the fragments this process merges (one syncer shard's, shard_scope.py;
        None: every fragment). The others' tensors are released from `model` (it can no longer
        be evaluated) and held nowhere here: a shard holds only its own share of P."""
        self.rule = spec.sync.merge
        self.inner_steps = spec.inner.steps
        self.plain_merge_names = plain_merge_names
        model = model.float().cpu()  # in place: `model` keeps evaluating θ_exact
        model.requires_grad_(False)
        every = dict(model.named_parameters())
        self.fragments = split_fragments(
            {n: t.numel() * t.element_size() for n, t in every.items()}, spec.sync.fragments
        )
        # Names and shapes of every fragment (checks of pushes, limits, update histories);
        # tensors only of the owned ones.
        self.expected = [{n: every[n].shape for n in names} for names in self.fragments]
        self.full_bytes = [
            sum(every[n].numel() * every[n].element_size() for n in names)
            for names in self.fragments
        ]
        # Per fragment, the most a merge's g may be in a job of two (None: no clip).
        self.movement_caps = movement_caps(spec, self.numels())
        self.owned = list(range(len(self.fragments))) if owned is None else sorted(owned)
        mine = {n for f in self.owned for n in self.fragments[f]}
        self.weights: Tensors = {n: t for n, t in every.items() if n in mine}
        release_tensors([t for n, t in every.items() if n not in mine])
        del every
        # θ_pub: what learners hold. With pull codec none it is θ_exact itself (no copy).
        # Otherwise each fragment's θ_pub lives in the data part of its full pull body
        # (payloads.body_data: the publisher serves it as it is, no second copy), and a merge
        # writes the new θ_pub into a new buffer while the old one is still served.
        self.pull_compression = spec.sync.effective_pull_compression
        numels = self.numels()
        largest = max((numels[f] for f in self.owned), default=0)
        self.fused = use_fused_merge(
            self.pull_compression, largest, os.environ.get(FUSED_MERGE_ENV, "auto")
        )
        self._fused_update: ModuleType | None = None
        if self.fused:
            # numba's import (~0.25 s, its LLVM library) only in a syncer that uses the loop.
            from diloco_trainer.core import fused_update

            self._fused_update = fused_update
            # Compiled beside the start-up, not on the first merge's path (fused_update.py).
            threading.Thread(target=_compile_fused, name="fused-compile", daemon=True).start()
        self.published: Tensors = self.weights
        self.published_data: dict[int, torch.Tensor] = {}
        if self.pull_compression != "none":
            self.published = {}
            for f in self.owned:
                data, views = self._new_published(f)
                for name, view in views.items():
                    view.copy_(self.weights[name])
                self._install_published(f, data, views)
        self.outer = OuterOptimizer(
            self.weights,
            lr=spec.outer.lr,
            momentum=spec.outer.momentum,
            nesterov=spec.outer.nesterov,
        )
        # Each open round's pushes folded as they arrive (folding.py): one accumulator per
        # fragment instead of one decoded copy per push.
        self.folds = RoundFolds(
            len(self.fragments),
            rule=self.rule,
            inner_steps=self.inner_steps,
            plain_names=plain_merge_names,
        )
        if self.kept_apart:  # each round accumulates in its next pull body's memory
            self.folds.buffers = lambda f: self._new_published(f)[1]

    @property
    def kept_apart(self) -> bool:
        """Whether θ_pub is a separate copy (compressed pulls) rather than θ_exact itself."""
        return self.published is not self.weights

    def published_fragment(self, f: int) -> Tensors:
        """Fragment f of θ_pub, the tensors a full pull serves."""
        return {n: self.published[n] for n in self.fragments[f]}

    def _new_published(self, f: int) -> tuple[torch.Tensor, Tensors]:
        """A new body buffer for fragment f's θ_pub and its views by name (not yet θ_pub)."""
        return body_data({n: self.weights[n] for n in self.fragments[f]})

    def _body_of(self, f: int, merged: Tensors) -> tuple[torch.Tensor, Tensors] | None:
        """(buffer, merged) when the merged tensors are the views of one _new_published buffer
        of fragment f (the fold's accumulator, RoundFolds.buffers), else None."""
        names = self.fragments[f]
        if set(merged) != set(names) or not names:
            return None
        storage = merged[names[0]].untyped_storage()
        layout = body_layout({n: self.weights[n] for n in names}, {})
        if storage.nbytes() != layout.data_bytes:
            return None
        for n in names:
            t = merged[n]
            if (
                t.untyped_storage().data_ptr() != storage.data_ptr()
                or t.data_ptr() != storage.data_ptr() + layout.offsets[n][0]
                or t.dtype != self.weights[n].dtype
                or t.shape != self.weights[n].shape
                or not t.is_contiguous()
            ):
                return None
        return torch.empty(0, dtype=torch.uint8).set_(storage), dict(merged)

    def _install_published(self, f: int, data: torch.Tensor, views: Tensors) -> None:
        """Make a _new_published buffer fragment f's θ_pub."""
        self.published.update(views)
        self.published_data[f] = data

    # ----- the merge and outer step ------------------------------------------------------------

    def prepare_merge(
        self,
        f: int,
        contributions: Sequence[Contribution],
        *,
        lags: Sequence[float],
        islands: int,
        complete: bool = False,
    ) -> PreparedMerge:
        """The plan (each contribution's weight, scale to one round of work and staleness
        discount from its lag in rounds, `lags`; the work fraction φ among `islands` islands;
        `complete`: the contributions are every one of them, and close the round)
        and the weighted merge of the scaled pseudo-gradients, checked finite and bounded
        (merge_checks.check_merged). The round's fold is used when it holds exactly these
        contributions (folding.py), and leaves either way. Changes nothing else: a ValueError
        (MergeInputError) here leaves the model as it was."""
        plan = plan_merge(
            [
                Contributor(c.tokens, c.steps, lag, c.clip, c.credit_steps)
                for c, lag in zip(contributions, lags, strict=True)
            ],
            rule=self.rule,
            inner_steps=self.inner_steps,
            islands=islands,
            complete=complete,
        )
        fold = self.folds.take(f, contributions, plan)
        checked = False
        divisors: dict[str, float] = {}
        if fold is not None:
            # The division is left to the outer step's slices (commit_merge): no pass of its own.
            merged, divisors = fold.result_undivided()
            # result() found the largest |x| as it finished each slice: the check without a
            # pass of its own (merge_checks.check_merged's rule).
            if not (math.isfinite(fold.amax) and fold.amax <= MAX_MERGED_ABS):
                raise MergeInputError(
                    f"merged pseudo-gradient of fragment {f} has |{fold.amax_name}| max "
                    f"{fold.amax:.4g}"
                )
            checked = True
        else:  # the round changed in a way its fold could not follow: from the payloads
            merged = merge_pseudo_gradients(
                [c.payload for c in contributions],
                plan.weights,
                self.rule,
                self.plain_merge_names,
                scales=plan.scales,
            )
        if not (math.isfinite(plan.fraction) and plan.fraction >= 0):
            raise MergeInputError(f"work fraction {plan.fraction} of fragment {f}'s merge")
        if not checked:
            check_merged(f, merged)
        scale, norm = 1.0, None
        if self.movement_caps is not None:
            norm = merged_norm(merged, divisors)
            scale = clip_scale(norm, self.movement_caps[f])
            if scale < 1.0:
                for name in merged:  # a divisor of inf makes every (bounded) element 0
                    divisors[name] = divisors.get(name, 1.0) / scale if scale else math.inf
                log.info(
                    "merge of fragment %d: pseudo-gradient per round %.4g clipped to %.4g "
                    "(syncer.guards.movementFactor)",
                    f,
                    norm,
                    self.movement_caps[f],
                )
        return PreparedMerge(plan, merged, divisors, scale, norm)

    def fold_push(
        self,
        f: int,
        contribution: Contribution,
        payload: EncodedPayload,
        lag_rounds: float,
        order: Sequence[str] | None = None,
    ) -> None:
        """Fold an accepted push into fragment f's round (folding.RoundFolds.add, in
        `order` when given: a K = M round's fixed order of islands; a worker thread, f's lock
        held). The fragment's outer momentum is made here if it has none yet
        (its first round): 1/F x of fresh pages zeroed on the push path, where the round waits
        for its other pushes anyway, not on the merge's path to pullable (0.05-1.7 s at
        gpt-125m and gpt-350m, bench/log/2026-11-26.md, "syncer_scale — 2026-11-26 17:12"). The peak
        is the same: the momentum is in it from the first merge on either way. (θ_pub's update
        tensors are not made here: written fresh by the merge, their page faults cost it 0.04-0.06 s
        at gpt-125m, but made at the first push they would be held beside the fragment's newest
        update while its round is open, one update over the peak: bench/log/2026-11-26.md,
        "syncer_scale — 2026-11-26 23:08".)"""
        self.outer.reserve(self.fragments[f])
        self.folds.add(f, contribution, payload, lag_rounds, order)

    def commit_merge(self, f: int, prepared: PreparedMerge, *, new_version: int) -> MergeResult:
        """Apply a prepared merge: the outer step carrying φ, and θ_pub's update to
        `new_version`."""
        plan = prepared.plan
        names = self.fragments[f]
        update = None
        # θ_pub moves into a new body buffer: the old one (the body being served) stays as
        # it is until the publisher lets it go. The fold's accumulator is such a buffer: the
        # new θ_pub overwrites each slice of the merged pseudo-gradient once the outer step
        # has read it, so a merge adds no P/F buffer of its own.
        data, out = (None, None)
        if self.kept_apart:
            data, out = self._body_of(f, prepared.merged) or self._new_published(f)
        if out is not None and set(prepared.merged) == set(names):
            # One pass: θ_pub's update follows the outer step a slice at a time, reading each
            # slice of θ_exact while it is in cache (core/published.UpdateWriter).
            writer = UpdateWriter(
                self.weights,
                self.published,
                names,
                self.pull_compression,
                new_version,
                out,
            )
            self.outer.step(
                # In name order: θ_pub's checksum is then hashed as its slices are written.
                {n: prepared.merged[n] for n in sorted(prepared.merged)},
                plan.fraction,
                group=f,
                complete=plan.complete,
                momentum_share=plan.momentum,
                each=writer.slice,
                before=prepared.divide,
                fused=self._fused_slices(writer, prepared),
            )
            prepared.divisors.clear()
            update = writer.finish()
        else:
            self.outer.step(
                prepared.finish(),
                plan.fraction,
                group=f,
                complete=plan.complete,
                momentum_share=plan.momentum,
            )
            if out is not None:
                update = publish_update(
                    self.weights, self.published, names, self.pull_compression, new_version, out
                )
        if data is not None and out is not None:
            self._install_published(f, data, out)
        return MergeResult(
            plan,
            self.outer.rounds(f),
            self.outer.clock(f),
            update,
            movement=prepared.movement,
            clip=prepared.movement_scale,
        )

    def _fused_slices(self, writer: UpdateWriter, prepared: PreparedMerge) -> FusedSlice | None:
        """A plain round's slices in one pass each (core/fused_update.py), for int8 pulls."""
        kernels = self._fused_update
        if kernels is None:
            return None
        beta, lr = self.outer.momentum, self.outer.lr

        def fused(
            name: str, sl: slice, g: torch.Tensor, theta: torch.Tensor, m: torch.Tensor
        ) -> None:
            published, out, q, scales = writer.int8_targets(name, sl)
            divisor = prepared.divisors.get(name)
            kernels.nesterov_int8_slice(
                g, divisor, m, theta, published, out, q, scales, beta=beta, lr=lr
            )
            writer.written(name, sl)

        return fused

    def owns(self, f: int) -> bool:
        """Whether this process holds and merges fragment f (every fragment but on a shard)."""
        return f in self.owned

    def numels(self) -> list[int]:
        """The number of elements of each fragment (owned or not)."""
        return [sum(shape.numel() for shape in e.values()) for e in self.expected]

    def fragment_norms(self) -> list[float]:
        """The L2 norm of each fragment's weights (θ_exact); 0 for one another shard owns."""
        return [
            math.sqrt(sum(float(self.weights[n].norm()) ** 2 for n in names))
            if self.owns(f)
            else 0.0
            for f, names in enumerate(self.fragments)
        ]

    # ----- digests, snapshots and checkpoints --------------------------------------------------

    def digest(self) -> str:
        """sha256 of the global weights and the outer momentum (and θ_pub when kept apart)."""
        published = self.published if self.kept_apart else None
        return ckpt.state_digest(self.weights, self.outer.state_tensors(), published)

    def live_tensors(self) -> TensorSnapshot:
        """Everything a checkpoint holds of the model, by reference (no copy: the caller keeps
        them still while it writes them)."""
        return TensorSnapshot(
            weights=dict(self.weights),
            momentum=self.outer.state_tensors(),
            published=dict(self.published) if self.kept_apart else None,
        )

    def restore(self, loaded: ckpt.Checkpoint) -> None:
        """Load a checkpoint's tensors; ConfigError (nothing loaded) when they do not fit."""
        self._check_fits(loaded)
        # Only this process's own tensors (a shard's checkpoint from before shards held only
        # theirs has every tensor); the checkpoint's are let go as they are copied (and its
        # momentum taken as it is), so a resume holds little more than the running syncer.
        for part in (loaded.weights, loaded.published or {}):
            for name in [n for n in part if n not in self.weights]:
                del part[name]
        for key in [
            k for k in loaded.momentum if k.removeprefix(BUFFER_PREFIX) not in self.weights
        ]:
            del loaded.momentum[key]
        with torch.no_grad():
            if self.kept_apart:
                # θ_pub as learners hold it; a checkpoint without it (pull codec none, or an
                # older syncer) gives θ_exact, and learners then get full weights once.
                source = loaded.published
                if source is None or not _same_shapes(source, self.weights):
                    if source is not None:
                        log.warning("checkpoint %s: published weights do not match", loaded.path)
                    source = loaded.weights
                for name, t in source.items():
                    self.published[name].copy_(t)
                if loaded.published is not None:
                    loaded.published.clear()
            for name in list(loaded.weights):
                self.weights[name].copy_(loaded.weights.pop(name))
        self.outer.load_state_tensors(loaded.momentum, take=True)
        progress = loaded.document.outer_progress
        if progress is None:  # written before rounds of work were counted: a merge was a round
            for f, version in enumerate(loaded.document.versions):
                self.outer.set_rounds(f, int(version))
        else:
            self.outer.load_progress(progress)

    def _check_fits(self, loaded: ckpt.Checkpoint) -> None:
        if loaded.document.fragments != self.fragments:
            raise ConfigError(
                f"checkpoint {loaded.path} splits the model into different fragments than "
                f"sync.fragments={len(self.fragments)} does now; use a fresh state dir"
            )
        every = {n for names in self.fragments for n in names}
        # It must hold every tensor this process owns, and nothing the model does not have.
        missing = (set(self.weights) - set(loaded.weights)) | (set(loaded.weights) - every)
        if missing:
            raise ConfigError(
                f"checkpoint {loaded.path} holds other tensors than the model "
                f"(differences: {sorted(missing)[:5]}); was model.preset changed?"
            )
        for name, t in loaded.weights.items():
            if name in self.weights and t.shape != self.weights[name].shape:
                raise ConfigError(
                    f"checkpoint {loaded.path}: {name} has shape {tuple(t.shape)}, the model "
                    f"{tuple(self.weights[name].shape)}"
                )


def merged_norm(merged: Mapping[str, torch.Tensor], divisors: Mapping[str, float]) -> float:
    """The L2 norm of the merged pseudo-gradient g, each tensor of `merged` divided by its
    divisor (1 when it has none), read a fold slice at a time: in fp32 (no copy; a quarter of
    fp64's time), and a slice again in fp64 when its fp32 sum of squares overflowed (elements
    up to merge_checks.MAX_MERGED_ABS)."""
    total = 0.0
    for name, t in merged.items():
        flat = t.reshape(-1)
        squares = 0.0
        for start in range(0, flat.numel(), FOLD_SLICE):
            piece = flat[start : start + FOLD_SLICE]
            norm = float(torch.linalg.vector_norm(piece))
            if not math.isfinite(norm):
                norm = float(torch.linalg.vector_norm(piece, dtype=torch.float64))
            squares += norm**2
        total += squares / divisors.get(name, 1.0) ** 2
    return math.sqrt(total)


def release_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Free the memory of tensors (parameters of a module that must keep its structure): each
    keeps its dtype with no elements, so anything that still reads one fails loudly."""
    with torch.no_grad():
        for t in tensors:
            t.data = torch.empty(0, dtype=t.dtype)


def _same_shapes(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].shape == b[n].shape for n in a)


def _compile_fused() -> None:
    """Compile the fused loop beside the start-up, then give back the compiler's pages."""
    from diloco_trainer.core import fused_update

    fused_update.warm()
    release_compiler_pages()
