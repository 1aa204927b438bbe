"""Each island's round at the syncer (inner.stepsPerIsland, core/island_rounds.py): readings of
the islands' step times, taken from their heartbeats once per reference round, and the H_i each
island is told in its join, heartbeat and push answers (innerSteps), adopted by its learner at its
next round boundary (learner/fragment_sync.py).

Plain state with the caller's clock, under the service's lock. An island's H_i reads only its
own step time and the job's reference (the lower median of every active island's: a minority of
liars moves it only between honest claims, core/island_rounds.py), and the push bounds that
follow from it (STEP_ROUNDS x H_i + τ) are the island's alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.island_rounds import (
    CHECK_STEPS,
    COOLDOWN_READINGS,
    LOCK_STEP_ROOM,
    MAJORITY_CLAIMS,
    PROBE_STEPS,
    IslandRound,
    RoundLimits,
    aged_past_join,
    check_restores,
    check_round,
    clear_of_join_load,
    eager_down,
    judged_ratio,
    late_is_beyond,
    next_round,
    probe_readings,
    reference_step_time,
    remembered,
    restores_cut,
    sized_steps,
    split_budget,
    target_steps,
)
from diloco_trainer.core.push_bounds import STEP_ROUNDS
from diloco_trainer.syncer.state.records import IslandRecord

_INDEX = re.compile(r"(?:^|-)island-(\d+)$")


def island_index(name: str) -> int | None:
    """The index in an island's name ('eu-island-3' -> 3; islands.overrides name islands by
    it), None for another name."""
    match = _INDEX.search(name)
    return int(match.group(1)) if match else None


def checked_round(
    current: IslandRound, target: int, *, sized: int, late: bool, ratio: float, eager: bool
) -> IslandRound:
    """The round after the check of a probe's cut: CHECK_STEPS steps clear of the start-up, read
    at once (core/island_rounds.check_restores). A check that restores goes back as two readings
    with no cooldown (the cut it undoes rested on start-up steps; at K < M a second probe's cut
    starts one), to the round that was cut when it reads within its band (check_round), and
    keeps its ratio as the anchor; any other check is a regular reading."""
    if not check_restores(current, target, ratio=ratio):
        return next_round(current, target, sized=sized, late=late, ratio=ratio, eager=eager)
    # next_round takes the move up as check_restores did: within the band of the round cut
    # (restores_cut) whatever the probe read, else outgrown of it.
    return next_round(
        replace(current, since_change=COOLDOWN_READINGS),
        check_round(current, target),
        confirmed=True,
        sized=sized,
        late=late,
        ratio=ratio,
        eager=eager,
    )


class RoundSizes:
    """The job's round limits and each island's H_i (kept on its IslandRecord)."""

    def __init__(self, spec: JobSpec) -> None:
        self.limits = RoundLimits.from_spec(spec)
        self.overlap = spec.sync.overlap_steps or 0
        # K = M: every merge waits for the last push, so a change leaves a slow island's round
        # room to end early (core/island_rounds.sized_steps)
        self.islands = max(spec.islands.count, spec.total_shards())
        self.room = LOCK_STEP_ROOM if spec.sync.quorum >= self.islands else 0.0
        # Whether any island's round differs or differed from H (core/island_rounds.
        # split_budget): at K = M the token budget is then split by stop targets, not shares.
        self.split = self.limits.pins_differ
        # The rule behind the latest reading and what it read (the syncer's log names them when
        # a round changes: which rule cut, against which peers' step times).
        self.last_rule = ""
        self.last_reference: float | None = None

    def steps_of(self, rec: IslandRecord | None, name: str) -> int:
        """The island's H_i now."""
        return self.limits.steps_of(island_index(name), rec.round if rec is not None else None)

    def joined(
        self, rec: IslandRecord, active: Iterable[IslandRecord] = (), now: float | None = None
    ) -> None:
        """A join: the island's round is what it had (a rejoin keeps it), else the spec's. With
        the `active` islands and the time (the service's join), its first reports are judged
        only against peers' step times aged past this join (_aged)."""
        if rec.round is None:
            rec.round = IslandRound(self.steps_of(rec, rec.name))
        rec.round = replace(rec.round, recent=())  # a restarted learner's pace is its own again
        self._seen(rec)
        rec.round_read_at = None  # a restarted learner's first steps are warm-up again
        rec.joined_at = now
        rec.peer_marks = None
        if now is not None:
            rec.peer_marks = {
                r.name: (r.reported_step or 0) if r.step_time else None
                for r in active
                if r.name != rec.name
            }

    def max_push_steps(self, rec: IslandRecord | None, name: str) -> int:
        """The most steps one push of the island may carry: STEP_ROUNDS x its H_i (or the one
        before its last change, which its learner may still run until its round boundary) +
        sync.overlapSteps."""
        steps = self.steps_of(rec, name)
        if rec is not None and rec.round_before is not None:
            steps = max(steps, rec.round_before)
        return STEP_ROUNDS * steps + self.overlap

    def round_push_steps(self, rec: IslandRecord | None, name: str) -> int:
        """The steps one round's push of the island carries: its H_i (or the one before its
        last change) + sync.overlapSteps (guards.pair_clip counts no more of a push's claim)."""
        return (self.max_push_steps(rec, name) - self.overlap) // STEP_ROUNDS + self.overlap

    def read(self, rec: IslandRecord, active: Iterable[IslandRecord], now: float) -> None:
        """After a heartbeat: one reading of the island's step time once a reference round
        (H x t_ref seconds) has passed since its last reading; H_i moves by next_round, on two
        readings in a row beyond the band. A fresh island's first report (its learner's probe:
        the mean of two steps clear of warm-up, capped) is read at once (probe_readings): as
        those two readings when every active island has reported, at least three of them, and
        it at least halves the round; else, with at least three reporting, as one; else (a job
        of two, a rejoin) it starts the island's clock. A fresh island's first reports (and its
        second probe) count only peers' step times aged past its join (_aged), and wait unread
        while a peer's is not, a reference round after the join at most."""
        if self.limits.fixed_steps(island_index(rec.name)) is not None or not rec.step_time:
            return
        current = rec.round or IslandRound(self.limits.inner_steps)
        members = list(active)
        second = current.confirm_at is not None and (rec.reported_step or 0) >= current.confirm_at
        check = current.check_at is not None and (rec.reported_step or 0) >= current.check_at
        reference = reference_step_time([r.step_time for r in members if r.step_time])
        if reference is None:
            return
        reported = sum(1 for r in members if r.step_time)
        if (current.fresh and rec.round_read_at is None) or second:
            aged = self._aged(rec, members, now, reference)
            if aged is not None:
                reference, reported = aged
            elif not clear_of_join_load(ratio=rec.step_time / reference, room=self.room):
                # not read: a peer's step time is not yet aged past the island's join
                self.last_rule = "probe held: a peer not aged past its join"
                self.last_reference = reference
                return
            # else read against every claim: a clear slowdown at K = M
        self.last_reference = reference
        ratio = rec.step_time / reference
        target, sized = self._sizes(rec.step_time, reference)
        late = late_is_beyond(room=self.room, steps=current.steps, ceiling=self.limits.ceiling)
        eager = eager_down(room=self.room)
        recent = current.recent  # a probe's or a check's reading is read alone
        if rec.round_read_at is None:
            first = self._first_report(
                rec,
                current,
                target,
                sized=sized,
                late=late,
                reported=reported,
                now=now,
                active=len(members),
                ratio=ratio,
            )
            if first is None:
                return
            after = first
        elif second:
            self.last_rule = "second probe"
            after = next_round(current, target, sized=sized, late=late, ratio=ratio, eager=eager)
            if after.steps < current.steps and current.confirm_at is not None:
                # a cut on the probe and second probe, four start-up steps: checked too
                after = replace(
                    after, check_at=current.confirm_at + CHECK_STEPS, cut_from=current.steps
                )
        elif check:
            self.last_rule = "check of a probe's cut"
            after = checked_round(current, target, sized=sized, late=late, ratio=ratio, eager=eager)
        elif now - rec.round_read_at < self.limits.inner_steps * reference:
            return
        else:
            recent, after = self._regular(
                current, target, sized=sized, late=late, ratio=ratio, eager=eager, ref=reference
            )
        rec.round_read_at = now
        after = replace(after, recent=recent)
        if current.cut_from is not None and after.steps == current.steps:
            # the round a probe cut stands: its check still awaited (unless this was it), and a
            # later reading within the band of the round cut sends it back (restores_cut)
            after = replace(
                after, check_at=None if check else current.check_at, cut_from=current.cut_from
            )
        if after.steps != current.steps:
            rec.round_before = current.steps
        rec.round = after
        self._seen(rec)

    def _regular(
        self,
        current: IslandRound,
        target: int,
        *,
        sized: int,
        late: bool,
        ratio: float,
        eager: bool,
        ref: float,
    ) -> tuple[tuple[float, ...], IslandRound]:
        """A regular reading (not a probe's, nor its check): the island's last readings with it
        (remembered) and the round it sets, judged with them (judged_ratio)."""
        recent = remembered(current.recent, ratio)
        judged = (
            # a reading that sends a probe's cut back (restores_cut) is read alone, as
            # before: the cut rested on start-up steps
            ratio
            if restores_cut(current, target)
            else judged_ratio(recent, room=self.room, longer=target > current.steps)
        )
        self.last_rule = "regular reading"
        if judged != ratio:
            self.last_rule += f" judged at {judged:.3f}x, its last {len(recent)}"
            target, sized = self._judged_sizes(current.steps, judged * ref, ref)
        after = next_round(current, target, sized=sized, late=late, ratio=judged, eager=eager)
        return recent, after

    def _sizes(self, own: float, reference: float) -> tuple[int, int]:
        """A reading's target round (target_steps) and the round a regular change sets
        (sized_steps: K = M's room)."""
        lim = self.limits
        steps, floor, ceiling = lim.inner_steps, lim.floor, lim.ceiling
        return (
            target_steps(
                inner_steps=steps, reference=reference, own=own, floor=floor, ceiling=ceiling
            ),
            sized_steps(
                inner_steps=steps,
                reference=reference,
                own=own,
                floor=floor,
                ceiling=ceiling,
                room=self.room,
            ),
        )

    def _judged_sizes(self, steps: int, own: float, reference: float) -> tuple[int, int]:
        """_sizes at a regular reading's judged step time `own` (core/island_rounds.
        judged_ratio). At K = M only a reading for a longer round is judged at its recent
        slowest, and that never makes it one for a shorter round: a target at or below the
        round `steps` leaves the round as it is (the current reading did not say late)."""
        target, sized = self._sizes(own, reference)
        if self.room > 0 and target <= steps:
            return steps, steps
        return target, sized

    def _aged(
        self, rec: IslandRecord, members: list[IslandRecord], now: float, reference: float
    ) -> tuple[float, int] | None:
        """The reference and the count of claims a fresh island's first reports are judged
        against: its own step time and its peers' aged past its join (core/island_rounds.
        aged_past_join), or None, not read yet, while a peer with a step time is not, until a
        reference round (H x t_ref) after the join; then the aged ones alone.

        Why (issue 47): on a shared host a late island's first steps run beside the early
        islands and the later ones' start-ups, and against the early islands' probes they read
        ~2x: identical islands were cut (tests/e2e/test_identical_rounds.py). Judged against
        peers' readings taken while it ran, they read as fast. Joined without its peers (a
        syncer's unit tests), every peer counts, as before."""
        if rec.peer_marks is None or rec.joined_at is None or not rec.step_time:
            return reference, sum(1 for r in members if r.step_time)
        claims = [rec.step_time]
        waiting = False
        for peer in members:
            if peer.name == rec.name or not peer.step_time:
                continue
            idle = (
                peer.reported_at is not None
                and peer.reported_since is not None
                and peer.reported_at > max(peer.reported_since, rec.joined_at)
            )
            if aged_past_join(
                mark=rec.peer_marks.get(peer.name), step=peer.reported_step, idle=idle
            ):
                claims.append(peer.step_time)
            else:
                waiting = True
        if waiting and now - rec.joined_at < self.limits.inner_steps * reference:
            return None
        aged = reference_step_time(claims)
        return None if aged is None else (aged, len(claims))

    def _first_report(
        self,
        rec: IslandRecord,
        current: IslandRound,
        target: int,
        *,
        sized: int,
        late: bool,
        reported: int,
        active: int,
        now: float,
        ratio: float,
    ) -> IslandRound | None:
        """The island's round after its first report since it (re)joined (read's first
        branch), or None: not read (its clock started, or its second probe awaited)."""
        step = rec.reported_step if rec.reported_step is not None else rec.step
        if current.fresh and current.confirm_at is not None and step < current.confirm_at:
            return None  # its probe came before its peers': its second probe is read instead
        rec.round_read_at = now
        readings = probe_readings(
            current.steps, target, fresh=current.fresh, reported=reported, active=active
        )
        if readings == 0:
            if (
                current.fresh
                and self.islands >= MAJORITY_CLAIMS
                and step + PROBE_STEPS < self.limits.inner_steps
            ):
                # a job of three or more whose other islands have not reported yet (they
                # joined later: a process start on a loaded machine): its next report
                # PROBE_STEPS steps on (its learner's second probe) is read as its first,
                # within its first round (bench/log/2026-11-29.md, "hetero — 2026-11-29
                # 11:43 UTC": a 3x island that joined first ran two rounds at H)
                rec.round_read_at = None
                rec.round = replace(current, confirm_at=step + PROBE_STEPS)
            elif current.confirm_at is not None:
                # its clock starts: its next reading a reference round on, not the next report
                # as a second probe
                rec.round = replace(current, confirm_at=None)
            # else a rejoin's first steps are warm-up again (its learner's report may include
            # them), and in a job of two the reference is the other island's own probe: its
            # first report starts its clock, and it is read a reference round later (still
            # fresh)
            return None
        # a probe that at least halves the round with every island reporting is two readings;
        # else one, which its learner's second probe confirms or clears
        self.last_rule = f"probe as {readings} reading{'s' if readings > 1 else ''}"
        after = next_round(
            current,
            target,
            confirmed=readings == 2,
            sized=sized,
            late=late,
            ratio=ratio,
            eager=eager_down(room=self.room),
        )
        if readings == 2 and after.steps < current.steps:
            # a cut on two start-up steps: its learner's check, CHECK_STEPS steps past its
            # second probe, is read at once and may send it back (check_restores)
            after = replace(
                after, check_at=step + PROBE_STEPS + CHECK_STEPS, cut_from=current.steps
            )
        if readings == 1 and after.pending:
            # its second probe, PROBE_STEPS steps on, is read at once: a reference round of
            # wall time is a heartbeat or two, and under load a slow island's first round ended
            # before it (bench/log/2026-11-29.md, "hetero — 2026-11-29 11:20 UTC": its second
            # round at H too)
            after = replace(after, confirm_at=step + PROBE_STEPS)
        return after

    def _seen(self, rec: IslandRecord) -> None:
        self.split = split_budget(
            inner_steps=self.limits.inner_steps,
            rounds=[self.steps_of(rec, rec.name)],
            split=self.split,
        )
