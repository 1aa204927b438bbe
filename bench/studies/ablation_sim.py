"""The job's sync rules at K = M, in one process, on exactly equal tokens (bench.studies.ablation).

M islands (each its own model, AdamW and data shard, as bench.studies.outer_sweep) step in lockstep;
everything between them is the product's own code, called as the syncer and the learners call
it, so a knob can be switched on alone:

- push codec: Δ = base − local encoded and decoded with core/compress (encode_tensors,
  decode_tensors), and error feedback (compress.ErrorFeedback) when asked;
- pull codec: the syncer's θ_pub, moved towards θ_exact by core/published.publish_update after
  every merge; islands install θ_pub (what they pull), never θ_exact;
- fragments: core/fragments.split_fragments and fragment_offsets, each fragment pushed when
  learner/step_plan.plan_step says (at its own offset, none in the job's first round) and stepped
  as its own group of the outer optimizer;
- overlap τ: the merged fragment is installed τ steps after the push with
  learner/mixing.received_weights (the τ steps kept), and the counters of the next push cover
  the steps since the push, as learner/fragment_state does;
- merge rule and work fractions: core/contributions.plan_merge and
  core/merge.merge_pseudo_gradients, then core/outer.OuterOptimizer.step.

Every island pushes every fragment at the same step and every merge holds all M of them (K = M on
identical islands, the merge is not held for a grace window), so nothing here depends on timing
and two runs of the same seed give the same bits. Every variant trains exactly `steps` inner
steps per island (equal tokens exactly) and is evaluated on θ_exact after the last step: work of
a fragment after its last sync point is not in the model, as with the product at that budget.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.compress import ErrorFeedback, decode_tensors, encode_tensors
from diloco_trainer.core.contributions import Contributor, plan_merge
from diloco_trainer.core.fragments import fragment_offsets, fragments_due, split_fragments
from diloco_trainer.core.grace import merge_wait_steps
from diloco_trainer.core.merge import merge_pseudo_gradients
from diloco_trainer.core.outer import OuterOptimizer
from diloco_trainer.core.published import publish_update
from diloco_trainer.learner.mixing import pseudo_gradient, received_weights
from diloco_trainer.learner.step_plan import plan_step
from diloco_trainer.models.parts import (
    build_parts,
    evaluate,
    inner_lr,
    make_inner_optimizer,
    set_lr,
)
from torch import Tensor


@dataclass(frozen=True)
class Knobs:
    """The sync settings one variant trains with (the blocking configuration by default)."""

    push: str = "none"  # sync.compression
    pull: str = "none"  # sync.pullCompression
    fragments: int = 1
    overlap: int = 0  # sync.overlapSteps τ
    merge: str = "mean"
    error_feedback: bool = False
    keep: bool = True  # keep the τ steps since the push (learner/mixing); False: overwrite
    eager: bool = False  # overlap from eager_start (below) instead of the weights at the push
    flush: bool = False  # after the last step, push and merge every fragment with unmerged work
    # Why do 2 fragments cost (issue 23)? Each of these changes one thing about them:
    split: str = "size"  # "size": core/fragments.split_fragments; "layers": contiguous_fragments
    aligned: bool = False  # every fragment synced at the end of the round (no stagger)
    # True: the rule before issue 23, fragment f pushed at every sync point from step f·H/F on
    # (plan_step now skips those before step H).
    first_round_push: bool = False
    # A merge that is back `late` steps after its push (0: on time), and sync.mergeWait's rule
    # for it. "overlap": the islands block at τ until it is there, so it is installed after
    # τ steps whatever `late` is (the wait costs wall time, not steps). "nextPush": they train on
    # and install it at the first step it is there, at the latest H - 1 steps after the push.
    late: int = 0
    merge_wait: str = "overlap"


@dataclass
class Pending:
    """A fragment an island pushed and has not installed yet."""

    due: int  # the step after which it is installed (push step + τ, or later: Knobs.late)
    at_push: dict[str, Tensor]
    pushed: int = 0  # the step it was pushed after


@dataclass
class Island:
    parts: Any
    optimizer: torch.optim.Optimizer
    params: dict[str, Tensor]
    bases: list[dict[str, Tensor]]  # per fragment: θ_pub it last installed (fp32)
    previous: list[dict[str, Tensor] | None]  # per fragment: the base before (one version back)
    steps: list[int]  # per fragment: steps its next Δ covers
    pending: list[Pending | None]
    feedback: ErrorFeedback | None


def eager_start(base: dict[str, Tensor], previous: dict[str, Tensor]) -> dict[str, Tensor]:
    """An eager update, tried and not adopted (bench/log/2026-11-26.md, "ablation (issue 23): which
    sync default costs quality"): right after a push the island jumps to θ_base + (θ_base −
    θ_previous), the global weights moved once more by the last update it saw (a guess of the merge
    its push goes into), and takes its τ overlapped steps from there instead of from its own
    weights; they are kept on top of the real merge."""
    return {n: 2.0 * base[n] - previous[n] for n in base}


def contiguous_fragments(sizes: dict[str, int], num_fragments: int) -> list[list[str]]:
    """Fragments of consecutive tensors in model order (whole layers together, as Streaming
    DiLoCo's), cut where the bytes so far pass f/F of the total: the alternative to the
    product's size-balanced split, which spreads a layer's weight and bias over fragments."""
    total = sum(sizes.values())
    out: list[list[str]] = [[] for _ in range(num_fragments)]
    filled = 0
    for name, size in sizes.items():
        f = min(num_fragments - 1, int(num_fragments * (filled + size / 2) / max(total, 1)))
        out[f].append(name)
        filled += size
    return [f for f in out if f]


def install_after(knobs: Knobs, inner_steps: int) -> int:
    """Steps from a push to its install: τ when the merge is on time or the islands block at τ
    (sync.mergeWait overlap); under nextPush a late merge is installed at the first step it is
    there, H - 1 steps after the push at the latest (core/grace.merge_wait_steps)."""
    deadline = merge_wait_steps(
        merge_wait=knobs.merge_wait, overlap=knobs.overlap, inner_steps=inner_steps
    )
    return min(max(knobs.overlap, knobs.late), deadline)


def _copy(tensors: dict[str, Tensor], names: list[str]) -> dict[str, Tensor]:
    return {n: tensors[n].detach().to(torch.float32).clone() for n in names}


def _inner_step(spec: JobSpec, island: Island, step: int) -> None:
    """One AdamW step of one island on its next batch (as outer_sweep and the learner do)."""
    p = island.parts
    assert p.train is not None
    set_lr(island.optimizer, inner_lr(spec, step))
    island.optimizer.zero_grad(set_to_none=True)
    p.loss_fn(p.model, p.train.next_batch()).backward()
    if spec.inner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(p.model.parameters(), spec.inner.grad_clip)
    island.optimizer.step()


class Simulation:
    """One variant's run: `run(steps)` returns the global model's eval loss after it."""

    def __init__(self, spec: JobSpec, knobs: Knobs, islands: int) -> None:
        self.spec, self.knobs, self.m = spec, knobs, islands
        self.h = spec.inner.steps
        parts = [build_parts(spec, shard_index=i, num_shards=islands) for i in range(islands)]
        self.global_model = copy.deepcopy(parts[0].model).float()
        self.global_model.requires_grad_(False)
        self.exact: dict[str, Tensor] = dict(self.global_model.named_parameters())
        names = list(self.exact)
        self.published = self.exact if knobs.pull == "none" else _copy(self.exact, names)
        sizes = {n: t.numel() * t.element_size() for n, t in self.exact.items()}
        split = contiguous_fragments if knobs.split == "layers" else split_fragments
        self.fragments = split(sizes, knobs.fragments)
        self.offsets = (
            [0] * knobs.fragments if knobs.aligned else fragment_offsets(self.h, knobs.fragments)
        )
        self.outer = OuterOptimizer(
            self.exact,
            lr=spec.outer.lr,
            momentum=spec.outer.momentum,
            nesterov=spec.outer.nesterov,
        )
        self.versions = [0] * knobs.fragments
        self.islands = [
            Island(
                parts=p,
                optimizer=make_inner_optimizer(spec, p.model),
                params=dict(p.model.named_parameters()),
                bases=[_copy(self.published, f) for f in self.fragments],
                previous=[None] * knobs.fragments,
                steps=[0] * knobs.fragments,
                pending=[None] * knobs.fragments,
                feedback=ErrorFeedback() if knobs.error_feedback else None,
            )
            for p in parts
        ]
        self.tokens_per_step = spec.inner.batch_size * spec.inner.seq_len
        self.install_after = install_after(knobs, self.h)

    def _push(self, island: Island, f: int) -> dict[str, Tensor]:
        """Δ_f as the syncer decodes it; remembers the weights at the push."""
        local = _copy(island.params, self.fragments[f])
        delta = pseudo_gradient(island.bases[f], local)
        previous = island.previous[f]
        if self.knobs.eager and self.knobs.overlap and previous is not None:
            local = eager_start(island.bases[f], previous)  # the τ steps start from there
            with torch.no_grad():
                for n, t in local.items():
                    island.params[n].copy_(t)
        island.pending[f] = Pending(due=-1, at_push=local)
        if self.knobs.push == "none":
            return delta
        shapes = {n: t.shape for n, t in delta.items()}
        ef = island.feedback
        sent = {n: ef.compensate(n, t) for n, t in delta.items()} if ef else delta
        decoded = decode_tensors(encode_tensors(sent, self.knobs.push), self.knobs.push, shapes)
        if ef is not None:
            for n in sent:
                ef.record(n, sent[n], decoded[n])
        return decoded

    def _merge(self, f: int, deltas: list[dict[str, Tensor]], steps: list[int]) -> None:
        """The syncer's merge of every island's push of fragment f, then θ_pub's update."""
        plan = plan_merge(
            [Contributor(tokens=s * self.tokens_per_step, steps=s) for s in steps],
            rule=self.knobs.merge,
            inner_steps=self.h,
            islands=self.m,
            complete=True,
        )
        g = merge_pseudo_gradients(deltas, plan.weights, self.knobs.merge, scales=plan.scales)
        self.outer.step(g, plan.fraction, group=f, complete=plan.complete)
        self.versions[f] += 1
        if self.knobs.pull != "none":
            publish_update(
                self.exact, self.published, self.fragments[f], self.knobs.pull, self.versions[f]
            )

    def _install(self, island: Island, f: int) -> None:
        """Install θ_pub_f, keeping the steps since the push; the counters keep those steps."""
        pending = island.pending[f]
        assert pending is not None
        names = self.fragments[f]
        merged = _copy(self.published, names)
        now = _copy(island.params, names)
        target = received_weights(merged, now, pending.at_push if self.knobs.keep else None)
        with torch.no_grad():
            for n in names:
                island.params[n].copy_(target[n])
        island.previous[f] = island.bases[f]
        island.bases[f] = merged
        # The steps since the push are in the next Δ when kept; overwritten, they are lost.
        island.steps[f] = pending.due - pending.pushed if self.knobs.keep else 0
        island.pending[f] = None

    def _sync(self, f: int, step: int) -> None:
        """Every island pushes fragment f after `step`; the merge; installs due τ steps later."""
        counted = [isl.steps[f] for isl in self.islands]
        deltas = [self._push(isl, f) for isl in self.islands]
        self._merge(f, deltas, counted)
        for isl in self.islands:
            pend = isl.pending[f]
            assert pend is not None
            pend.due, pend.pushed = step + self.install_after, step

    def _due(self, step: int) -> tuple[int, ...]:
        """Fragments every island pushes after `step` (lockstep: island 0's plan is everyone's)."""
        pushed_at = {f: p.pushed for f, p in enumerate(self.islands[0].pending) if p is not None}
        if self.knobs.first_round_push:
            due = fragments_due(step, self.h, self.offsets)
            return tuple(f for f in due if f not in pushed_at)
        plan = plan_step(
            step,
            inner_steps=self.h,
            offsets=self.offsets,
            overlap=self.knobs.overlap,
            pushed_at=pushed_at,
        )
        return plan.push

    def run(self, steps: int) -> float:
        for step in range(1, steps + 1):
            for island in self.islands:
                _inner_step(self.spec, island, step - 1)
                island.steps = [s + 1 for s in island.steps]
            for f in self._due(step):
                self._sync(f, step)
            for island in self.islands:
                for f, pend in enumerate(island.pending):
                    if pend is not None and pend.due <= step:
                        self._install(island, f)
        if self.knobs.flush:  # the work of a fragment past its last sync point, merged too
            for f in range(self.knobs.fragments):
                if self.islands[0].pending[f] is None and self.islands[0].steps[f] > 0:
                    self._sync(f, steps)
        return evaluate(self.islands[0].parts, self.global_model)
