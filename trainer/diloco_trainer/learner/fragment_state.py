"""Rank 0's bookkeeping for each fragment: its Δ base and version, the work counted since it
was last received, the weights and counters at its last push, and the push whose merged result is
not applied yet.

Step cap: a push carries every step since the base (when the push before it was lost, all of
them), and the syncer refuses a push of more than core/push_bounds.max_push_steps (4 x H + τ) as
steps_out_of_range, a refusal that counts towards dropping the island. So a fragment whose
counters reach that bound holds the island's steps (at_step_cap) until a merge or a pull of it
arrives: an island cut off from its syncer waits instead of making work that would be refused.

Counters: the token-weighted merge weighs a push by the work it carries, so the counters sent
with a push must describe exactly the inner steps its Δ contains. Δ = base − θ_local covers every
step since the base was installed; because a received fragment keeps the steps taken after the
push (mixing.received_weights), those steps are in the next Δ, and on receipt the counters become
the ones counted since the push (FragmentCounters.since), never zero and never the whole period.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from diloco_trainer.core.compress import ErrorFeedback
from diloco_trainer.learner.device_copies import snapshot
from diloco_trainer.learner.mixing import (
    added_into,
    eager_proxy,
    merge_offset_into,
    pseudo_gradient,
    received_weights,
    received_weights_into,
)
from diloco_trainer.learner.push_encoding import (
    encode_delta,
    encode_for_wire,
    encode_int8_from_snapshot,
    one_pass,
    snapshot_and_encode_int8,
    snapshot_for_push,
)
from diloco_trainer.learner.syncer_link import BaseWriter, HeldFragment, SyncResult

# The learner's logger: these lines are part of its log.
log = logging.getLogger("diloco.learner")


@dataclass
class FragmentCounters:
    """An island's work on one fragment: what its next Δ carries."""

    tokens: int = 0
    steps: int = 0
    loss_sum: float = 0.0
    time_sum: float = 0.0

    def add(self, tokens: int, loss: float, step_time: float) -> None:
        self.tokens += tokens
        self.steps += 1
        self.loss_sum += loss
        self.time_sum += step_time

    def since(self, earlier: FragmentCounters) -> FragmentCounters:
        """The work counted after `earlier` (a snapshot of these counters)."""
        return FragmentCounters(
            tokens=self.tokens - earlier.tokens,
            steps=self.steps - earlier.steps,
            loss_sum=self.loss_sum - earlier.loss_sum,
            time_sum=self.time_sum - earlier.time_sum,
        )

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else 0.0

    @property
    def mean_step_time(self) -> float:
        return self.time_sum / self.steps if self.steps else 0.0


# Versions of each fragment whose merged steps an island keeps (MergedSteps): a syncer restart
# that goes back further is counted at a round of steps per merge.
KEPT_VERSIONS = 64


class MergedSteps:
    """One fragment's count of this island's inner steps merged into it, at each version it
    received, for what a syncer restart takes back (`rolled_back`).

    Why: at K = M an island drains at its share of stopAfter counted in its own steps; a
    syncer that resumed from an older checkpoint lost the merges since, and an island that
    drained at its share then waited a whole wait budget for a finish that could not come
    (the work was short), then trained on (tests/e2e/test_learner_restart.py: 20 s each time).
    The steps the restart took back are added to the share instead (FragmentSync.lost_work,
    loop.py)."""

    def __init__(self, version: int) -> None:
        self.total = 0  # steps merged up to the newest version received
        self.at: dict[int, int] = {version: 0}

    def merged(self, version: int, steps: int) -> None:
        """A merge of this island's push of `steps` steps received as `version`."""
        self.total += steps
        self.at[version] = self.total
        for old in sorted(self.at)[:-KEPT_VERSIONS]:
            del self.at[old]

    def rolled_back(self, version: int, *, held: int, round_steps: int) -> int:
        """Steps lost when the syncer went back from the version held (`held`) to `version`:
        those merged after it. Versions no longer kept (or from before this process joined)
        count a round of steps (`round_steps`) per merge taken back."""
        if version >= held:
            return 0
        oldest = min((v for v in self.at if v >= version), default=held)
        known = self.total - self.at.get(oldest, self.total)
        lost = known + (oldest - version) * round_steps
        self.total = max(0, self.total - lost)
        self.at = {v: n for v, n in self.at.items() if v < version}
        self.at[version] = self.total
        return lost


