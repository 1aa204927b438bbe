"""The syncer's gate: who may be an island (admission.py) and what work may enter a round
(guards.py), applied to the membership with the service's lock held. What a merge does with work
that passed the gate but cannot be merged is merge.py's.

- admit: a join (or an admin route naming a new island) is refused unless the job admits the
  name; a refusal that may be stale (503: the job may have grown) re-reads the
  spec's `islands` from the mounted config first (at most every RELOAD_SECONDS). When the syncer
  already holds as many island records of the new island's side (own, or other regions') as the
  job has there, a new one takes the place of one of that side that timed out or left (or, on
  the other regions' side, was dropped by the admin, or is a region's beyond an equal share:
  admission.room_for).
- check_work / check_delta / accepted: the guards, with the replicas each island's work counts
  for (what it joined with, at most what the job admits; a push whose tokens need more re-reads
  `islands` first, as a join does).
- refused: a refused push of a known island is logged and counted per island and reason
  (protocol.REFUSAL_REASONS: the status document's `refusals`, the operator's Events, the
  refused_contributions metric); maxRefusals in a row drop the island with a reason that starts
  with protocol.DROPPED_FOR_REFUSALS, so the operator does not re-add it for healthy pods (the
  admin route can: its next pushes are checked like any). A refusal by the learned bound counts
  only when the push is an outlier by the island's own history too (guards.py): the bound over
  islands is one no island can be dropped for, so no island can get another dropped. Whatever
  the reason, refused_runs.REFUSED_RUN refusals in a row to one fragment leave the island out of
  the rounds (update_unsupported) until a push of it is accepted: at K = M a round would
  otherwise wait for ever for an island whose pushes a guard refuses but never drops it.
- watch: the guards' detection (ContributionGuard.suspects: an island whose pushes all sit at
  the learned bound) as the health problem AT_BOUND, which the operator turns into the job's
  SyncerHealthy condition (IslandPushesAtBound); it clears when no island is suspect. Likewise
  an island whose pushes all fall below the work evidence's bar (ContributionGuard.unsupported:
  zero pushes claiming work) as WORK_UNSUPPORTED (IslandWorkUnsupported).
- faint_end: in a job of two, an island named faint whose named pushes were partly merged
  (ContributionGuard.faint_merged: noise just above the work evidence's bar, with claims) is what
  the service ends the job for, at its best-evaluated checkpoint (FAINT_ENDED; issue 46: one bad
  island of two cannot be bounded, only stopped).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from diloco_trainer.api import protocol
from diloco_trainer.api.manifest import SavedGuards
from diloco_trainer.api.protocol import PushMeta
from diloco_trainer.api.spec import ConfigError, JobSpec, load_spec
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.intake.admission import RETRY_AFTER, Admission, region
from diloco_trainer.syncer.intake.guards import (
    RATE_ALLOWANCE,
    ContributionGuard,
    ContributionRefused,
    DeltaStats,
)
from diloco_trainer.syncer.intake.payload import EncodedPayload
from diloco_trainer.syncer.intake.refused_runs import RefusedRuns
from diloco_trainer.syncer.intake.validation import push_contribution
from diloco_trainer.syncer.state import (
    AT_BOUND,
    DROPPED,
    LEFT_OUT,
    WORK_UNSUPPORTED,
    Contribution,
    CountBound,
    Health,
    Membership,
    RoundSizes,
    SyncerMetrics,
    SyncState,
)

log = logging.getLogger("diloco.syncer")

# A join the syncer does not admit re-reads the config's islands at most this often.
RELOAD_SECONDS = 5.0


def refusal_reason(err: Refused) -> str:
    """The reason a refused push is counted under: the guards' code, else REFUSAL_INVALID (a
    400 from decoding the body)."""
    return err.code if err.code in protocol.CONTRIBUTION_REFUSALS else protocol.REFUSAL_INVALID


class Gate:
    """Admission and guards of one job's syncer (not thread-safe: the caller locks)."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        guard: ContributionGuard,
        metrics: SyncerMetrics,
        config_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        health: Health | None = None,
    ) -> None:
        self.admission = Admission.from_spec(spec)
        self.guard = guard
        # Each island's round H_i (inner.stepsPerIsland) and the push bounds it gives.
        self.rounds = RoundSizes(spec)
        # K = M: the islands drain on their 1/M shares of the budget until rounds differ
        # (Syncer.shares_kept), with no stop target to give back a push's uncredited tokens.
        self.lock_step = spec.sync.quorum >= max(spec.islands.count, spec.total_shards())
        self.metrics = metrics
        self.config_file = config_file  # where `islands` can be re-read from; None: never
        self._reloaded_at = -RELOAD_SECONDS
        self.clock = clock  # wall-clock seconds for the work rate (guards.WorkRate)
        self.health = health  # where the guards' detection is reported (watch)
        # Refused pushes since the start, {island: {reason: count}}: only islands the syncer
        # holds a record of (the job's own names), only protocol.REFUSAL_REASONS: bounded.
        self.refusals: dict[str, dict[str, int]] = {}
        # Refused pushes in a row per (fragment, island): REFUSED_RUN of them leave the island
        # out of the rounds (refused_runs.py; not persisted: a restart waits for a new run).
        self.runs = RefusedRuns()

    # ----- islands -----------------------------------------------------------------------------

    def admit(self, members: Membership, island: str, now: float) -> None:
        """Refused unless the job admits `island`; makes room for a new island by forgetting
        one that timed out or left when the syncer holds `cap` of them."""
        refusal = self.admission.refusal(island)
        if refusal is not None and refusal.status == 503 and self._reload_islands():
            refusal = self.admission.refusal(island)
        # Counted per side (admission.cap_for): other regions cannot take the local records,
        # and share theirs fairly (admission.room_for).
        room = self.admission.room_for(members.islands, island)
        if refusal is None and room.full:
            if room.replaces is None:
                side = self.admission.same_side(members.islands, island)
                where = "here" if self.admission.is_own(island) else "in other regions"
                prefix = region(island) or ""
                quota = None if self.admission.is_own(island) else self.admission.quota(prefix)
                if quota is not None:  # islands.regions: the region's own count is full
                    held = self.admission.held_by(members.islands, prefix)
                    why = (
                        f"region {prefix!r} holds {held} island records, its islands.regions "
                        f"count is {quota}, and none of them is gone (timed out, left, dropped "
                        "by the admin)"
                    )
                else:
                    why = (
                        f"the syncer already knows {len(side)} islands {where}, as many as the "
                        "job has there, and none it may replace (timed out, left, dropped by "
                        "the admin, or another region's beyond an equal share)"
                    )
                refusal = Refused(
                    503,
                    why,
                    protocol.ERROR_NOT_ADMITTED,
                    retry_after=RETRY_AFTER,
                )
            else:
                gone = room.replaces
                log.warning(
                    "island %s (%s) makes room for %s", gone, members.islands[gone].state, island
                )
                members.forget(gone, now)
        if refusal is not None:
            self.metrics.refused_joins.labels(refusal.code).inc()
            log.warning("refused island %r: %s", island[:80], refusal.message)
            raise refusal

    def _reload_islands(self) -> bool:
        """Re-read `islands` from the config file (scaling changes it without restarting the
        syncer), at most every RELOAD_SECONDS; True when the admission changed."""
        now = time.monotonic()
        if self.config_file is None or now - self._reloaded_at < RELOAD_SECONDS:
            return False
        self._reloaded_at = now
        try:
            islands = load_spec(self.config_file).islands
        except ConfigError as err:
            log.warning("cannot re-read the job's islands from %s: %s", self.config_file, err)
            return False
        admission = Admission.from_islands(islands, self.admission.remote_replicas)
        if admission == self.admission:
            return False
        log.info("the job's islands changed: %s -> %s", self.admission, admission)
        self.admission = admission
        return True

    # ----- pushes ------------------------------------------------------------------------------

    def replicas(self, members: Membership, island: str) -> int:
        """The replicas an island's work counts for: what it joined with, at most what the job
        admits (a record restored from an older spec may say more)."""
        rec = members.islands.get(island)
        declared = rec.replicas if rec is not None else 1
        return max(1, min(declared, self.admission.replicas_for(island)))

    def check_work(self, members: Membership, island: str, *, tokens: int, steps: int) -> None:
        """The guards' bounds on the work a push claims (steps, tokens for its replicas), and
        its steps from the island's credit over time (at the step time it last reported)."""
        self._check_one_push(members, island, tokens=tokens, steps=steps)
        rec = members.islands.get(island)
        others = [r.step_time for r in members.islands.values() if r.step_time]
        step_time = self.guard.rate.step_time(rec.step_time if rec else None, others)
        self.guard.take_steps(island, steps, step_time, self.clock())

    def push_tokens_most(self, members: Membership, island: str) -> int:
        """The most tokens one push of the island may carry (_check_one_push's bound): its step
        cap's steps (STEP_ROUNDS x its H_i + τ) x its tokens a step for its replicas."""
        most = self.rounds.max_push_steps(members.islands.get(island), island)
        return most * self.guard.work.tokens_per_step * self.replicas(members, island)

    def refused_push(self, members: Membership, fragment: int, meta: PushMeta, code: str) -> None:
        """A push of the island to `fragment` was refused (`code`, Refused.code): its tokens
        (at most a capped push's, over the fragments, as merges count them) are work its
        learner does not train again, and its heartbeat count runs ahead of its merged tokens
        by them (count_bound). One refused as ahead (protocol.ERROR_AHEAD) is counted only if
        the island's next push to the fragment does not carry its steps (Membership.pushed):
        its learner pushes it again after a syncer restart, and counted at once its tokens
        were counted twice, refused and merged."""
        rec = members.islands.get(meta.island)
        if rec is None or rec.joins == 0:
            return  # not an island's count: nothing it reports runs ahead
        fragments = max(1, len(self.guard.caps))
        tokens = min(max(0, meta.tokens), self.push_tokens_most(members, meta.island))
        members.refused_push(
            meta.island,
            tokens / fragments,
            fragment=fragment,
            base=meta.base_version,
            ahead=code == protocol.ERROR_AHEAD,
        )

    def count_bound(self, members: Membership, island: str) -> CountBound:
        """What the island's heartbeat count may claim (state.targets.CountBound), from its own
        record and the spec: growth at RATE_ALLOWANCE x its tokens a step over the step time its
        pushes' credit fills at (check_work: its claim, never below the median island's over
        guards.FASTEST once MAJORITY_CLAIMS islands claim one, nor MIN_STEP_TIME), and a lead
        over its merged tokens of a capped push plus its refused pushes' tokens."""
        rec = members.islands[island]
        others = [r.step_time for r in members.islands.values() if r.step_time]
        step_time = self.guard.rate.step_time(rec.step_time, others)
        step_tokens = self.guard.work.tokens_per_step * self.replicas(members, island)
        return CountBound(
            rate=RATE_ALLOWANCE * step_tokens / step_time,
            ahead=self.push_tokens_most(members, island) + rec.refused_tokens,
        )

    def _check_one_push(self, members: Membership, island: str, *, tokens: int, steps: int) -> None:
        replicas = self.replicas(members, island)
        # The island's own round: STEP_ROUNDS x its H_i + τ (round_sizes.RoundSizes).
        most = self.rounds.max_push_steps(members.islands.get(island), island)
        work = replace(self.guard.work, max_steps=most)
        try:
            work.check(tokens=tokens, steps=steps, replicas=replicas)
        except ContributionRefused as err:
            rec = members.islands.get(island)
            undercounted = rec is not None and rec.replicas > replicas
            if err.code != protocol.ERROR_TOKENS_RANGE or not undercounted:
                raise
            if not self._reload_islands():  # islands.replicas may have grown
                raise
            replicas = self.replicas(members, island)
            work.check(tokens=tokens, steps=steps, replicas=replicas)

    def admit_push(self, state: SyncState, fragment: int, meta: PushMeta) -> None:
        """Admit a push before its values are read: the island known and not dropped, its base
        version neither stale nor ahead (rounds.check_push), the work it claims within the
        guards' bounds (check_work). Refused, with nothing changed, otherwise."""
        state.check_push(fragment, meta.island, meta.base_version)
        self.check_work(state.membership, meta.island, tokens=meta.tokens, steps=meta.steps)

    def judge_push(
        self,
        state: SyncState,
        fragment: int,
        meta: PushMeta,
        payload: EncodedPayload,
        stats: DeltaStats,
        now: float,
    ) -> Contribution:
        """A measured push as its round's contribution: admitted again (a merge or a drop may
        have happened while it was measured), its values within the guards' bounds (finite,
        norm bounds). Refused, with nothing changed, otherwise."""
        lag = state.check_push(fragment, meta.island, meta.base_version)
        try:
            self.guard.check_delta(fragment, meta.island, stats, meta.steps)
        finally:
            self.watch()
        self.runs.accepted(fragment, meta.island)
        self.update_unsupported(state, now)  # an accepted push ends its island's naming
        contribution = push_contribution(meta, lag=lag, payload=payload, now=now)
        round_steps = self.rounds.round_push_steps(
            state.membership.islands.get(meta.island), meta.island
        )
        contribution.clip = self.guard.contribution_clip(
            fragment, meta.island, stats.norm, meta.steps, round_steps
        )
        contribution.credit_steps = self.guard.credit_steps(meta.steps, round_steps)
        # The budget counts the credited round's tokens only where a stop target gives its
        # island the rest back to train (K < M, or K = M once rounds differ). On K = M's 1/M
        # shares the islands drain at their shares in their own counts: counted short, the
        # merged tokens stayed below stopAfter and an honest streaming pair (its second
        # fragment's first push 1.5 rounds) trained on past its budget (pairdef46, bench.hetero
        # equal speeds K = 2); and there no claim ends the job early, since it ends only once
        # every island has drained its share (Syncer.stop_reached).
        shares = self.lock_step and not self.rounds.split
        contribution.budget_steps = None if shares else contribution.credit_steps
        if contribution.credit_steps is not None:
            log.info(
                "push of %s to fragment %d: %d claimed steps credited as %d, one round of its "
                "own (syncer.guards.pairCredit)",
                meta.island,
                fragment,
                meta.steps,
                contribution.credit_steps,
            )
        if contribution.clip < 1.0:
            log.info(
                "push of %s to fragment %d: pseudo-gradient held to the other island's movement "
                "in its claimed steps, a round at most (syncer.guards.pairClip): x %.3g",
                meta.island,
                fragment,
                contribution.clip,
            )
        return contribution

    def refused(
        self, members: Membership, fragment: int, island: str, err: Refused, now: float
    ) -> str | None:
        """Count a refused push of a known island; returns the reason when this refusal drops
        it (maxRefusals in a row)."""
        log.warning("refused push of %s to fragment %d: %s", island, fragment, err.message)
        rec = members.islands.get(island)
        if rec is None:
            return None
        self._count(island, refusal_reason(err))
        self.runs.refused(fragment, island)
        if rec.state == DROPPED or not self.guard.refused(island, err):
            return None
        reason = (
            f"{protocol.DROPPED_FOR_REFUSALS}: {self.guard.max_refusals} pushes refused in a row "
            f"(syncer.guards.maxRefusals); the last: {err.message}"
        )[:500]
        members.set_state(island, DROPPED, reason, now)
        self.guard.forget(island)
        self.runs.forget(island)
        self.watch()
        self.metrics.dropped_islands.inc()
        log.warning("island %s dropped: %s", island, reason)
        return reason

    def watch(self) -> None:
        """Report the guards' suspects as the health problem AT_BOUND and the islands whose
        pushes carry no evidence of their claimed work as WORK_UNSUPPORTED, or clear them."""
        if self.health is None:
            return
        for kind, found in (
            (AT_BOUND, self.guard.suspects()),
            # refused at 1/32 (unsupported) or named at 1/4 (faint): one message per island
            (WORK_UNSUPPORTED, self.guard.faint() | self.guard.unsupported()),
        ):
            if found:
                self.health.report(kind, "; ".join(found.values()))
            elif kind in self.health.problems:
                self.health.clear(kind)

    def faint_end(self) -> str | None:
        """Why a job of two ends now (the health problem FAINT_ENDED's message), or None: an
        island named faint whose named pushes were partly merged (faint_merged). Only with the
        work evidence on (a job of fewer than guards.MAJORITY_ISLANDS islands, the movement cap
        on): with three islands a minority's pushes are bounded, not stopped for."""
        if self.guard.evidence is None:
            return None
        found = self.guard.faint_merged()
        if not found:
            return None
        return (
            "; ".join(found.values())
            + ": faint noise claiming work, which a job of two cannot bound, so the job ends "
            "at its best-evaluated checkpoint (README, Security)"
        )

    def unsupported_islands(self) -> frozenset[str]:
        """Islands whose recent pushes all claimed work they do not carry (guards.py's work
        evidence), or were all refused (REFUSED_RUN in a row to one fragment, whatever the
        reason: refused_runs.py): no merge's round spans them and no quorum counts them
        (SyncState.set_unsupported), until a push of theirs is accepted."""
        return frozenset(self.guard.unsupported()) | frozenset(self.runs.left_out())

    def update_unsupported(self, state: SyncState, now: float) -> bool:
        """Tell the rounds which islands are unsupported now (after a push was judged, an
        island dropped, a restart); True when that changed (a round may be due now)."""
        islands = self.unsupported_islands()
        changed = state.set_unsupported(islands, now)
        if changed:
            log.warning("islands left out of the rounds and the quorum: %s", sorted(islands))
        if self.health is not None:
            # Named as LEFT_OUT (an Event in the operator) for refused runs; an island the work
            # evidence refuses is named by WORK_UNSUPPORTED already, not twice.
            named = self.guard.unsupported()
            runs = {n: m for n, m in self.runs.left_out().items() if n not in named}
            if runs:
                self.health.report(LEFT_OUT, "; ".join(runs.values()))
            elif LEFT_OUT in self.health.problems:
                self.health.clear(LEFT_OUT)
        return changed

    def _count(self, island: str, reason: str) -> None:
        counts = self.refusals.setdefault(island, {})
        counts[reason] = counts.get(reason, 0) + 1
        self.metrics.refused_contributions.labels(island, reason).inc()

    def norm_history(self) -> list[list[float]]:
        """The guards' recent accepted norms per fragment, for checkpoints."""
        return self.guard.history.to_json()

    def saved_guards(self) -> SavedGuards:
        """The guards' per-island figures (work evidence, detection, streaks), for checkpoints."""
        return self.guard.saved()

    def refusals_json(self) -> dict[str, dict[str, int]]:
        """The status document's `refusals`: {island: {reason: count}} since the start."""
        return {island: dict(counts) for island, counts in sorted(self.refusals.items())}
