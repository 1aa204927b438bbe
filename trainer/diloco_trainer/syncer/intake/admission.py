"""Which islands may exist at the syncer: the job's own island names, as many as the job has.

Island names are api/contract.island_name(prefix, i): 'island-3', or 'eu-island-3' with
islands.namePrefix 'eu'. A syncer accepts a join of

- its own prefix with i < islands.count;
- in a multi-region job (islands.totalShards, or shardOffset + count, larger than count), any
  other cluster's prefix with i < totalShards;

and keeps at most that many island records (max(count, total shards)), counted per side: at most
`count` of its own prefix and at most R = total - count of other clusters' (cap_for), so other
regions cannot fill the records and lock out a local island. When a side's records are all taken
(room_for):

- own side: a new island takes the place of one of its own side that timed out or left, never of
  an active or dropped one (evictable);
- other regions' side, shared by every other region's credential: the spec does not say how many
  of the R records each region has, so they are split fairly among the regions that hold them
  (max-min: filled as they come, nobody's taken while someone needs it less). A new island of
  region p takes, in order, (1) a record that is gone: timed out, left, or dropped by the admin
  route (not one the syncer dropped for refused pushes), p's own first, then one of the region
  holding the most, the longest silent first; else (2) a record of a region q that holds at
  least two more than p does (held(q) >= held(p) + 2: q holds more than an equal split would
  leave it), the one silent the longest of the region holding the most; else it is refused
  (503). So one region's credential can hold all R only while no other region asks, and gives
  back down to an equal split when one does; a region of n_p islands keeps
  min(n_p, its equal share) however another region pushes, joins or leaves.

  With islands.regions set (each other region's island count), the split is the spec's, not
  max-min: region p keeps at most quota(p) records (a region not listed none: it is not
  admitted, 503). A new island of p below its quota takes a free record, else (records left
  over from an older spec) one of a region above its quota, a gone one first; at its quota it
  takes only one of its own gone records (timed out, left, dropped by the admin route). So no
  region's credential can take a record of another region's quota, and a region's push slots
  (2 per record) follow its quota.
The replicas an island's work counts for (replicas_for: islands.replicas, or
syncer.guards.remoteIslandReplicas for another cluster's island) bound the tokens of its pushes
(guards.py), whatever it declared when it joined.

A name that is not of the form '[prefix-]island-N' is refused (403). One of that form that is not
admitted now is answered 503 with Retry-After instead: `islands` is the one spec section that
changes under a running syncer (scaling does not restart it), so the service re-reads it from its
mounted config and the learner retries until the syncer knows the new island.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from diloco_trainer.api import protocol
from diloco_trainer.api.documents import IslandStatus
from diloco_trainer.api.spec import IslandsSpec, JobSpec
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.state import DROPPED, LEFT, TIMED_OUT, IslandRecord

NAME = re.compile(
    r"^(?:(?P<prefix>[a-z0-9](?:[-a-z0-9]{0,18}[a-z0-9])?)-)?island-(?P<index>0|[1-9]\d{0,5})$"
)
# Seconds a client is asked to wait before it retries a join the syncer does not admit yet.
RETRY_AFTER = 10.0


@dataclass(frozen=True)
class Room:
    """Admission.room_for's answer."""

    full: bool  # the new island's side holds as many records as the job has there
    replaces: str | None  # when full: the record it takes the place of (None: refused)


def region(name: str) -> str | None:
    """The prefix of an island name ('' for 'island-N'); None for anything else."""
    match = NAME.match(name)
    return None if match is None else match.group("prefix") or ""