@dataclass
class InFlight:
    """A pushed fragment whose merged result is not applied yet."""

    step: int  # schedule position it was pushed at
    started: float  # time.monotonic() of the push
    future: concurrent.futures.Future[SyncResult]
    # (first poll, wait deadline) in steps after the push: those of the τ it was made with.
    window: tuple[int, int]
    previous: float | None = None  # time.monotonic() of the fragment's push before this one
    # Pushed again after a syncer restart (FragmentSync.resend_lost, _push_again, _make_up):
    # out of schedule, so its merge is waited for at the fragment's next sync point rather
    # than skipping that push (FragmentSync._plan).
    again: bool = False
    # Inner steps trained since the push (every step: fill and phase-delay steps too), and
    # whether the learner held this push's whole wait budget for its merge already: what
    # step_plan.holds_for_late_merge reads at K < M.
    trained: int = 0
    hold_given_up: bool = False


@dataclass
class FragmentState:
    """Rank 0's view of one fragment."""

    names: list[str]
    version: int = -1
    base: dict[str, Tensor] = field(default_factory=dict)  # fp32 CPU θ_global at `version`
    # The same weights on the learner's device when that is a GPU, made at the first push after
    # a receipt: Δ = base − local is then computed there (no host copy of the weights per push).
    # The CPU `base` stays: compressed pulls are applied to it on the link's thread.
    base_on_device: dict[str, Tensor] = field(default_factory=dict)
    counters: FragmentCounters = field(default_factory=FragmentCounters)
    # Of the steps in `counters`, those trained before `base` was installed (the steps since
    # the push that the receipt kept on top of it): the next push's keptSteps, which the syncer
    # records (docs/algorithm.md, "A push's kept steps are recorded").
    kept_steps: int = 0
    last_sync_seconds: float = 0.0
    # fp32 CPU weights and counters when the unapplied push was made (None: nothing pushed).
    at_push: dict[str, Tensor] | None = None
    counters_at_push: FragmentCounters | None = None
    # sync.lateMergeRule eager: keep the last update received, u = θ_base_before − θ_base (fp32,
    # on the host: 4P/F more per fragment), for the proxy of the coming outer step (eager_jump).
    track_update: bool = False
    last_update: dict[str, Tensor] | None = None
    # A host learner's large int8 push (push_encoding.one_pass) encoded on the syncer link's
    # thread, only its copy on the training thread (issue 45: at gpt-125m on an emulated
    # accelerator the encoding was 0.8-1.0 s of a 3.3 s round's training thread, per fragment).
    defer_host_encoding: bool = True
    # The at_push whose values the link's thread has turned into θ_global − θ_push
    # (receipt_preparer; None: at_push holds θ_push), and the lock that orders the two threads.
    prepared: dict[str, Tensor] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # A host learner's last at_push once its receipt has added it in (added_into), kept for the
    # next push's copy (push_encoding.snapshot_for_push's `into`): a fresh 1/F-copy buffer each
    # push cost the training thread its pages' faults and the kernel's zeroing of them, ~4x
    # the copy's own CPU (issue 45, emu11). Held only where at_push would be: between a
    # receipt and the next push, in at_push's place.
    spare: dict[str, Tensor] | None = None
    # A compressed pull is added into `base` in place by the syncer link (base_writer), once
    # its checksum is verified. The push whose sync may do so (its token; None: none may), and
    # the version such a write left `base` at before the receipt installs it (None: `base` holds
    # `version`; BASE_SPOILED: the write failed half way, and only a full pull replaces it).
    write_token: object | None = None
    rewritten_to: int | None = None

    def eager_jump(
        self, *, lr: float, momentum: float, nesterov: bool, inner_steps: int
    ) -> dict[str, Tensor]:
        """sync.lateMergeRule eager, right after begin_push/encode_push: the weights to continue
        from, θ_proxy = mixing.eager_proxy(θ_base, θ_push, u), which also replace the weights
        at the push, so the receipt keeps θ_now − θ_proxy. `inner_steps`: H (the push's work is
        its steps / H rounds)."""
        assert self.at_push is not None and self.counters_at_push is not None, "push first"
        steps = self.counters_at_push.steps
        proxy = eager_proxy(
            self._base_beside(self.at_push),
            self.at_push,
            self.last_update,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            work=max(steps, 1) / inner_steps,
        )
        self.at_push = proxy
        return {n: t.clone() for n, t in proxy.items()}

    def begin_push(self, local: dict[str, Tensor]) -> dict[str, Tensor]:
        """Δ = base − local for a push now; remembers `local` (fp32, on the weights' device,
        owned here: the receipt writes the new weights over it) and the counters, for the
        receipt of the merge this push goes into."""
        self._remember(local)
        return pseudo_gradient(self._base_beside(local), local)

    def encode_push(
        self, weights: dict[str, Tensor], codec: str, feedback: ErrorFeedback | None
    ) -> tuple[dict[str, Tensor], Callable[[], None]]:
        """begin_push on copies of `weights` (the fragment's parameters, only read) and Δ
        encoded for the wire (push_encoding.encode_for_wire: the host tensors and the wait for
        their copies). A host learner's int8 push of a large fragment is made in one sliced
        pass instead (push_encoding.one_pass, snapshot_and_encode_int8: the same bytes). With
        defer_host_encoding (the default), a host learner's int8 push takes only the copy of
        the weights on the training thread; its Δ and encoding run in the returned wait, which
        the syncer link calls on its own thread before sending."""
        large = one_pass(weights, codec)
        if large and not self.defer_host_encoding:
            local, encoded = snapshot_and_encode_int8(weights, self.base, feedback)
            self._remember(local)
            return encoded, _nothing
        if self.defer_host_encoding and (large or _host_int8(weights, codec)):
            # Deferred: only the copy on the training thread; Δ and int8 on the syncer link's
            # thread (its `ready`, called before the push is sent), beside the next steps: the
            # sliced pass for a large fragment, the flat buffer for a small one, the same bytes
            # as on the training thread (issue 45: at gpt-tiny's few-ms steps a small push's
            # Δ and encoding were a fixed cost of the training thread). The base is this one
            # even if a receipt replaces self.base meanwhile (it cannot: the merge this push
            # answers comes after the push is sent).
            spare = self._take_spare()  # given up by a small push: snapshot makes its own
            local = snapshot_for_push(weights, into=spare) if large else snapshot(weights)
            self._remember(local)
            base = self.base
            deferred: dict[str, Tensor] = {}

            def encode() -> None:
                if large:
                    deferred.update(encode_int8_from_snapshot(local, base, feedback))
                else:
                    deferred.update(encode_delta(pseudo_gradient(base, local), codec, feedback))

            return deferred, encode
        return encode_for_wire(self.begin_push(snapshot(weights)), codec, feedback)

    def _take_spare(self) -> dict[str, Tensor] | None:
        """The buffer kept from the last receipt (spare), given up to this push."""
        spare, self.spare = self.spare, None
        return spare

    def _remember(self, local: dict[str, Tensor]) -> None:
        self.at_push = local
        self.counters_at_push = replace(self.counters)

    def _base_beside(self, local: dict[str, Tensor]) -> dict[str, Tensor]:
        """The base on the device of `local` (the CPU base itself when that is the CPU)."""
        device = _device_of(local)
        if device.type == "cpu":
            return self.base
        if not self.base_on_device:
            self.base_on_device = {n: t.to(device) for n, t in self.base.items()}
        return self.base_on_device

    def receive(
        self,
        merged: dict[str, Tensor],
        version: int,
        now: dict[str, Tensor],
        alpha: float,
        here: dict[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Install a merged fragment (fp32, on the host) as the new base; returns the weights
        the island continues from (the steps since the push kept), and keeps only the counters
        since the push. `here`: the same weights already on `now`'s device (staged by the
        syncer link), else they are copied there now."""
        device = _device_of(now)
        # On a GPU: the merged weights cross to it once and serve as its base there too.
        if here is None:
            here = {n: t.to(device, torch.float32) for n, t in merged.items()}
        with self.lock:
            offset = self.prepared if self.prepared is self.at_push else None
            self.prepared = None
        if offset is not None and not alpha:
            # θ_global − θ_push made on the link's thread (receipt_preparer): one pass here.
            target = added_into(now, offset)
            self.spare = offset  # read by nothing now: the next push's copy goes into it
        elif device.type == "cpu" and self.at_push is not None:
            # Written over the push's copies, which nothing reads after this (begin_push): no
            # fragment-sized temporaries on a host learner's training thread.
            target = received_weights_into(here, now, self.at_push, alpha)
        else:
            target = received_weights(here, now, self.at_push, alpha)
        new_base = {n: t.to("cpu") for n, t in merged.items()}
        if self.track_update and self.base:
            self.last_update = {n: self.base[n] - new_base[n] for n in new_base}
        self.base = new_base  # the base itself when the link added the updates into it
        self._base_replaced()
        self.base_on_device = here if device.type != "cpu" else {}
        self.version = version
        pushed = self.counters_at_push
        self.counters = self.counters.since(pushed) if pushed is not None else FragmentCounters()
        self.kept_steps = self.counters.steps  # trained from the weights before this base
        self.at_push = None
        self.counters_at_push = None
        return target

    def base_writer(self) -> BaseWriter | None:
        """For a push now (the training thread): what its sync on the syncer link calls to add
        the merge's pulled updates into `base` in place (the merged fragment, not a second copy
        beside the base: ARCHITECTURE.md, "A learner's memory"), as `write(version, add)`:
        `add()` runs under `lock` unless the write was revoked (base_rewritten: a push of this
        fragment again reads the base), and whether it ran. None where the base must stay as it
        is: eager keeps the old base for its last update (receive), and a sharded island holds
        none. Nothing else reads the base meanwhile: the next push of the fragment comes after
        this one's receipt, and one before it (overdue) revokes the write first."""
        if self.track_update or not self.base:
            return None
        token = object()
        with self.lock:
            self.write_token = token

        def write(version: int, add: Callable[[], None]) -> bool:
            with self.lock:
                if self.write_token is not token:
                    return False
                self.write_token = None
                self.rewritten_to = BASE_SPOILED  # until the last tensor is written
                try:
                    add()
                except Exception as err:
                    # Not a ValueError (the link's refusal of a chain, which pulls the full
                    # fragment and may retry the chain on the spoiled base): the sync fails,
                    # and the learner resyncs from a full pull (FragmentSync.collect).
                    raise BaseSpoiled(f"the base was left half written: {err}") from err
                self.rewritten_to = version
            return True

        return write

    def held(self) -> HeldFragment:
        """The base as the syncer link holds it for a push now: what a pulled chain of updates
        is added into (in place, through base_writer), with its version and GPU mirror."""
        return HeldFragment(
            self.version, self.base, self.base_on_device or None, self.base_writer()
        )

    def merge_written(self, in_flight: bool, f: int, position: int) -> bool:
        """Before a push of this fragment (f): whether its sync in flight (overdue) added its
        merge into the base already, when the push must not be made (it would read a base that
        no longer holds `version`): the merge is received at the next collect instead. Else
        that sync may no longer write the base (base_rewritten)."""
        if not in_flight or not self.base_rewritten():
            return False
        log.warning(
            "step %d: fragment %d's overdue merge is arriving; not pushing it again", position, f
        )
        return True

    def base_rewritten(self) -> bool:
        """Before a push of this fragment while its last one is in flight (overdue): revoke that
        sync's write of `base` (waiting for one under way to end); whether it wrote the base
        already. Then the push must not be made: `base` no longer holds `version` (it holds the
        merge about to be received, or half of one: only a full pull replaces that)."""
        with self.lock:
            self.write_token = None
            return self.rewritten_to is not None

    def _base_replaced(self) -> None:
        """A receipt or a join replaced `base`: no earlier sync may write it, none has."""
        with self.lock:
            self.write_token = None
            self.rewritten_to = None

    def receipt_preparer(self) -> Callable[[Mapping[str, Tensor]], None] | None:
        """For the push just made (at_push), on a host learner: what the syncer link's thread
        runs on the pulled fragment, turning at_push into θ_global − θ_push
        (mixing.merge_offset_into) so that the receipt is one pass of the training thread
        (added_into). It does nothing once at_push is another push's, or when the pulled
        tensors are not this fragment's shapes (the receipt refuses them). None: not deferred
        (a GPU's receipt is its device's). A small host fragment's is deferred too (issue 45:
        gpt-tiny's receipt was a fixed cost of its few-ms steps)."""
        at = self.at_push
        if at is None or not self.defer_host_encoding or _device_of(at).type != "cpu":
            return None
        if self.track_update:
            return None  # eager: the jump right after the push replaces at_push with its proxy

        def prepare(merged: Mapping[str, Tensor]) -> None:
            with self.lock:
                if self.at_push is not at or self.prepared is at:
                    return
                if any(
                    n not in merged or tuple(merged[n].shape) != tuple(t.shape)
                    for n, t in at.items()
                ):
                    return
                merge_offset_into({n: merged[n] for n in at}, at)
                self.prepared = at

        return prepare

    def take_global(self, merged: dict[str, Tensor], version: int) -> dict[str, Tensor]:
        """Start over from the global fragment (joining): overwrite, counters from zero."""
        self.at_push = None
        self.counters_at_push = None
        self.counters = FragmentCounters()
        self.kept_steps = 0
        self.last_update = None
        self.base = {n: t.to("cpu") for n, t in merged.items()}
        self._base_replaced()
        self.base_on_device = {}
        self.version = version
        return dict(self.base)


