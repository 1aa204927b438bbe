"""Work clocks: per fragment, the rounds of work merged up to each recent version, so a push's
staleness is counted in rounds of work (lag_rounds), not in versions (pure, no I/O).

A merge that carries half a round of work moves the clock by 0.5 (core/contributions.py), so a
push based two half-round merges ago lags one round. The table keeps the last maxStaleness + 1
versions: no accepted push is based on an older one.
"""

from __future__ import annotations

from collections.abc import Sequence


class WorkClocks:
    """Version -> work clock, per fragment. Not thread-safe: the caller locks."""

    def __init__(self, versions: Sequence[int], rounds: Sequence[int], keep: int) -> None:
        """`versions` and their completed `rounds` of work, per fragment; `keep` versions are
        kept per fragment."""
        self.keep = keep
        self._clocks: list[dict[int, float]] = [
            {v: float(r)} for v, r in zip(versions, rounds, strict=True)
        ]

    def lag_rounds(self, fragment: int, base_version: int) -> float:
        """Rounds of work merged into fragment since `base_version` (a push's staleness).

        A version the table no longer holds (older than maxStaleness allows, or before a
        restart from a checkpoint without it) counts from the oldest one it holds: a lower
        bound.
        """
        clocks = self._clocks[fragment]
        now = clocks[max(clocks)]  # versions only grow: the newest is the fragment's version
        base = clocks.get(base_version, clocks[min(clocks)])
        return max(0.0, now - base)

    def record(self, fragment: int, version: int, clock: float) -> None:
        """The fragment reached `version` at work clock `clock` (a merge)."""
        clocks = self._clocks[fragment]
        clocks[version] = clock
        for old in sorted(clocks)[: max(0, len(clocks) - self.keep)]:
            del clocks[old]  # no accepted push is based on a version this old

    def to_json(self) -> list[list[list[float]]]:
        """Per fragment, [version, work clock] pairs, for checkpoints."""
        return [[[v, c] for v, c in sorted(clocks.items())] for clocks in self._clocks]

    def restore(self, doc: Sequence[Sequence[Sequence[float]]]) -> None:
        """Load to_json(); pairs beyond each fragment's current version are ignored."""
        for f, pairs in enumerate(doc[: len(self._clocks)]):
            current = max(self._clocks[f])
            for v, c in pairs:
                if int(v) <= current:
                    self._clocks[f][int(v)] = float(c)
