"""What is wrong with a running syncer that does not stop it: the status document's `health` and
/healthz?strict=1.

A problem has a kind (CHECKPOINT: the last checkpoint write failed; CORRUPT: corrupt checkpoints
were found at start and set aside; MERGE: the last merge of a fragment could not take some
contributions; AT_BOUND: an island's pushes are all at the learned norm bound, guards.py's
detection of a ratchet; WORK_UNSUPPORTED: an island's pushes all move too little for the work they
claim, its work evidence; LEFT_OUT: an island whose last pushes to a fragment were all refused is
left out of the rounds and the quorum, intake/refused_runs.py; EVAL_LOSS_ROSE: the quality guard
ended the job; FAINT_ENDED: a job of two ended for an island's faint pushes with claims), a
message, since when and how often it happened; it clears when the thing works again (a checkpoint
is written, a merge succeeds, no island is at the bound or below the work evidence's bar or left
out; EVAL_LOSS_ROSE and FAINT_ENDED never clear). A failure that does stop the syncer (a merge that
broke half-way) is the service's `failure` instead: /healthz answers 503 for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import Gauge

CHECKPOINT = "checkpoint"
CORRUPT = "corruptCheckpoints"
MERGE = "merge"
AT_BOUND = "islandAtBound"
# An island's recent pushes all claimed work they do not carry (intake/guards.py's work evidence).
WORK_UNSUPPORTED = "islandWorkUnsupported"
# An island's last pushes to a fragment were all refused (intake/refused_runs.py): no round spans
# it and no quorum counts it until one is accepted; at K = M the job then merges without it.
LEFT_OUT = "islandLeftOut"
# The quality guard tripped (quality.py): merging stopped, the job ended; it never clears.
EVAL_LOSS_ROSE = "evalLossRose"
# In a job of two, an island's recent pushes all moved too little for their claims and some were
# merged (intake/guards.py: faint_merged): merging stopped, the job ended at its best-evaluated
# checkpoint, as EVAL_LOSS_ROSE's; it never clears.
FAINT_ENDED = "faintIslandEnded"


class Health:
    """The syncer's current problems, by kind."""

    def __init__(self, clock: Callable[[], float], gauge: Gauge | None = None) -> None:
        self.clock = clock
        self.gauge = gauge  # set to 1 while healthy, 0 with a problem
        self.problems: dict[str, dict[str, Any]] = {}

    def report(self, kind: str, message: str) -> None:
        """Record (or repeat) a problem of `kind`."""
        now = self.clock()
        known = self.problems.get(kind)
        count = known["count"] + 1 if known else 1
        since = known["since"] if known else now
        self.problems[kind] = {
            "kind": kind,
            "message": message[:1000],
            "since": since,
            "last": now,
            "count": count,
        }
        if self.gauge is not None:
            self.gauge.set(0)

    def clear(self, *kinds: str) -> None:
        for kind in kinds:
            self.problems.pop(kind, None)
        if self.gauge is not None and not self.problems:
            self.gauge.set(1)

    @property
    def healthy(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """{"healthy", "problems": [...]} for status and /healthz."""
        # list() copies the values in one step under the interpreter lock: the probe listener's
        # thread (edge/probe_listener.py) reads this while the event loop records problems. Each
        # value is replaced whole, never changed in place.
        problems = list(self.problems.values())
        return {"healthy": not problems, "problems": [dict(p) for p in problems]}
