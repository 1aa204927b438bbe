"""Which islands may exist at the syncer: the job's own island names, as many as the job has.

Island names are api/contract.island_name(prefix, i): 'island-3', or 'eu-island-3' with
islands.namePrefix 'eu'. A syncer accepts a join of

- its own prefix with i < islands.count;
- in a multi-region job (islands.totalShards, or shardOffset + count, larger than count), any
  other cluster's prefix with i < totalShards;

and keeps at most that many island records (max(count, total shards)), counted per side: at most
`count` of its own prefix and at most total - count of other clusters' (cap_for), so other regions
cannot fill the records and lock out a local island. When a side's records are all taken, a new
island of that side takes the place of one of the same side that timed out or left, never of an
active or dropped one.
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
from collections.abc import Mapping
from dataclasses import dataclass

from diloco_trainer.api import protocol
from diloco_trainer.api.documents import IslandStatus
from diloco_trainer.api.spec import IslandsSpec, JobSpec
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.state import LEFT, TIMED_OUT, IslandRecord

NAME = re.compile(
    r"^(?:(?P<prefix>[a-z0-9](?:[-a-z0-9]{0,18}[a-z0-9])?)-)?island-(?P<index>0|[1-9]\d{0,5})$"
)
# Seconds a client is asked to wait before it retries a join the syncer does not admit yet.
RETRY_AFTER = 10.0


@dataclass(frozen=True)
class Admission:
    """The island names and replicas one job admits."""

    prefix: str  # this cluster's islands.namePrefix
    count: int  # islands.count: own names island-0 .. island-(count-1)
    total: int  # islands of the whole job (all clusters)
    replicas: int  # islands.replicas, or more for an island with an override
    remote_replicas: int  # replicas of another cluster's island

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
        )

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


def admitted_records(
    admission: Admission, doc: Mapping[str, IslandStatus]
) -> tuple[dict[str, IslandStatus], list[str]]:
    """The island records of a checkpoint this job admits (names of the job, at most cap_for of
    each side, the most recently seen first), and the names left out."""
    named = {n: d for n, d in doc.items() if NAME.match(n) and admission.refusal(n) is None}
    newest = sorted(named, key=lambda n: -named[n].last_seen)
    own = [n for n in newest if admission.is_own(n)][: admission.count]
    other = [n for n in newest if not admission.is_own(n)][: admission.total - admission.count]
    kept = {n: named[n] for n in sorted(own + other)}
    return kept, sorted(set(doc) - set(kept))
