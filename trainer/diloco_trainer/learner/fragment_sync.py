"""Rank 0's side of the syncer protocol for the training loop: joining, pushing pseudo-gradients,
collecting merged fragments and turning them into the weights the island continues from, and
moving the island's schedule into phase with its peers (phase_alignment.py).

The training loop calls `after_step` once per inner step and gets back, per fragment to apply
now, the fp32 weights every rank installs (rank 0 broadcasts them). When a fragment's steps since
its base reach what one push may carry (fragment_state.at_step_cap), `after_step` holds: it
returns only once a merge or pull of that fragment has arrived, so the island steps no further
than the syncer accepts (it logs when it starts and stops holding; `held_since` says it).
Everything that talks to the syncer runs on the SyncerLink's thread; here we only submit work and
wait on it: bounded, except while holding.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from typing import Any

import torch
from torch import Tensor, nn

from diloco_trainer.api.protocol import PushMeta
from diloco_trainer.api.spec import ConfigError, JobSpec
from diloco_trainer.core import compress
from diloco_trainer.core.fragments import fragment_offsets, fragments_due
from diloco_trainer.core.push_bounds import STEP_ROUNDS, max_push_steps
from diloco_trainer.learner.device_copies import adopt
from diloco_trainer.learner.fill_steps import FillSteps
from diloco_trainer.learner.fragment_state import (
    FragmentState,
    InFlight,
    at_step_cap,
    checked_fragment,
    storage_bytes,
)
from diloco_trainer.learner.overlap import OverlapFit, covered_latency
from diloco_trainer.learner.phase_alignment import phase_shift
from diloco_trainer.learner.push_encoding import encode_for_wire, int8_bytes
from diloco_trainer.learner.shards import FragmentShards
from diloco_trainer.learner.step_costs import SyncPathPhases, timed_part
from diloco_trainer.learner.step_plan import (
    StepPlan,
    Window,
    adopt_round,
    blocks_for_merge,
    holds_for_late_merge,
    late_merge_bound,
    plan_idle,
    plan_step,
    wait_budget,
)
from diloco_trainer.learner.syncer_link import WAIT_SLICE_SECONDS, SyncerLink, SyncResult
from diloco_trainer.learner.syncer_restart import (
    AfterRestart,
    resend_note,
    resend_version,
    sync_outcome,
)

# The learner's logger: these lines are part of its log.
log = logging.getLogger("diloco.learner")
Weights = dict[str, Tensor]


class FragmentSync:
    """Rank 0's per-fragment state and its link to the syncer."""

    def __init__(
        self,
        spec: JobSpec,
        island: str,
        link: SyncerLink,
        params: dict[str, nn.Parameter],
        stop: threading.Event,
    ) -> None:
        self.spec = spec
        self.island = island
        self.link = link
        self.params = params
        self.stop = stop
        self.fragments: list[FragmentState] = []
        self.offsets: list[int] = []
        self.last_push: dict[int, float] = {}  # time.monotonic() of each fragment's latest push
        self.inflight: dict[int, InFlight] = {}
        self.arrived: dict[int, SyncResult] = {}
        # A syncer restart's pushes to make again and its count of merged steps taken back.
        self.restart = AfterRestart()
        self.round_times: list[float] = []
        self.error_feedback = compress.ErrorFeedback() if spec.sync.error_feedback else None
        self.step_time = 0.0  # EMA of the inner step time, kept by the loop
        self.position = 0  # schedule position (what fragments_due and heartbeats see)
        self.phase_pending = 0  # steps still to delay (> 0) or advance (< 0)
        self.shifted_at = -math.inf  # time.monotonic() the last schedule shift began
        self.measured: dict[int, float | None] = {}  # per arrived fragment: InFlight.previous
        self.most_steps = max_push_steps(spec)  # the syncer refuses a push of more steps
        # H_i (inner.stepsPerIsland): inner.steps until the syncer names another (_adopt_round).
        self.round_steps = spec.inner.steps
        # This process's steps in units of inner.steps' rounds (each step H / H_i): what the
        # K = M drain counts its share in, since islands at K = M run the same number of rounds
        # whatever their H_i (drain.DrainTrigger).
        self.round_work = 0.0
        self.held_since: float | None = None  # time.monotonic() the island began to hold
        # time.monotonic() a hold for a late merge began (_hold_late, K < M), None when none is
        self.late_held_since: float | None = None
        self.waited = 0.0  # s blocked on the syncer (merge waits, holds) since take_waited
        # EMA of the wall seconds per inner step, everything between two steps included: the
        # clock a schedule position runs at, and so the one phase alignment converts with.
        self.wall_step = 0.0
        self._last_step: float | None = None
        self.clock = time.monotonic  # what wall_step is measured with (a test may replace it)
        # Set by the loop when the island is sharded (islands.parallelism fsdp): the fragments'
        # tensors then live in every rank's FragmentShards, and FragmentState keeps only versions
        # and counters (its tensor dicts stay empty).
        self.shards: FragmentShards | None = None
        islands = max(spec.islands.count, spec.total_shards())
        self.blocking = blocks_for_merge(
            quorum=spec.sync.quorum, islands=islands, overlap=self.overlap
        )
        self.overlap_fit = OverlapFit(spec, blocking=self.blocking)
        self.fill = FillSteps(spec)  # a slow island's merge waits at K = M (fill_steps.py)
        # sync.lateMergeRule eager: the proxies rank 0 moved fragments to at this step's pushes
        # (after_step returns them, so every rank installs them).
        self.jumps: dict[int, Weights] = {}
        # The most copies of the model (held_copies, in units of the weights' bytes) this rank
        # held at a push or a receipt, the points where copies are made: logged at exit, and
        # what tests/e2e/test_learner_memory.py holds to ARCHITECTURE.md's memory model.
        self.peak_copies: dict[str, int] = {}
        # The sync path by part (push and receipt timed here, the rest by the loop).
        self.phases = SyncPathPhases()

    @property
    def overlap(self) -> int:
        """sync.overlapSteps: the most steps a push is overlapped with (overlap.py fits τ)."""
        overlap = self.spec.sync.overlap_steps
        assert overlap is not None, "JobSpec resolves sync.overlapSteps"
        return overlap

    @property
    def deadline(self) -> int:
        """Steps after a push at which a blocking learner waits for its merge (sync.mergeWait,
        core/grace.merge_wait_steps), for the τ of the latest push; a learner that does not
        block only polls, from τ (overlapSteps before any push)."""
        return self.overlap_fit.window(self.overlap_fit.latest)[1]

    @property
    def poll_from(self) -> int:
        """Steps after a push from which its merge is applied if it has arrived (sync.applyFrom,
        step_plan.poll_from_steps): τ, or the step after the push with "arrival"."""
        return self.overlap_fit.window(self.overlap_fit.latest)[0]

    def finished(self) -> bool:
        return self.link.finished.is_set()

    def take_waited(self) -> float:
        """Seconds blocked on the syncer since the last call (the loop's WindowCosts)."""
        waited, self.waited = self.waited, 0.0
        return waited

    def wait(self, future: concurrent.futures.Future[Any], timeout: float) -> bool:
        """Block up to `timeout` for a future; give up early on SIGTERM or a finished job.
        Meanwhile every push a restarted syncer lost or refused as ahead is pushed again
        (resend_lost) and the merges it lost are made up (_make_up), whichever fragment this
        waits for: at K = M the merge waited for may need a peer's push that waits, in turn,
        for one of this island's."""
        self.link.start_deferred()  # a push deferred to the next step is started first
        deadline = time.monotonic() + timeout
        while not future.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.stop.is_set() or self.finished():
                return False
            concurrent.futures.wait([future], timeout=min(remaining, WAIT_SLICE_SECONDS))
            self.resend_lost()
            self._make_up()
            self.link.start_deferred()  # what those pushed again, started now
        return True

    # -- memory ----------------------------------------------------------------------------------

    def held_copies(self) -> dict[str, int]:
        """Bytes of each copy of the model this rank's DiLoCo state holds now (storage_bytes):
        the weights, the Δ bases (and their GPU mirrors), the weights at the pushes in flight,
        merged fragments arrived and not yet applied, eager's last updates and error feedback's
        residuals. A push's encoded bytes and a pull's body are the link's, held only while
        they are sent or decoded (ARCHITECTURE.md, "A learner's memory")."""
        states = self.fragments
        arrived = [t for r in self.arrived.values() for t in r.pulled.tensors.values()]
        residuals = self.error_feedback.residuals.values() if self.error_feedback else []
        return storage_bytes(
            {
                "weights": list(self.params.values()),
                "base": [t for s in states for t in s.base.values()],
                "base_on_device": [t for s in states for t in s.base_on_device.values()],
                "at_push": [
                    t
                    for s in states
                    for t in [*(s.at_push or {}).values(), *(s.spare or {}).values()]
                ],
                "arrived": arrived,
                "last_update": [t for s in states for t in (s.last_update or {}).values()],
                "residuals": list(residuals),
            }
        )

    def _note_copies(self) -> None:
        """Keep the largest held_copies seen (by their total)."""
        now = self.held_copies()
        if sum(now.values()) > sum(self.peak_copies.values()):
            self.peak_copies = now

    # -- joining ---------------------------------------------------------------------------------

    def join(self) -> Any:
        """Join and fetch every fragment's global weights; the JoinInfo, or None if stopped."""
        future = self.link.submit(self.link.join(self.stop))
        if not self.wait(future, float("inf")):
            return None
        info = future.result()
        names = set(self.params)
        listed = [n for frag in info.fragments for n in frag]
        if set(listed) != names or len(listed) != len(names):
            missing, extra = names - set(listed), set(listed) - names
            raise ConfigError(
                "the syncer's model does not match this learner's (check model.preset/entrypoint): "
                f"missing {sorted(missing)[:5]}, unknown {sorted(extra)[:5]}"
            )
        pulled_future = self.link.submit(self.link.pull_all(len(info.fragments)))
        if not self.wait(pulled_future, float("inf")):
            return None
        eager = self.spec.sync.late_merge_rule == "eager"
        self.fragments = [
            FragmentState(names=list(frag), track_update=eager) for frag in info.fragments
        ]
        pulls = pulled_future.result()
        for f, pulled in enumerate(pulls):
            self.arrived[f] = SyncResult(pulled=pulled, outcome="joined", seconds=0.0)
        # The first pushes' τ at K = M, before any sync is measured (overlap.join_latency).
        self.overlap_fit.joined(
            pull_bytes=[p.cost.body_bytes for p in pulls],
            pull_seconds=[p.cost.pull_seconds for p in pulls],
            values=sum(t.numel() for p in pulls for t in p.tensors.values()),
            pull_codec=info.pull_compression,
        )
        log.info(
            "joined the syncer at outer step %d: %d fragment(s), versions %s, codec %s, "
            "pull codec %s; pulled %d bytes in %s",
            info.outer_step,
            len(info.fragments),
            info.versions,
            info.codec,
            info.pull_compression,
            sum(p.cost.body_bytes for p in pulls),
            ", ".join(
                "?" if p.cost.pull_seconds is None else f"{p.cost.pull_seconds:.3f}s" for p in pulls
            ),
        )
        return info

    def take_joined(self) -> dict[int, Weights]:
        """The global weights of every fragment fetched on joining (they overwrite the local
        ones, whatever sync.mixAlpha says)."""
        out = {}
        self.restart.joined([r.pulled.version for _, r in sorted(self.arrived.items())])
        for f, result in sorted(self.arrived.items()):
            merged = checked_fragment(
                f, result.pulled.tensors, self.params, self.fragments[f].names
            )
            if self.shards is not None:
                self.shards.joined(f, merged)
                self.fragments[f].take_global({}, result.pulled.version)
            else:
                out[f] = self.fragments[f].take_global(merged, result.pulled.version)
            log.info("fragment %d: took version %d (joined)", f, result.pulled.version)
            if result.pulled.finished:
                self.link.finished.set()
        self.arrived.clear()
        return out

    # -- every step ------------------------------------------------------------------------------

    def count(self, tokens: int, loss: float, step_time: float) -> None:
        """One inner step's work, on every fragment's counters."""
        for state in self.fragments:
            state.counters.add(tokens, loss, step_time)
        for flight in self.inflight.values():
            flight.trained += 1
        self.round_work += self.fill.round_share(self.spec.inner.steps / self.round_steps)

    def after_step(self) -> dict[int, Weights]:
        """After an inner step: push what is due, collect what is needed; the weights of each
        fragment to apply now."""
        now = self.clock()
        if self._last_step is not None:
            dt = now - self._last_step
            self.wall_step = 0.9 * self.wall_step + 0.1 * dt if self.wall_step else dt
        self._last_step = now
        positions, self.phase_pending = self.fill.positions(self.position, self.phase_pending)
        self.resend_lost()
        self._make_up()
        pushed_at = {f: fl.step for f, fl in self.inflight.items()}
        if not positions:
            idle = plan_idle(
                self.position,
                overlap=self.overlap,
                pushed_at=pushed_at,
                poll_from=self.poll_from,
                windows={f: fl.window for f, fl in self.inflight.items()},
            )
            plans = [idle]
        else:
            plans = []
            for pos in positions:
                self.position = pos
                plans.append(self._plan(pos))
            self._adopt_round()
        out = self.restart.take_early()
        for plan in plans:
            for f in self._collect_plan(plan):
                target = self.receive(f)
                if self.shards is None:  # sharded: every rank has installed its rows already
                    out[f] = target
        self._push_again(out)
        self._make_up()
        self._hold_late(out)
        # An eager jump not overtaken by a receipt in this call (which started from it).
        for f, proxy in self.jumps.items():
            out.setdefault(f, proxy)
        self.jumps = {}
        self._hold(out)
        return out

    def _push_again(self, out: dict[int, Weights]) -> None:
        """Push each fragment in restart.push_again now, from the restarted syncer's fragment just
        received (installed on rank 0 first: the push reads the parameters; `out` still hands
        it to every rank): the steps since the refused push, into the syncer's open round
        beside its peers' pushes of that sync point (docs/algorithm.md, "A syncer restart")."""
        again = self.restart.push_again
        if not again:
            return
        self.install({f: out[f] for f in again if f in out})
        for f in sorted(again):
            if f in self.inflight:
                continue  # pushed already (the push cleared it) or a resent one in flight
            if not self.fragments[f].counters.steps:
                continue  # refused as soon as pushed: pushed after the next step (a push of
                # no steps is refused as malformed)
            tau = self.overlap_fit.fit(self.wall_step or self.step_time)
            self.push(f, self.position, self.overlap_fit.window(tau), again=True)

    def _make_up(self) -> None:
        """After a syncer restart (restart.seen): each fragment with no push in flight whose
        base is a version the restarted syncer lost is pushed now, its base counted as the
        syncer's version (the Δ a pull keeping the steps since the base would give), and that
        push stands for its next sync point (restart.skip_once): a peer that pushed that sync point
        before the restart pushes it again (docs/algorithm.md, "A syncer restart", rule 3)."""
        if not self.restart.seen:
            return
        self.restart.seen = False
        future = self.link.submit(self.link.versions(len(self.fragments)))
        budget = wait_budget(self.round_times, self.spec.sync.heartbeat_timeout_seconds)
        if not self.wait(future, budget) or future.exception() is not None:
            return  # unreachable again: its next refusal says so once more
        tau = self.overlap_fit.fit(self.wall_step or self.step_time)
        for f, version in enumerate(future.result()):
            state = self.fragments[f]
            if f in self.inflight or state.version <= version:
                continue
            log.warning(
                "step %d: fragment %d: the restarted syncer is at version %d, behind this "
                "island's base %d; pushing the steps since the base now, on its version",
                self.position,
                f,
                version,
                state.version,
            )
            self.restart.roll_back(f, state.version, version, round_steps=self.round_steps)
            state.version = version
            self.push(f, self.position, self.overlap_fit.window(tau), rebased=True)
            self.restart.skip_once.add(f)

    def _adopt_round(self) -> None:
        """At a round boundary, go on with the round the syncer named for this island (its H_i,
        inner.stepsPerIsland: step_plan.adopt_round): the schedule, the pushes in flight, τ's
        cap and the step cap follow."""
        if self.phase_pending:
            return  # a phase shift in progress counts positions of the current round
        old = self.round_steps
        moved = adopt_round(self.position, old, self.link.inner_steps)
        if moved is None or self.link.inner_steps is None:
            return
        new = self.link.inner_steps
        delta, self.position = moved - self.position, moved
        for fl in self.inflight.values():
            fl.step += delta
        self.round_steps = new
        self.offsets = fragment_offsets(new, len(self.fragments))
        self.overlap_fit.set_round(new)
        self.most_steps = STEP_ROUNDS * max(old, new) + self.overlap
        log.info(
            "step %d: rounds of %d inner steps from here (the syncer's for this island: it "
            "pushes at about its peers' pace; was %d)",
            self.position,
            new,
            old,
        )

    def _abandoned(self) -> frozenset[int]:
        """In-flight fragments whose merged result is overdue by more than the wait budget."""
        budget = wait_budget(self.round_times, self.spec.sync.heartbeat_timeout_seconds)
        now = time.monotonic()
        return frozenset(
            f
            for f, fl in self.inflight.items()
            if not fl.future.done() and now - fl.started > budget + fl.window[1] * self.step_time
        )

    def _hold(self, out: dict[int, Weights]) -> None:
        """Take no further step while a fragment is at the step cap: push it if nothing of it is
        in flight (or what is was lost: overdue), and wait for its merge or pull; each one that
        arrives is received into `out` like any other."""
        while (capped := at_step_cap(self.fragments, self.most_steps)) and not (
            self.stop.is_set() or self.finished()
        ):
            if self.held_since is None:
                self.held_since = time.monotonic()
                self.link.progress["holding"] = True  # the heartbeats tell the syncer
                log.warning(
                    "step %d: fragment(s) %s hold %d steps since their base, the most one push "
                    "may carry (4 x inner.steps + sync.overlapSteps); holding inner steps until "
                    "the syncer answers",
                    self.position,
                    capped,
                    self.most_steps,
                )
            abandoned = self._abandoned()
            for f in capped:
                if f not in self.inflight or f in abandoned:
                    tau = self.overlap_fit.fit(self.wall_step or self.step_time)
                    self.push(f, self.position, self.overlap_fit.window(tau))
                if self.collect(f, block=WAIT_SLICE_SECONDS):
                    target = self.receive(f)
                    if self.shards is None:
                        out[f] = target
        if self.held_since is not None:
            held, self.held_since = time.monotonic() - self.held_since, None
            self.link.progress["holding"] = False
            self.waited += held
            self._last_step = self.clock()  # the hold is not a step's wall time
            log.info("step %d: held %.1fs for the syncer; stepping on", self.position, held)

    def _hold_late(self, out: dict[int, Weights]) -> None:
        """K < M: take no further step while a push in flight is late_merge_bound steps old
        (ceil(H_i / 2) where the recent syncs say the link cannot carry the traffic, else
        H_i − 1) and its merge not installed (step_plan.holds_for_late_merge), so that at most
        that many steps are kept on top of it; wait for it up to the wait budget (as a blocking
        learner's merge wait), then train on without it. Each merge that arrives is received
        into `out` like any other."""
        if self.blocking or self.spec.sync.late_merge_hold == "off":
            return
        bound_by_link = self.overlap_fit.slow_link
        for f in sorted(self.inflight):
            flight = self.inflight[f]
            bound = late_merge_bound(self.round_steps, flight.window, link_bound=bound_by_link)
            if not holds_for_late_merge(
                blocking=self.blocking,
                steps_since_push=flight.trained,
                bound=bound,
                given_up=flight.hold_given_up,
                mode=self.spec.sync.late_merge_hold,
                stop_targets=self.link.stop_at is not None,
            ):
                continue
            budget = wait_budget(self.round_times, self.spec.sync.heartbeat_timeout_seconds)
            began = self.late_held_since = time.monotonic()
            try:
                got = self.collect(f, block=budget)
            finally:
                self.late_held_since = None
            held = time.monotonic() - began
            self.waited += held
            self._last_step = self.clock()  # the hold is not a step's wall time
            if got:
                target = self.receive(f)
                if self.shards is None:
                    out[f] = target
                log.info(
                    "step %d: fragment %d's merge not back %d steps after its push (the bound, "
                    "%s = %d of %d%s); held %.2fs for its merge",
                    self.position,
                    f,
                    flight.trained,
                    "ceil(H/2)" if bound_by_link else "H - 1",
                    bound,
                    self.round_steps,
                    ", the link slower than its traffic" if bound_by_link else "",
                    held,
                )
                continue
            if self.inflight.get(f) is flight:  # (one pushed again meanwhile holds afresh)
                flight.hold_given_up = True  # this push's budget is spent: train on as without
            if not self.stop.is_set() and not self.finished():
                log.warning(
                    "step %d: fragment %d not merged within %.0fs of a hold %d steps after "
                    "its push; training on without it",
                    self.position,
                    f,
                    budget,
                    flight.trained,
                )

    def _plan(self, position: int) -> StepPlan:
        self._take_again(position)
        abandoned = self._abandoned()
        # τ for a push now, fitted to the measured sync latency (sync.overlapMode); pushes in
        # flight keep the window they were made with.
        clock = self.wall_step or self.step_time
        tau = self.overlap_fit.fit(clock)
        window = self.overlap_fit.window(tau)
        plan = plan_step(
            position,
            inner_steps=self.round_steps,
            offsets=self.offsets,
            overlap=tau,
            pushed_at={f: fl.step for f, fl in self.inflight.items()},
            abandoned=abandoned,
            deadline=window[1],
            poll_from=window[0],
            windows={f: fl.window for f, fl in self.inflight.items()},
            skip_once=frozenset(self.restart.skip_once),
        )
        self.restart.skip_once -= set(plan.skip)
        for f in plan.push:
            self.overlap_fit.pushed(tau, clock, position)
            self.push(f, position, window)
            if tau > 0:
                self._eager_jump(f)
        return plan

    def _take_again(self, position: int) -> None:
        """At a fragment's sync point, the merge of its push made again after a syncer restart
        (InFlight.again) is waited for (as any merge wait) and received first, so the push due
        now is made, not skipped (docs/algorithm.md, "A syncer restart", rule 2)."""
        if position < self.round_steps:
            return  # a fresh job's first round pushes nothing (plan_step)
        budget = wait_budget(self.round_times, self.spec.sync.heartbeat_timeout_seconds)
        for f in fragments_due(position, self.round_steps, self.offsets):
            flight = self.inflight.get(f)
            if flight is None or not flight.again:
                continue
            if not self.collect(f, block=budget if self.blocking else 0.0):
                continue  # not back: skipped as any push in flight
            target = self.receive(f)
            if self.shards is None:
                self.install({f: target})  # the push below reads the parameters
                self.restart.early[f] = target

    def _eager_jump(self, f: int) -> None:
        """sync.lateMergeRule eager, after a push overlapped with τ > 0 steps: move fragment f to
        the proxy of its coming merge (FragmentState.eager_jump). Rank 0's weights move at once
        (a receipt later in the same call computes from them); after_step hands the proxy to
        every rank. A sharded island keeps its weights (the rule is keep there)."""
        if self.spec.sync.late_merge_rule != "eager" or self.shards is not None:
            return
        outer = self.spec.outer
        proxy = self.fragments[f].eager_jump(
            lr=outer.lr,
            momentum=outer.momentum,
            nesterov=outer.nesterov,
            inner_steps=self.spec.inner.steps,
        )
        with torch.no_grad():
            for n, t in proxy.items():
                self.params[n].copy_(t)
        self.jumps[f] = proxy

    def install(self, targets: dict[int, Weights]) -> None:
        """Write receipts' weights (receive's) into rank 0's parameters now, for a push that
        follows in the same call (the drain); the caller still hands them to every rank. A host
        receipt that wrote the parameters in place already (FragmentState.receive) is skipped."""
        with torch.no_grad():
            for weights in targets.values():
                for n, t in weights.items():
                    if t.data_ptr() != self.params[n].data_ptr():
                        self.params[n].copy_(t)

    def _collect_plan(self, plan: StepPlan) -> list[int]:
        """Wait (bounded) for the fragments the plan needs, check the ones it may apply."""
        budget = wait_budget(self.round_times, self.spec.sync.heartbeat_timeout_seconds)
        done = []
        for f in self.fill.unfilled(self, plan.wait):
            started = time.monotonic()
            # The steps since the push (τ, or H - 1 with sync.mergeWait nextPush), in seconds:
            # what the overlap hid of the merge's latency.
            flight = self.inflight.get(f)
            overlapped = started - flight.started if flight is not None else 0.0
            got = self.collect(f, block=budget if self.blocking else 0.0)
            waited = time.monotonic() - started
            self.waited += waited
            if got:
                done.append(f)
                if waited > 0.05:
                    log.info(
                        "step %d: waited %.2fs for fragment %d (the %d overlapped steps since "
                        "its push took %.2fs)",
                        self.position,
                        waited,
                        f,
                        flight.window[1] if flight is not None else self.deadline,
                        overlapped,
                    )
            elif self.blocking and not self.stop.is_set() and not self.finished():
                log.warning(
                    "step %d: fragment %d not merged within %.0fs; training on without it",
                    self.position,
                    f,
                    budget,
                )
        done.extend(f for f in plan.poll if f in self.inflight and self.collect(f, block=0.0))
        return done + self.fill.settle(self, done, budget)

    # -- pushes and arrivals ---------------------------------------------------------------------

    def _current(self, f: int) -> Weights:
        """Fragment f's weights as they are, without a copy: only read. A push copies them
        (FragmentState.encode_push; on a GPU the copies, Δ and its encoding stay there), and a
        receipt computes the new weights (on the host, over that push's copies) before any
        parameter is written. They are fp32 master weights."""
        return {n: self.params[n].detach() for n in self.fragments[f].names}

    @timed_part("push")
    def push(
        self, f: int, position: int, window: Window, *, again: bool = False, rebased: bool = False
    ) -> None:
        """Compute Δ_f = θ_global − θ_local (fp32, where the weights are), encode it and push it
        in the background; its merge is polled for and waited for at `window` (steps after the
        push at `position`). `again`: a push made again after a syncer restart (resend_lost:
        `position` is the lost push's, so its merge is polled for and waited for where that
        one's would have been; _push_again), whose merge is taken at the next sync point.
        `rebased`: the base's version was counted as the syncer's (_make_up), so its weights
        are not that version's: the merge is pulled whole, not as updates to them."""
        began = time.perf_counter()
        state = self.fragments[f]
        if self.shards is None and state.merge_written(f in self.inflight, f, position):
            return
        c = state.counters
        codec = self.spec.sync.compression
        if self.shards is not None:
            state.begin_push({})  # the counters at the push; the tensors are the shards'
            delta = self.shards.gather_pseudo_gradient(f)
            encoded, ready = encode_for_wire(delta, codec, self.error_feedback)
        else:
            encoded, ready = state.encode_push(self._current(f), codec, self.error_feedback)
        meta = PushMeta(
            island=self.island,
            base_version=state.version,
            tokens=c.tokens,
            steps=c.steps,
            loss=c.mean_loss,
            step_time=c.mean_step_time,
            codec=codec,
            sync_time=state.last_sync_seconds,
            kept_steps=min(state.kept_steps, c.steps),
        )
        self.restart.push_again.discard(f)
        self.fill.pushed(f)
        old = self.inflight.get(f)
        previous = self.last_push.get(f)
        self.last_push[f] = time.monotonic()
        if old is not None and not again:
            old.future.cancel()
            log.warning("step %d: fragment %d overdue, pushing it again", position, f)
        # A sharded island holds no whole fragment to apply compressed updates to: it pulls
        # full fragments (held None).
        held = state.held() if self.shards is None and not rebased else None
        # Learners that do not block align their phase within merges too (merge_lateness).
        # A host learner's receipt: its θ_global − θ_push made on the link's thread as soon as
        # the merge is pulled (FragmentState.receipt_preparer; mixAlpha 0 only).
        prepare = state.receipt_preparer() if self.shards is None and not self._alpha() else None
        if self.shards is None:
            self._note_copies()
        sync = self.link.sync_fragment(
            f, encoded, meta, held, within=not self.blocking, ready=ready, prepare=prepare
        )
        future = self.link.submit_later(sync)  # started before the next backward, or a wait
        self.inflight[f] = InFlight(
            step=position,
            started=self.last_push[f],
            future=future,
            previous=previous,
            window=window,
            again=again,
        )
        # A deferred host push (FragmentState.encode_push) is encoded on the link's thread: its
        # bytes are the int8 format's, known from the sizes.
        nbytes = sum(t.numel() * t.element_size() for t in encoded.values()) or int8_bytes(
            self._current(f)
        )
        log.info(
            "step %d: fragment %d pushed%s (base version %d, %d bytes %s, %d tokens in %d steps; "
            "%.3fs on the training thread)",
            self.position if again else position,
            f,
            " again" if again else "",
            state.version,
            nbytes,
            codec,
            c.tokens,
            c.steps,
            time.perf_counter() - began,
        )

    def collect(self, f: int, *, block: float) -> bool:
        """Has fragment f's sync finished (waiting up to `block` s)? Keeps the result. A push
        a syncer restart lost or refused as ahead is pushed again (resend_lost) and its merge
        waited for in the time left. A wait (`block` > 0) is one of the link's waits
        (step_costs.WaitMeter: the heartbeats' `waiting`)."""
        if block <= 0:
            return self._collect(f, deadline=time.monotonic())
        self.link.waits.begin(time.monotonic())
        try:
            return self._collect(f, deadline=time.monotonic() + block)
        finally:
            self.link.waits.end(time.monotonic())

    def _collect(self, f: int, *, deadline: float) -> bool:
        while True:
            flight = self.inflight[f]
            done = self.wait(flight.future, max(0.0, deadline - time.monotonic()))
            if self.inflight.get(f) is not flight:
                continue  # pushed again meanwhile (wait's resend_lost): wait for that one
            if not done:
                return False
            if resend_version(sync_outcome(flight.future), self.fragments[f].version) is None:
                break
            self.resend_lost()
            if self.inflight.get(f) is flight:
                break  # not pushed again (its base was written: push): taken as it ended
        try:
            self.arrived[f] = flight.future.result()
            self.measured[f] = flight.previous
            self.fill.arrived(f, flight.started + self.arrived[f].seconds)
        except (concurrent.futures.CancelledError, Exception) as err:
            # The sync task only ends in an exception on a bug or a refused pull (auth): start
            # over from the current global fragment rather than train on alone for ever.
            log.error("fragment %d: sync failed (%s); resyncing", f, err)
            flight.future = self.link.submit(self.link.resync(f))
            return False
        del self.inflight[f]
        return True

    def resend_lost(self) -> None:
        """Push again, at once, every fragment whose push a restarted syncer lost (its sync
        ended in PushLost) or refused as ahead of it (409 ahead: its base is a merge the restart
        lost), in that push's place in the schedule, with all the work since the base, on the
        version syncer_restart.resend_version names. Pushed only at its next sync point, a lost
        push met its peers' pushes of the sync point before for the rest of the job; a refused
        one, pushed only once received, held both islands of a K = M job while one waited for
        the other fragment's merge (docs/algorithm.md, "A syncer restart", rules 1 and 2)."""
        for f, flight in list(self.inflight.items()):
            outcome = sync_outcome(flight.future)
            state = self.fragments[f]
            version = resend_version(outcome, state.version)
            if version is None:
                continue
            self.restart.seen = True
            log.warning("step %d: fragment %d: %s", self.position, f, resend_note(outcome, version))
            if isinstance(outcome, SyncResult):  # refused: its residual's push is gone
                if self.error_feedback is not None:
                    self.error_feedback.reset(state.names)
                if outcome.pulled.finished:
                    self.link.finished.set()
            # A base the restarted syncer lost is counted as its version, as _make_up does, so
            # the push is taken, not refused as ahead; the merges it lost are lost work.
            rebased = version < state.version
            if rebased:
                self.restart.roll_back(f, state.version, version, round_steps=self.round_steps)
                state.version = version
            self.push(f, flight.step, flight.window, again=True, rebased=rebased)

    @timed_part("receipt")
    def receive(self, f: int) -> Weights:
        """Install an arrived fragment as the new base; the weights the island continues from."""
        began = time.perf_counter()
        if self.shards is None:
            self._note_copies()  # a full merged fragment beside the base (a chain is in it)
        result = self.arrived.pop(f)
        state = self.fragments[f]
        held, carried = state.version, state.counters_at_push
        merged = checked_fragment(f, result.pulled.tensors, self.params, self.fragments[f].names)
        if self.shards is not None:
            self.shards.receive(f, merged)
            target = state.receive({}, result.pulled.version, {}, self._alpha())
        else:
            here = adopt(result.on_device) if result.on_device is not None else None
            target = state.receive(
                merged, result.pulled.version, self._current(f), self._alpha(), here=here
            )
        if result.outcome != "merged" and self.error_feedback is not None:
            # Not merged: the residual's push is gone, and one from a push the syncer refused
            # (a NaN in it, say) would spoil every push after it.
            self.error_feedback.reset(state.names)
        state.last_sync_seconds = result.seconds
        self.overlap_fit.observe(
            covered_latency(
                covers=self.spec.sync.overlap_covers,
                latency=result.latency,
                seconds=result.seconds,
            ),
            net=result.latency,
        )
        self.overlap_fit.judge_link(self.wall_step or self.step_time, self.position)
        self.restart.count_merged(
            f,
            result,
            held=held,
            carried=carried.steps if carried is not None else 0,
            round_steps=self.round_steps,
        )
        if result.restarted:
            self.restart.refused(f)
        else:
            # A sync that rode out a syncer restart took the outage's time: kept, it would
            # raise the wait budget (3x the recent times) for the next rounds.
            self.round_times = [*self.round_times[-7:], result.seconds]
        log.info(
            "step %d: fragment %d applied version %d (%s, %.2fs after the push; %.3fs on the "
            "training thread%s)",
            self.position,
            f,
            result.pulled.version,
            result.outcome,
            result.seconds,
            time.perf_counter() - began,
            "" if result.pull_path is None else f"; {result.pull_path.describe()}",
        )
        if result.pulled.finished:
            self.link.finished.set()
        measured = self.measured.pop(f, None)
        if result.lateness_within and (measured is None or measured <= self.shifted_at):
            return target  # a reading of a push from before our last shift: already corrected
        self._align(f, result.lateness, within=result.lateness_within)
        return target

    @property
    def lost_work(self) -> float:
        """This island's work (in round_work's units) that syncer restarts took back from
        the fragment that lost the most: at K = M the drain's share counts round_work, and the
        job's outer step is its least merged fragment's, so the island trains that much more
        before it drains (loop.py; MergedSteps says why)."""
        return self.restart.lost_work(self.spec.inner.steps / self.round_steps)

    def _alpha(self) -> float:
        return self.spec.sync.mix_alpha

    def _align(self, f: int, lateness: float | None, *, within: bool = False) -> None:
        """Start moving the schedule onto the leader's phase (one shift at a time); `within`:
        the reading is of a merge that held this island's push (phase_alignment.WITHIN_DEADBAND)."""
        if lateness is None or self.phase_pending:
            return
        step = self.wall_step or self.step_time
        shift = phase_shift(lateness, inner_steps=self.round_steps, step_time=step, within=within)
        if shift:
            self.phase_pending = shift
            self.shifted_at = time.monotonic()
            log.info(
                "fragment %d: pushed %.2fs after a leader's merge; %s the schedule by %d step(s)",
                f,
                lateness,
                "delaying" if shift > 0 else "advancing",
                abs(shift),
            )