# FragmentState.rewritten_to of a base whose in-place write failed half way.
BASE_SPOILED = -2


class BaseSpoiled(RuntimeError):
    """An in-place write of a pulled chain into the base failed half way (base_writer)."""


def _nothing() -> None:
    """The wait of a push whose bytes are on the host already."""


def _host_int8(weights: Mapping[str, Tensor], codec: str) -> bool:
    """Whether `weights` are a host fragment pushed int8 (the default codec)."""
    return codec == "int8" and _device_of(dict(weights)).type == "cpu"


def _device_of(tensors: dict[str, Tensor]) -> torch.device:
    """Where a fragment's tensors are (the CPU for none: a sharded island's empty dicts)."""
    return next(iter(tensors.values())).device if tensors else torch.device("cpu")


def storage_bytes(groups: Mapping[str, Iterable[Tensor]]) -> dict[str, int]:
    """Bytes of memory held by each group of tensors, counted by storage: a tensor that views
    memory counted already (the weights' copy in a flat buffer, a base that is the pulled body)
    adds nothing, and a storage in two groups counts in the first. The learner's own tally of
    its copies of the model (FragmentSync.held_copies), whatever the allocator does."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    for group, tensors in groups.items():
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[group] = total
    return out


def at_step_cap(fragments: Sequence[FragmentState], most: int) -> list[int]:
    """The fragments whose counters already hold `most` steps (core/push_bounds.max_push_steps):
    a push of one of them now is the largest the syncer accepts, and after one more inner step
    it would be refused. The island takes no step while this is not empty."""
    return [f for f, state in enumerate(fragments) if state.counters.steps >= most]


def checked_fragment(
    f: int, tensors: Mapping[str, Tensor], params: Mapping[str, Tensor], names: Sequence[str]
) -> dict[str, Tensor]:
    """A pulled fragment's tensors `names` in fp32, checked against the model's shapes
    (ValueError naming the tensor)."""
    for name in names:
        if tuple(tensors[name].shape) != tuple(params[name].shape):
            raise ValueError(
                f"fragment {f}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                f"the model has {tuple(params[name].shape)}"
            )
    return {n: tensors[n].to(torch.float32) for n in names}
