"""Islands whose recent pushes the gate all refused: left out of the rounds (issues 46/47).

At K = M a round waits for every island it spans. An island whose every push a guard refuses
never adds one, so the other islands' rounds never merge: hetero17's CPU island at M = 4, whose
pushes the direction check refused (cosine -0.54 against the emulated majority), stalled the
job. A refusal by a bound the other islands' pushes set (the direction check, the learned norm
bound over islands, the work evidence: guards.ContributionRefused.own_fault False) never
counts towards a drop, so nothing else ends the wait; a refusal of the island's own fault drops
it after syncer.guards.maxRefusals in a row, and never with maxRefusals 0.

The rule: an island whose last REFUSED_RUN pushes to any one fragment were all refused by the
gate (a 400 or 422 of its content or claimed work, whatever the reason) is left out, as one
the work evidence names unsupported is (SyncState.set_unsupported): no round spans it and no
quorum counts it, and the first push of it to that fragment the gate accepts ends it. Left out
it gains nothing: its pushes are refused anyway, and one it gets accepted is merged as any.

Per fragment, because a round is: an island refused on fragment 0 alone, whose pushes to
fragment 1 pass, would otherwise reset its run on every other push and hold fragment 0's rounds
for ever. Three in a row, because each refused push costs the others a wait at K = M (the round
cannot close until it is left out: at most three of its rounds), while one refusal can be an
honest island's blip (a loss spike above the learned bound) that its next push undoes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Refused pushes in a row to one fragment that leave an island out of the rounds.
REFUSED_RUN = 3


@dataclass
class RefusedRuns:
    """Refused pushes in a row per (fragment, island), reset by an accepted push."""

    run: int = REFUSED_RUN
    counts: dict[tuple[int, str], int] = field(default_factory=dict)

    def refused(self, fragment: int, island: str) -> None:
        key = (fragment, island)
        self.counts[key] = self.counts.get(key, 0) + 1

    def accepted(self, fragment: int, island: str) -> None:
        self.counts.pop((fragment, island), None)

    def left_out(self) -> dict[str, str]:
        """Islands whose last `run` pushes to some fragment were all refused, each with what
        happened (the first such fragment)."""
        out: dict[str, str] = {}
        for (fragment, island), n in sorted(self.counts.items()):
            if island not in out and n >= self.run:
                out[island] = (
                    f"island {island}'s last {n} pushes to fragment {fragment} were all refused: "
                    "it is left out of the islands a round spans and the quorum counts, until a "
                    "push of it to that fragment is accepted"
                )
        return out

    def forget(self, island: str) -> None:
        """An island dropped: its runs start again when it is back."""
        for key in [k for k in self.counts if k[1] == island]:
            del self.counts[key]
