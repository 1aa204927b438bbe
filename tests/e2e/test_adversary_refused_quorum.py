"""At K = M an island whose every push a guard refuses does not stall the job (issues 46/47), on
a live `diloco syncer` with each island's own credential.

hetero17's CPU island at M = 4: the direction check refused every push of it (cosine -0.54
against the emulated majority), a refusal that never counts towards a drop; the round spanned it
(K = M waits for every island), so the other islands' pushes were never merged and fragment 0
never merged again. Here K = M = 3: island-0 and island-1 push along one descent, island-2
against it (cosine -1 with each). Before, the honest round stayed open for ever; now the third
refusal in a row leaves island-2 out of the rounds and the quorum (status `quorum` 2), the
honest round merges, and island-2's next push along the descent makes it an island of the
rounds again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from diloco_trainer.api import protocol

from .conftest import SyncerHandle, deep_merge, wait_until
from .test_adversary import HONEST, HONEST_VALUE, SPEC, filled, join_all, push_as, start_syncer

pytestmark = pytest.mark.e2e

AGAINST = "island-2"
JOB = "adversary-refused-quorum"
# refused_runs.REFUSED_RUN, written out: the test fails if the rule's run changes.
RUN = 3
# Seconds the honest round has to merge once the island is left out (a merge here takes well
# under a second; on main it never comes).
MERGE_WAIT = 30
KM = deep_merge(SPEC, {"sync": {"quorum": 3}})


@pytest.fixture
def syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer(tmp_path, KM, JOB)
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


def push_ok(handle: SyncerHandle, island: str, shapes: dict, value: float) -> None:
    code, doc = push_as(handle, island, filled(shapes, value))
    assert code == 200 and doc["accepted"] is True, (island, code, doc)


def full_round(handle: SyncerHandle, shapes: dict) -> None:
    """All three islands push along the descent and fragment 0 merges (K = M = 3)."""
    version = handle.status()["versions"][0]
    for island in (*HONEST, AGAINST):
        push_ok(handle, island, shapes, HONEST_VALUE)
    wait_until(lambda: handle.status()["versions"][0] > version, timeout=60, what="full round")


def test_k_equals_m_merges_past_an_island_whose_pushes_the_direction_check_refuses(
    syncer: SyncerHandle,
) -> None:
    shapes = join_all(syncer)
    for _ in range(2):  # every island has an accepted push: the direction check has its votes
        full_round(syncer, shapes)
    version = syncer.status()["versions"][0]
    for island in HONEST:
        push_ok(syncer, island, shapes, HONEST_VALUE)
    for n in range(1, RUN + 1):
        doc = syncer.status()
        # the round is open, waiting for island-2, which counts towards the quorum of 3
        assert (doc["versions"][0], doc["pending"], doc["quorum"]) == (version, [2], 3), n
        code, answer = push_as(syncer, AGAINST, filled(shapes, -HONEST_VALUE))
        assert (code, answer["code"]) == (422, protocol.ERROR_NORM_OUTLIER), (code, answer)
        assert "points against" in answer["error"], answer
    # Left out after the third: the two honest pushes are the round, merged complete.
    wait_until(
        lambda: syncer.status()["versions"][0] > version,
        timeout=MERGE_WAIT,
        what="the honest round's merge once island-2 is left out",
    )
    doc = syncer.status()
    assert doc["quorum"] == 2 and doc["quorumTarget"] == 3, doc
    assert doc["islands"][AGAINST]["state"] == protocol.STATE_ACTIVE  # not dropped
    assert doc["refusals"] == {AGAINST: {protocol.ERROR_NORM_OUTLIER: RUN}}
    merges = syncer.merge_records()
    assert sorted(c["island"] for c in merges[-1]["contributors"]) == list(HONEST)
    assert merges[-1]["complete"] is True
    # Its next push along the descent is accepted: it counts again, and the next round is all
    # three islands' (K = M as before).
    push_ok(syncer, AGAINST, shapes, HONEST_VALUE)
    assert syncer.status()["quorum"] == 3
    version = syncer.status()["versions"][0]
    for island in HONEST:
        push_ok(syncer, island, shapes, HONEST_VALUE)
    wait_until(lambda: syncer.status()["versions"][0] > version, timeout=60, what="full round")
    merges = syncer.merge_records()
    assert sorted(c["island"] for c in merges[-1]["contributors"]) == [*HONEST, AGAINST]