@dataclass(frozen=True)
class Admission:
    """The island names and replicas one job admits."""

    prefix: str  # this cluster's islands.namePrefix
    count: int  # islands.count: own names island-0 .. island-(count-1)
    total: int  # islands of the whole job (all clusters)
    replicas: int  # islands.replicas, or more for an island with an override
    remote_replicas: int  # replicas of another cluster's island
    # islands.regions: (prefix, island count) of each other region; empty: the max-min split
    quotas: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_spec(cls, spec: JobSpec) -> Admission:
        return cls.from_islands(spec.islands, spec.syncer.guards.remote_island_replicas)

    @classmethod
    def from_islands(cls, islands: IslandsSpec, remote_replicas: int | None = None) -> Admission:
        total = islands.total_shards or (islands.shard_offset + islands.count)
        return cls(
            prefix=islands.name_prefix,
            count=islands.count,
            total=max(total, islands.count),
            replicas=islands.max_replicas(),
            remote_replicas=remote_replicas or islands.replicas,
            quotas=tuple((r.name_prefix, r.count) for r in islands.regions),
        )

    def quota(self, prefix: str) -> int | None:
        """The records region `prefix` (another cluster's) may hold by islands.regions (0 when
        not listed); None without islands.regions (the max-min split)."""
        if not self.quotas:
            return None
        return dict(self.quotas).get(prefix, 0)

    @property
    def multi_region(self) -> bool:
        """Whether other clusters' islands belong to the job too."""
        return self.total > self.count

    @property
    def cap(self) -> int:
        """The most island records the syncer keeps."""
        return self.total

    def is_own(self, name: str) -> bool:
        """Whether `name` is of this cluster's prefix."""
        match = NAME.match(name)
        return match is not None and (match.group("prefix") or "") == self.prefix

    def cap_for(self, name: str) -> int:
        """The most records of `name`'s side: this cluster's islands.count for its own names,
        the rest of the job's total for other clusters' (their islands are counted against
        their count, not against the job's total, which holds the local islands too)."""
        return self.count if self.is_own(name) else self.total - self.count

    def same_side(self, records: Mapping[str, IslandRecord], name: str) -> dict[str, IslandRecord]:
        """The records of `name`'s side (own, or other clusters')."""
        own = self.is_own(name)
        return {n: r for n, r in records.items() if self.is_own(n) == own}

    def held_by(self, records: Mapping[str, IslandRecord], prefix: str) -> int:
        """The island records region `prefix` holds (any state)."""
        return sum(1 for n in records if region(n) == prefix)

    def room_for(self, records: Mapping[str, IslandRecord], name: str) -> Room:
        """Whether `name` (not yet known) finds its side full, and the record it takes the
        place of then (None: no room; see the module's docstring)."""
        side = self.same_side(records, name)
        if name in records:
            return Room(full=False, replaces=None)
        quota = None if self.is_own(name) else self.quota(region(name) or "")
        if quota is not None:
            return self._quota_room(side, region(name) or "", quota)
        if len(side) < self.cap_for(name):
            return Room(full=False, replaces=None)
        if self.is_own(name):
            return Room(full=True, replaces=evictable(side))
        return Room(full=True, replaces=_remote_room(side, region(name) or ""))

    def _quota_room(self, side: Mapping[str, IslandRecord], prefix: str, quota: int) -> Room:
        """room_for with islands.regions: `prefix` below its quota takes a free record, else one
        of a region above its quota; at its quota, only one of its own gone records."""
        held = Counter(region(n) or "" for n in side)
        if held[prefix] >= quota:
            mine = [r for r in side.values() if region(r.name) == prefix and gone_remote(r)]
            return Room(full=True, replaces=_longest_silent(mine))
        if len(side) < self.total - self.count:
            return Room(full=False, replaces=None)
        over = [
            r
            for r in side.values()
            if held[region(r.name) or ""] > (self.quota(region(r.name) or "") or 0)
        ]
        gone = [r for r in over if gone_remote(r)]
        return Room(full=True, replaces=_longest_silent(gone or over))

    def refusal(self, name: str) -> Refused | None:
        """Why `name` may not join (403 not an island name of the job, 503 not admitted now),
        or None when it may."""
        match = NAME.match(name)
        if match is None:
            return Refused(
                403,
                f"{name!r} is not an island name of this job: islands are "
                f"{self._own(0)} .. {self._own(self.count - 1)}",
                protocol.ERROR_NOT_JOB_ISLAND,
            )
        prefix, index = match.group("prefix") or "", int(match.group("index"))
        own = prefix == self.prefix
        if not own and not self.multi_region:
            why = f"this job's islands are named {self._own(0)} .. {self._own(self.count - 1)}"
        elif index >= (self.count if own else self.total):
            why = f"the job has {self.count if own else self.total} islands here"
        elif not own and self.quota(prefix) == 0:
            why = f"islands.regions does not list region {prefix!r}"
        else:
            return None
        return Refused(
            503,
            f"island {name!r} is not admitted: {why} (retry once the job's spec has it)",
            protocol.ERROR_NOT_ADMITTED,
            retry_after=RETRY_AFTER,
        )

    def replicas_for(self, name: str) -> int:
        """The most replicas `name` may report (own or another cluster's island)."""
        return self.replicas if self.is_own(name) else self.remote_replicas

    def _own(self, index: int) -> str:
        return f"{self.prefix}-island-{index}" if self.prefix else f"island-{index}"


