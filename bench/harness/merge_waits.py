"""Which island each merge waited for, from the learners' logs (bench/hetero, issue 47).

At K = M every merge of a fragment waits for every island's push, so the time between the
second-last push and the last is time the merge, and every island blocked on it, waited for the
last island alone. Summed per island over a run this says whose rounds the others waited for: a
slow island whose round is too long, or fast islands drifting apart (noise). The pushes are read
from the learners' log lines ("step N: fragment f pushed (base version v, ..."): pushes with the
same (fragment, base version) from every island are one merge's. The first merge is left out
(bench/hetero's utilisation window starts after it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

_PUSH = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*: step \d+: fragment (\d+) pushed "
    r"\(base version (\d+)"
)


def pushes_in(text: str) -> dict[tuple[int, int], float]:
    """(fragment, base version) -> the push's time (seconds, the log's clock) of one learner's
    log; a repeated push of the same key (a lost push pushed afresh) keeps the last."""
    out: dict[tuple[int, int], float] = {}
    for line in text.splitlines():
        m = _PUSH.match(line)
        if m:
            stamp = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out[(int(m[2]), int(m[3]))] = stamp
    return out


def waits_alone(pushes: Mapping[str, Mapping[tuple[int, int], float]]) -> dict[str, float]:
    """Island -> seconds merges waited for it alone (its push the last, less the second-last),
    over the merges every island pushed to, the first one left out; 0.0 for an island never
    last. With fewer than two islands, nothing waits."""
    names = list(pushes)
    out = dict.fromkeys(names, 0.0)
    if len(names) < 2:
        return out
    keys = set.intersection(*(set(p) for p in pushes.values()))
    merges = sorted(
        (sorted((pushes[n][k], n) for n in names) for k in keys), key=lambda ts: ts[-1][0]
    )
    for times in merges[1:]:
        (second, _), (last, name) = times[-2], times[-1]
        out[name] += last - second
    return out


def run_waits(workdir: Path, names: list[str]) -> dict[str, float]:
    """waits_alone of a run whose learners logged to `workdir`/<island>.<n>.log (OursRun)."""
    pushes: dict[str, dict[tuple[int, int], float]] = {}
    for name in names:
        merged: dict[tuple[int, int], float] = {}
        for log in sorted(workdir.glob(f"{name}.*.log")):
            merged.update(pushes_in(log.read_text(errors="replace")))
        pushes[name] = merged
    return waits_alone(pushes)
