"""The syncer's round and quorum state machine (pure: no I/O, no clock, no torch).

Every method takes `now` (seconds since the epoch) from the caller, so tests drive it with a fake
clock and the server with `time.time()`.

Rounds. Each fragment has a version (the number of merges so far) and one open round: pending
contributions keyed by island. A later push from the same island REPLACES its pending one: an
island's counters (tokens, steps) and its pseudo-gradient cover all its work since it last received
the fragment, so the newer push includes the older one and nothing is counted twice.

Retried pushes. The answers to each island's recent pushes per fragment are kept by pushId
(replay.py: the last maxStaleness + 1, at least 64), so a client retry or a replay gets the first
answer again instead of being counted twice. Checkpoints keep the answers of pushes already
merged (saved_answers), so this holds across a syncer restart too.

Quorum and grace. The effective quorum is min(K, active + awaited islands), at least 1. When
the round's contributors reach it, the grace window starts; the round is due when the window has
passed, when every island has contributed, or when no missing island is expected to push before
the window closes (expected_push: last progress report and step time against the fragment's
sync point; one with no report, overdue or not joined yet is waited for). Nor, whatever the
window, while a push of the fragment from a missing island is on its way (its body arriving:
uploads.py), until about two uploads from its start (core/grace.upload_wait_until).
The drain (learner/drain.py): an island that has trained its share of stopAfter and seen its
last pushes merged says so in its heartbeats (drained). It is no longer waited for: a round whose
other active islands have all pushed is due at once, quorum or not; once every active island
has drained with nothing pending (all_drained), the job's work is all merged, and the service
finishes the job if that is stopAfter but for the drain's rounding (targets.drained_at_budget).
Islands of the job that never joined hold neither (they have no part of the budget to do).
Membership (membership.py, owned here) tells this machine of every change (MembershipEvents), which
re-evaluates the quorum at once: dropping an island removes its pending contribution (which may
undo the quorum) and shrinks the active set (which may complete the round).

Grace "auto": core/grace.py, from the islands' step times, the quorum waits and the net sync time
(a learner's reported sync time minus what the syncer held its push, plus the merge time).

Work and staleness. Each fragment counts the rounds of work merged into it (the outer optimizer's
folds, passed to take_round); outer_step is the least of them. A push's staleness in rounds
is the work merged since its base version (clocks.py); pushes more than policy.max_staleness
versions old are refused (409 "stale"), pushes based on a future version too (409 "ahead").

Membership: the states are described in records.py, the transitions in membership.py.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from diloco_trainer.api import protocol
from diloco_trainer.api.documents import IslandStatus, PushAnswer
from diloco_trainer.api.manifest import SavedAnswer, SavedCount
from diloco_trainer.core import grace as window_rules
from diloco_trainer.core.contributions import credited_tokens
from diloco_trainer.core.fragments import fragment_offsets
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.state.clocks import WorkClocks
from diloco_trainer.syncer.state.crossed import crossed_rounds, crossed_wait, round_to_close
from diloco_trainer.syncer.state.membership import Membership
from diloco_trainer.syncer.state.records import (
    ACTIVE,
    DROPPED,
    LEFT,
    TIMED_OUT,
    Contribution,
    FragmentRound,
    IslandRecord,
    MergedPush,
    RoundPolicy,
    carried_again,
)
from diloco_trainer.syncer.state.replay import PushAnswers, push_window
from diloco_trainer.syncer.state.uploads import Uploads

__all__ = [
    "ACTIVE",
    "DROPPED",
    "LEFT",
    "TIMED_OUT",
    "Contribution",
    "RoundPolicy",
    "SyncState",
]

AUTO_GRACE_DEFAULT = 1.0
# Samples kept for the medians of t_quorum and t_merge (recent behaviour matters, not history).
_WINDOW = 32


@dataclass(frozen=True)
class RoundsSnapshot:
    """The rounds and membership as the status document shows them (SyncState.snapshot)."""

    outer_step: int
    versions: list[int]
    quorum: int  # the effective quorum
    quorum_target: int  # K
    awaited_islands: int
    grace: float
    pending: list[int]  # contributions in each open round
    active_islands: int
    islands: dict[str, IslandStatus]


@dataclass(frozen=True)
class SavedRounds:
    """What a checkpoint keeps of the rounds (SyncState.saved): rounds themselves are not kept
    (a pending push is pushed again after a restart)."""

    versions: list[int]
    outer_step: int
    work_clocks: list[list[list[float]]]
    islands: dict[str, IslandStatus]
    push_answers: list[SavedAnswer]
    counts: dict[str, SavedCount] = field(default_factory=dict)  # Membership.counts


def lost_with_restart(accepted_by: str, this_run: str, *, after: int, resumed: int) -> bool:
    """Whether the push that a pull for the merge after version `after` waits for was lost: a
    syncer run `accepted_by` (PushAnswer.run; "": not said, an older learner) accepted it into
    the round that makes version after + 1, and this run (a restart) resumed the fragment at
    version `resumed` <= `after`. Pending pushes are not checkpointed (SavedRounds), so this
    run's round can hold the push only if it was sent to it again (then answered by this run);
    resumed past `after`, the checkpoint's merge carries it and is served as usual.

    By where this run resumed, not by its version now: at K < M another island's pushes may
    merge past `after` before the pull comes (its learner's client backs off while the syncer
    is down), and that merge, served as this push's, lost its steps silently (adv17: 6 steps
    of a fragment, and the drain short of the budget, in tests/e2e/test_drain.py's restart)."""
    return bool(accepted_by) and accepted_by != this_run and resumed <= after


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class SyncState:
    """Rounds of every fragment, with the membership, work clocks and push answers they read.
    Not thread-safe: the caller locks."""

    def __init__(
        self,
        policy: RoundPolicy,
        num_fragments: int,
        versions: list[int] | None = None,
        rounds: list[int] | None = None,
    ) -> None:
        """`versions` and `rounds` (completed rounds of work) per fragment, from a checkpoint;
        without `rounds` every merge so far counts as one round (older checkpoints)."""
        if num_fragments < 1:
            raise ValueError("num_fragments must be >= 1")
        versions = versions or [0] * num_fragments
        rounds = versions if rounds is None else rounds
        if len(versions) != num_fragments or len(rounds) != num_fragments:
            raise ValueError(
                f"{len(versions)} versions and {len(rounds)} rounds for {num_fragments} fragments"
            )
        self.policy = policy
        pairs = zip(versions, rounds, strict=True)
        self.rounds = [FragmentRound(version=v, rounds=r) for v, r in pairs]
        self.membership = Membership(
            heartbeat_timeout=policy.heartbeat_timeout,
            startup_timeout=policy.startup_timeout,
            events=self,
        )
        # Per fragment, version -> rounds of work merged up to it, for a push's staleness in
        # rounds; the last maxStaleness + 1 versions.
        self.clocks = WorkClocks(versions, rounds, keep=policy.max_staleness + 1)
        # (island, fragment) -> recent pushIds and answers: a retry gets its first answer again.
        self.answers = PushAnswers(push_window(policy.max_staleness))
        self._quorum_waits: deque[float] = deque(maxlen=_WINDOW)
        # Active islands whose recent pushes all claimed work they did not carry (intake's work
        # evidence, a job of two) or were all refused (intake/refused_runs.py): set by the gate
        # (set_unsupported), not counted towards the quorum nor waited for, until a push of
        # theirs is accepted.
        self.unsupported: frozenset[str] = frozenset()
        # The islands the budget was split to once the stop targets are set (None before: the
        # service's IslandCalls sets it, targets.py); the active islands outside it hold
        # neither the drain's last rounds nor the finish (untargeted). Not persisted, as the
        # targets are not.
        self.split_to: frozenset[str] | None = None
        self._merge_seconds: deque[float] = deque(maxlen=_WINDOW)
        # Push bodies on their way (the edge registers an island's authenticated ones): a merge
        # at quorum waits for those of the islands it is missing (merge_due).
        self.uploads = Uploads(num_fragments)
        # (island, fragment) -> seconds the syncer held that island's last merged push.
        self._held: dict[tuple[str, int], float] = {}
        # (island, fragment) -> tokens of that island's pushes merged into the fragment: with
        # the pending push's own tokens (its work since the last merged one), a floor of the
        # island's tokens processed that a push proves before any heartbeat says so.
        self._merged_by: dict[tuple[str, int], int] = {}
        # The crossed rounds last seen (crossed.py): what they were, since when, and when the
        # round chosen of them merges; a change starts their wait again.
        self._crossed: tuple[object, float, float] | None = None

    # ----- views -------------------------------------------------------------------------------

    @property
    def versions(self) -> list[int]:
        return [r.version for r in self.rounds]

    @property
    def outer_step(self) -> int:
        """Outer steps completed: the rounds of work (outer-optimizer folds) of the fragment
        with the fewest; with every island in every merge, the number of merges."""
        return min(r.rounds for r in self.rounds)

    def effective_quorum(self) -> int:
        """min(K, active + awaited islands), at least 1: a round can always complete. An island
        the gate named unsupported or left out (set_unsupported) does not count: it is no island
        of the rounds, as a drained or dropped one is not. At K < M that lowers the quorum
        below K only once more than M - K islands are left out or gone: an adversary leaving
        itself out changes nothing there, and a minority of adversaries cannot get an honest
        island's pushes refused by a bound the others set (the median over islands, a majority
        of the direction votes), so the rounds still need K accepted pushes."""
        members = self.membership
        counted = len(self.spanning()) + members.awaited()
        return max(1, min(self.policy.quorum, counted))

    def spanning(self) -> set[str]:
        """The active islands a round spans: those not named unsupported or left out
        (set_unsupported)."""
        return self.membership.active() - self.unsupported

    def set_unsupported(self, islands: frozenset[str], now: float) -> bool:
        """The active islands whose recent pushes all claimed work they did not carry (the
        gate's work evidence: every one of its last pushes refused `work_unsupported`), or were
        all refused, whatever the reason (refused_runs.REFUSED_RUN in a row to one fragment: a
        direction or learned-bound refusal never drops an island, issues 46/47). Like a
        drained island they are not waited for and do not count towards the quorum (at K = M
        the other islands' merges would otherwise wait for a push that the gate refuses), and
        like an idle one the rounds do not span them (merger.take): dropped they are not (the
        other island set the bar), and the first push of theirs the gate accepts ends it.
        True when the set changed (the quorum is re-evaluated then)."""
        if islands == self.unsupported:
            return False
        self.unsupported = islands
        self._refresh(now)
        return True

    def grace(self, fragment: int | None = None) -> float:
        """The grace window in seconds: fixed, or auto from measured timings that exclude the
        window itself (core/grace.py). With `fragment`, that round's: no longer than an island
        already in it can train on before it holds for the merge (window_rules.round_in_flight);
        without, the job's (status, crossed rounds)."""
        if self.policy.grace_seconds is not None:
            return self.policy.grace_seconds
        active = self.membership.active_records()
        transfer = _median([r.transfer_time for r in active if r.transfer_time is not None])
        # τ·t_step island by island: each in flight for its own H_i steps of its own step time
        in_flight = window_rules.in_flight_seconds(
            learners_block=self.policy.learners_block,
            overlap_steps=self.policy.overlap_steps,
            rounds=[(self._round_steps(r), r.step_time) for r in active if r.step_time],
        )
        if fragment is not None:
            islands = self.membership.islands
            pushed = [islands[n] for n in self.rounds[fragment].pending if n in islands]
            in_flight = window_rules.round_in_flight(
                in_flight,
                [(self._round_steps(r), r.step_time) for r in pushed if r.step_time],
                learners_block=self.policy.learners_block,
                overlap_steps=self.policy.overlap_steps,
            )
        return window_rules.grace_window(
            step_time=_median([r.step_time for r in active if r.step_time]),
            overlap_steps=window_rules.in_flight_steps(
                learners_block=self.policy.learners_block,
                overlap_steps=self.policy.overlap_steps,
                inner_steps=self.policy.inner_steps,
            ),
            in_flight=in_flight,
            quorum_wait=_median(list(self._quorum_waits)) or 0.0,
            sync_net=(transfer or 0.0) + (_median(list(self._merge_seconds)) or 0.0),
            cap=self.policy.heartbeat_timeout,
            default=AUTO_GRACE_DEFAULT,
            gamma=window_rules.share_of_slack(learners_block=self.policy.learners_block),
        )

    def lag_rounds(self, fragment: int, base_version: int) -> float:
        """Rounds of work merged into fragment since `base_version` (clocks.py)."""
        return self.clocks.lag_rounds(fragment, base_version)

    # ----- what membership changes do to rounds (MembershipEvents) -----------------------------

    def withdrawn(self, island: str, now: float, *, forgotten: bool) -> None:
        """Take an island's pending contributions out of every open round: an admin drop (the
        round's start is forgotten once it is empty) or a forgotten record (its answers too)."""
        for rnd in self.rounds:
            rnd.pending.pop(island, None)
            if not forgotten and not rnd.pending:
                rnd.first_push_at = None
        self.uploads.forget(island)
        if forgotten:
            self.answers.forget(island)
            for key in [k for k in self._merged_by if k[0] == island]:
                del self._merged_by[key]

    def membership_changed(self, now: float) -> None:
        """Re-evaluate every round's quorum after any change."""
        self._refresh(now)

    def discard(self, fragment: int, names: list[str], now: float) -> None:
        """Take these islands' contributions out of fragment's open round (a merge cannot take
        them; merge.py)."""
        rnd = self.rounds[fragment]
        for name in names:
            rnd.pending.pop(name, None)
        if not rnd.pending:
            rnd.first_push_at = None
        self._refresh(now)

    # ----- pushes ------------------------------------------------------------------------------

    def _check_fragment(self, fragment: int) -> FragmentRound:
        if not 0 <= fragment < len(self.rounds):
            raise Refused(404, f"fragment {fragment} does not exist (0..{len(self.rounds) - 1})")
        return self.rounds[fragment]

    def previous_answer(self, fragment: int, name: str, push_id: str) -> PushAnswer | None:
        """The answer given to an earlier push with this id (a client retry), if any."""
        return self.answers.get(name, fragment, push_id)

    def check_push(self, fragment: int, name: str, base_version: int) -> int:
        """Whether a push would be accepted, without changing anything; returns its lag.

        Raises Refused: 404 unknown fragment or island, 403 dropped island, 409 stale or future
        base version.
        """
        rnd = self._check_fragment(fragment)
        rec = self.membership.island(name)
        if rec.state == DROPPED:
            why = f" ({rec.reason})" if rec.reason else ""
            raise Refused(403, f"island {name!r} is dropped{why}", "dropped")
        lag = rnd.version - base_version
        if lag < 0:
            raise Refused(
                409,
                f"baseVersion {base_version} is newer than fragment {fragment}'s version "
                f"{rnd.version} (the syncer restarted from an older checkpoint?); pull the "
                "fragment and push again",
                protocol.ERROR_AHEAD,
            )
        if lag > self.policy.max_staleness:
            raise Refused(
                409,
                f"baseVersion {base_version} lags fragment {fragment}'s version {rnd.version} by "
                f"{lag}, more than sync.maxStaleness={self.policy.max_staleness}; pull the "
                "fragment and push again",
                protocol.ERROR_STALE,
            )
        return lag

    def accept_push(
        self,
        fragment: int,
        contribution: Contribution,
        now: float,
        *,
        inner_steps: int | None = None,
    ) -> PushAnswer:
        """Record a checked contribution (replacing the island's pending one); returns the answer
        (with the island's round H_i, `inner_steps`, when given). The caller ran check_push under
        the same lock, so this cannot fail."""
        rnd = self.rounds[fragment]
        rec = self.membership.islands[contribution.island]
        replaced = rnd.pending.get(contribution.island)
        rnd.pending[contribution.island] = contribution
        if rnd.first_push_at is None:
            rnd.first_push_at = now
        self.membership.revive(rec, now)
        rec.last_push = now
        rec.pushes += 1
        # The island has processed at least its merged and pending work on this fragment (a
        # push replacing a pending one carries the older one's work too, so this never counts
        # twice); heartbeats report the exact total and may raise it further.
        pushed = self._merged_by.get((contribution.island, fragment), 0) + contribution.tokens
        rec.tokens = max(rec.tokens, pushed)
        if contribution.loss is not None:
            rec.loss = contribution.loss
        if contribution.step_time:
            rec.step_time = contribution.step_time
        if contribution.sync_time:
            rec.sync_time = contribution.sync_time
            held = self._held.pop((contribution.island, fragment), None)
            if held is not None:  # the sync it reports is that of its push we last merged
                rec.transfer_time = window_rules.net_sync_time(contribution.sync_time, held)
        self._refresh(now)
        answer = PushAnswer(
            accepted=True,
            version=rnd.version,
            pending=len(rnd.pending),
            replaced=replaced is not None,
            inner_steps=inner_steps,
        )
        self.answers.put(contribution.island, fragment, contribution.push_id, answer)
        return answer

    def upload_started(self, fragment: int, island: str, now: float) -> bool:
        """An island's push body for `fragment` began to arrive (the edge: its credential is that
        island's, its declared size within the limit); recorded only for an existing fragment
        and an island the rounds span. True when recorded (then upload_ended must follow)."""
        if not 0 <= fragment < len(self.rounds) or island not in self.spanning():
            return False
        self.uploads.started(fragment, island, now)
        return True

    def upload_ended(
        self, fragment: int, island: str, started: float, *, seconds: float | None
    ) -> None:
        """The request upload_started recorded at `started` ended (`seconds`: its body's
        upload time when the push was accepted, else None)."""
        self.uploads.ended(fragment, island, started, seconds)

    def _uploads_holding(self, fragment: int, missing: set[str], now: float) -> list[float]:
        """When the waits for the bodies of `fragment` on their way from `missing` end."""
        if not missing:
            return []
        return self.uploads.holding(
            fragment, missing, now, grace=self.grace(fragment), cap=self.policy.heartbeat_timeout
        )

    # ----- merging -----------------------------------------------------------------------------

    def _refresh(self, now: float) -> None:
        """Re-evaluate every round's quorum after any change."""
        need = self.effective_quorum()
        for rnd in self.rounds:
            if len(rnd.pending) >= need:
                if rnd.quorum_since is None:
                    rnd.quorum_since = now
            else:
                rnd.quorum_since = None

    def merge_due(self, fragment: int, now: float) -> bool:
        """Whether fragment's round should merge now: quorum reached, and the grace window
        passed, or every active island contributed, or none of the missing ones is expected to
        push before the window closes. Islands not joined yet are waited for (the window only):
        a late starter otherwise trains on fragments a merge apart (an early loss spike at K<M)."""
        rnd = self.rounds[fragment]
        # Drained islands (their share of the budget done and merged) push nothing more: the
        # round waits for the others only, and the job's last work merges without a quorum. An
        # island that never joined is not waited for either: at K < M the budget was split
        # among the active islands (targets.py), so it has no part of it to push (at K = M no
        # round merges before every island joined). Issue 46: K = 2 of 3 with the third never
        # up held the last island's push until a drained island's wait ended (30 s), and the
        # islands trained on past the budget.
        # Nor is an island the budget was not split to (untargeted: no pace, or rejoined since):
        # it has no target to drain at, and a drained island's last push waited for its push
        # for ever when it never sent one to that fragment (issue 46, adv15).
        drained = self.drained()
        missing = self.spanning() - rnd.pending.keys() - drained - self.untargeted()
        if drained and rnd.pending and not missing:
            return True
        awaited = self.membership.awaited()
        crossed = self.crossed_round(now)
        if crossed is not None and crossed[0] == fragment and now >= crossed[1]:
            return True  # rounds waiting for each other's islands (crossed.py)
        if rnd.quorum_since is None:
            return False
        if self._uploads_holding(fragment, missing, now):
            return False  # a missing island's push is on its way (uploads.py)
        if not missing and not awaited:
            return True
        closes = rnd.quorum_since + self.grace(fragment)
        if now >= closes or awaited:
            return now >= closes
        islands = self.membership.islands
        expected = [self.expected_push(islands[n], fragment, now) for n in missing]
        return all(t is not None and t > closes for t in expected)

    def crossed_round(self, now: float) -> tuple[int, float] | None:
        """The crossed round merged without the islands it lacks (crossed.py: rounds that
        each wait for islands whose pushes wait in the others) and when: once they have stayed
        crossed for the grace window plus a round of the slowest island it lacks
        (crossed_wait). With blocking learners only at K = M, every island joined; with
        learners that do not block, rounds short of the quorum whose lacking islands are all
        held at the step cap or draining (IslandRecord.holding). None when no round is crossed."""
        members = self.membership
        spanned = self.spanning() - self.drained() - self.untargeted()
        pending = [set(r.pending) for r in self.rounds]
        if not self.policy.learners_block:
            held = {n for n in spanned if members.islands[n].holding}
            crossed = crossed_rounds(pending, spanned, quorum=self.effective_quorum(), held=held)
        elif members.awaited() or self.policy.quorum < len(self.spanning()):
            crossed = frozenset()
        else:
            crossed = crossed_rounds(pending, spanned)
        f = round_to_close(crossed, pending)
        if f is None:
            self._crossed = None
            return None
        key = (f, tuple((g, frozenset(pending[g])) for g in sorted(crossed)), frozenset(spanned))
        since = now if self._crossed is None or self._crossed[0] != key else self._crossed[1]
        steps = {n: members.islands[n].step_time for n in spanned}
        rounds = {n: self._round_steps(members.islands[n]) for n in spanned}
        due = since + crossed_wait(self.grace(), steps, spanned - pending[f], rounds)
        self._crossed = (key, since, due)
        return f, due

    def drained(self) -> set[str]:
        """Active islands whose learners said they drained (learner/drain.py)."""
        islands = self.membership.islands
        return {n for n in self.membership.active() if islands[n].drained}

    def untargeted(self) -> set[str]:
        """The active islands the budget was not split to, once it is (split_to: left out of
        the split for want of a pace, targets.split_among, or rejoined since): none before."""
        if self.split_to is None:
            return set()
        return self.membership.active() - self.split_to

    def all_drained(self) -> bool:
        """Every active island has drained and no push is pending: all the work the islands
        will do is merged (the service then checks it against stopAfter); never with no active
        island (nobody has done anything). Islands that never joined do not hold it: the
        service's check against the budget (targets.drained_at_budget) already fails where
        their part is missing (K = M, shares of 1/M), and at K < M the budget was split among
        the active islands, so nothing of it is left to them (issue 46). Nor do the active
        islands the budget was not split to (untargeted: no pace, or rejoined since), nor their
        pending pushes: no part of the split is theirs to drain, and one that never reported
        its pace would otherwise hold the finish for ever (issue 46, adv15)."""
        exempt = self.untargeted()
        active = self.membership.active()
        if not active or not active - exempt or not active - exempt <= self.drained():
            return False
        return not any(n not in exempt for r in self.rounds for n in r.pending)

    def expected_push(self, rec: IslandRecord, fragment: int, now: float) -> float | None:
        """When `rec` should push fragment (clock time, never before `now`): its latest progress
        report plus the steps to the fragment's next sync point at its reported step time; None
        when there is nothing to go on.

        Waiting for an island that cannot arrive in time only idles the others (a 3x straggler
        costs every fast island one grace window per round), so merge_due skips the wait then.
        A wrong guess is cheap: the island's work is merged in its next round, nothing is lost.
        An island that is overdue (its push is late, or it is stuck) counts as arriving now.
        """
        if rec.reported_step is None or rec.reported_at is None or not rec.step_time:
            return None
        steps = self._round_steps(rec)
        offsets = self.policy.offsets
        if steps != self.policy.inner_steps and offsets:
            # its learner's schedule in its own round (learner/fragment_sync._adopt_round)
            offsets = tuple(fragment_offsets(steps, len(offsets)))
        return window_rules.expected_push_time(
            inner_steps=steps,
            offsets=offsets,
            fragment=fragment,
            reported_step=rec.reported_step,
            reported_at=rec.reported_at,
            step_time=rec.step_time,
            pushed_since_report=rec.last_push is not None and rec.last_push >= rec.reported_at,
            now=now,
        )

    def _round_steps(self, rec: IslandRecord) -> int:
        """The island's H_i as the syncer named it last (round_sizes.py), else the job's H.
        Without a schedule (policy.inner_steps 0: prediction off) 0. Right after a change its
        learner may still run the previous H_i to its round boundary: a wrong guess there only
        moves its work to the next round (expected_push)."""
        if self.policy.inner_steps < 1 or rec.round is None:
            return self.policy.inner_steps
        return rec.round.steps

    def due_fragments(self, now: float) -> list[int]:
        """Fragments whose rounds should merge now."""
        return [f for f in range(len(self.rounds)) if self.merge_due(f, now)]

    def next_deadline(self, now: float | None = None) -> float | None:
        """The earliest moment a grace window ends (for the server's timer), if any is open; with
        `now`, a round held by a push on its way (merge_due) counts from when that wait ends, if
        later, so the timer does not spin through it."""
        ends = []
        for f, rnd in enumerate(self.rounds):
            if rnd.quorum_since is None:
                continue
            end = rnd.quorum_since + self.grace(f)
            if now is not None:
                missing = self.spanning() - rnd.pending.keys()
                holding = self._uploads_holding(f, missing, now)
                if holding:
                    end = max(end, holding[0])
            ends.append(end)
        if self._crossed is not None:  # as merge_due last saw it (the scheduler's tick)
            ends.append(self._crossed[2])
        return min(ends) if ends else None

    def peek_round(self, fragment: int) -> list[Contribution]:
        """Fragment's pending contributions, sorted by island so a merge is reproducible."""
        rnd = self.rounds[fragment]
        return [rnd.pending[k] for k in sorted(rnd.pending)]

    def fold_order(self, fragment: int) -> list[str] | None:
        """The order in which fragment's round folds its pushes (merging/folding.py): by
        island, as peek_round lists them, when the round will hold every island it spans (the
        quorum is all of them: K = M) in a job whose learners apply merges at fixed steps
        (RoundPolicy.ordered_folds), so the merge's bits do not depend on when each push came;
        None (arrival order) when a merge may hold any K of them, or when the learners'
        timing makes the job unrepeatable anyway."""
        if not self.policy.ordered_folds:
            return None
        spans = self.spanning() | set(self.rounds[fragment].pending)
        if self.effective_quorum() < len(spans):
            return None
        return sorted(spans)

    def take_round(
        self,
        fragment: int,
        now: float,
        *,
        rounds: int | None = None,
        clock: float | None = None,
        merge_seconds: float = 0.0,
        merged: list[Contribution] | None = None,
    ) -> list[Contribution]:
        """Close fragment's round: returns its contributions (as peek_round, or `merged`: what
        the merge took, of which an island dropped while it ran has left the round already),
        credits each island's merged tokens, bumps the version and opens the next round.

        `rounds` and `clock` are the fragment's completed rounds of work and work clock after
        this merge (the outer optimizer's; default: the merge was one whole round). The merge
        started at `now` and took `merge_seconds`: how long the syncer held each push.
        """
        rnd = self.rounds[fragment]
        contributions = self.peek_round(fragment) if merged is None else merged
        taken = {id(c) for c in contributions}
        if any(id(c) not in taken for c in rnd.pending.values()):
            raise ValueError(f"fragment {fragment}'s round gained a push its merge did not take")
        self.uploads.merged(fragment)
        if rnd.first_push_at is not None and rnd.quorum_since is not None:
            self._quorum_waits.append(max(0.0, rnd.quorum_since - rnd.first_push_at))
        self._merge_seconds.append(max(0.0, merge_seconds))
        for c in contributions:
            self._held[(c.island, fragment)] = max(0.0, now + merge_seconds - c.received_at)
            key = (c.island, fragment)
            self._merged_by[key] = self._merged_by.get(key, 0) + c.tokens
            rec = self.membership.islands.get(c.island)
            if rec is not None:
                # Each fragment's merges count the island's tokens once, so F fragments see
                # them F times: the average over fragments is the island's merged work. A push
                # credited one round (syncer.guards.pairCredit) merges that round's tokens; the
                # rest its learner counted and will not train again, as a refused push's
                # (refused_tokens: out of its part of the budget, so a target gives them back).
                credited = credited_tokens(c.tokens, c.steps, c.budget_steps)
                share = credited / len(self.rounds)
                rec.merged_tokens += share
                rec.refused_tokens += (c.tokens - credited) / len(self.rounds)
                # A push made again over a merged one merges that one's steps twice, which its
                # learner counted once: they go into its count's base (records.carried_again).
                again = carried_again(rec.merged_pushes.get(fragment), c.base_version)
                rec.count_base += min(again, share)
                rec.merged_pushes[fragment] = MergedPush(c.base_version, share)
        done = rnd.rounds + 1 if rounds is None else rounds
        self.rounds[fragment] = FragmentRound(version=rnd.version + 1, rounds=done)
        self.clocks.record(fragment, rnd.version + 1, float(done) if clock is None else clock)
        return contributions

    # ----- snapshots and persistence -----------------------------------------------------------

    def snapshot(self) -> RoundsSnapshot:
        """The figures the status document shows, as they are now."""
        return RoundsSnapshot(
            outer_step=self.outer_step,
            versions=self.versions,
            quorum=self.effective_quorum(),
            quorum_target=self.policy.quorum,
            awaited_islands=self.membership.awaited(),
            grace=self.grace(),
            pending=[len(r.pending) for r in self.rounds],
            active_islands=len(self.membership.active()),
            islands=self.membership.statuses(),
        )

    def saved(self) -> SavedRounds:
        """What a checkpoint keeps of the rounds (lock held)."""
        return SavedRounds(
            versions=self.versions,
            outer_step=self.outer_step,
            work_clocks=self.clocks.to_json(),
            islands=self.membership.statuses(),
            push_answers=self.saved_answers(),
            counts=self.membership.counts(),
        )

    def saved_answers(self) -> list[SavedAnswer]:
        """Answers to pushes that have been merged, for checkpoints (replay.PushAnswers)."""
        return self.answers.merged(self.versions)

    def restore_answers(self, doc: list[SavedAnswer]) -> None:
        """Load answers saved by saved_answers(), so a push merged before a restart and retried
        after it is answered as a duplicate instead of counted twice."""
        self.answers.restore(doc, len(self.rounds))