def evictable(records: Mapping[str, IslandRecord]) -> str | None:
    """The island record a new island may replace when the syncer holds `cap` of them: the one
    silent the longest among those that timed out or left (active and dropped ones stay)."""
    gone = [r for r in records.values() if r.state in (TIMED_OUT, LEFT)]
    return min(gone, key=lambda r: (r.last_seen, r.name)).name if gone else None


def _longest_silent(records: list[IslandRecord]) -> str | None:
    """The name of the record silent the longest (None for none)."""
    return min(records, key=lambda r: (r.last_seen, r.name)).name if records else None


def gone_remote(rec: IslandRecord) -> bool:
    """Whether another region's record may be taken by any region's new island: timed out,
    left, or dropped by the admin route (a drop for refused pushes keeps its record: a new join
    of the same name would forget it)."""
    if rec.state in (TIMED_OUT, LEFT):
        return True
    return rec.state == DROPPED and not protocol.dropped_for_refusals(rec.state, rec.reason)


def _remote_room(side: Mapping[str, IslandRecord], prefix: str) -> str | None:
    """The record of the other regions' full side that a new island of region `prefix` takes:
    a gone one (its own region's first, then the fullest region's, the longest silent first),
    else one of a region holding at least two more than `prefix` does; None: no room."""
    held = Counter(region(n) or "" for n in side)
    gone = [r for r in side.values() if gone_remote(r)]
    if gone:
        best = min(
            gone,
            key=lambda r: (
                region(r.name) != prefix,
                -held[region(r.name) or ""],
                r.last_seen,
                r.name,
            ),
        )
        return best.name
    mine = held.get(prefix, 0)
    over = {q: h for q, h in held.items() if q != prefix and h >= mine + 2}
    if not over:
        return None
    most = max(over.values())
    fullest = [r for r in side.values() if over.get(region(r.name) or "") == most]
    return min(fullest, key=lambda r: (r.state != DROPPED, r.last_seen, r.name)).name


def admitted_records(
    admission: Admission, doc: Mapping[str, IslandStatus]
) -> tuple[dict[str, IslandStatus], list[str]]:
    """The island records of a checkpoint this job admits (names of the job, at most cap_for of
    each side, the most recently seen first; other regions' split fairly among them, or at most
    each one's islands.regions count), and the
    names left out."""
    named = {n: d for n, d in doc.items() if NAME.match(n) and admission.refusal(n) is None}
    newest = sorted(named, key=lambda n: -named[n].last_seen)
    own = [n for n in newest if admission.is_own(n)][: admission.count]
    # Other regions' records split as room_for splits them: each region's newest first, one
    # region after another (a region's k-th newest before any region's (k+1)-th).
    rank: Counter[str] = Counter()
    order: dict[str, tuple[int, float, str]] = {}
    for n in newest:
        if not admission.is_own(n):
            prefix = region(n) or ""
            quota = admission.quota(prefix)
            if quota is not None and rank[prefix] >= quota:
                continue  # islands.regions: a region's newest quota(p) only
            order[n] = (rank[prefix], -named[n].last_seen, n)
            rank[prefix] += 1
    other = sorted(order, key=order.__getitem__)[: admission.total - admission.count]
    kept = {n: named[n] for n in sorted(own + other)}
    return kept, sorted(set(doc) - set(kept))
