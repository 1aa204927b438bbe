"""Claimed work bounded over time, on a live `diloco syncer` with each island's own credential
(issue 22, finding 3). One push's claim was bounded alone (steps <= 4 x H + tau, tokens <= what
those steps carry), so claims at that most, pushed back to back, each counted as four rounds of
work: outerStep 0 -> 132 in 15 s, and stopAfter reached by one island in seconds. Now each
island's steps come out of a bucket that fills at its step time, which cannot be claimed much
shorter than the median island's (guards.WorkRate): the adversary's accepted steps stay within
the bucket plus its fill over the wall-clock time it flooded, and the honest islands merge."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from diloco_trainer.api import protocol

from .conftest import SyncerHandle
from .test_adversary import (
    ADVERSARY,
    HONEST,
    HONEST_VALUE,
    SPEC,
    filled,
    honest_active,
    honest_round,
    join_all,
    push_as,
    start_syncer,
)

pytestmark = pytest.mark.e2e

H = 4  # TINY_SPEC's inner.steps; no overlap
MOST_STEPS = 4 * H  # guards.STEP_ROUNDS x H: one push's most
TOKENS_PER_STEP = 2 * 32  # batch x seqLen
HONEST_STEP_TIME = 0.2  # what the honest islands say (and the median island's)
FLOOD_SECONDS = 3.0
# guards.py's BURST_PUSHES, FASTEST and RATE_ALLOWANCE, written out: the bound is derived here.
BURST_PUSHES, FASTEST, RATE_ALLOWANCE = 2, 4.0, 1.5


@pytest.fixture
def syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer(tmp_path, SPEC, "adversary-work")
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


def test_adversary_fast_claims_are_bounded_by_wall_clock(syncer: SyncerHandle) -> None:
    shapes = join_all(syncer)
    honest = {"steps": H, "tokens": H * TOKENS_PER_STEP, "step_time": HONEST_STEP_TIME}
    honest_round(syncer, shapes, **honest)
    codes: list[int] = []
    began = time.monotonic()
    while time.monotonic() - began < FLOOD_SECONDS:
        code, doc = push_as(
            syncer,
            ADVERSARY,
            filled(shapes, HONEST_VALUE),
            steps=MOST_STEPS,
            tokens=MOST_STEPS * TOKENS_PER_STEP,
            step_time=0.001,  # a lie: as fast as it likes
        )
        assert code == 200 or doc["code"] in (protocol.ERROR_STEPS_RANGE, "dropped"), doc
        codes.append(code)
    elapsed = time.monotonic() - began  # the syncer saw the pushes within this
    # Its step time counts as no less than the median island's (0.2 s: two honest, and its own
    # 0.001) over FASTEST = 0.05 s, so its bucket of BURST_PUSHES x 16 = 32 steps fills at
    # RATE_ALLOWANCE / 0.05 = 30 steps a second.
    most = BURST_PUSHES * MOST_STEPS + RATE_ALLOWANCE * FASTEST / HONEST_STEP_TIME * elapsed
    accepted = codes.count(200)
    assert accepted * MOST_STEPS <= most, (accepted, len(codes), elapsed)
    assert len(codes) * MOST_STEPS > most  # it did claim more than that: the bound held it
    for _ in range(3):
        honest_round(syncer, shapes, **honest)  # their own steps are still in their buckets
    assert honest_active(syncer) == dict.fromkeys(HONEST, protocol.STATE_ACTIVE)
