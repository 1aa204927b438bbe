"""Compressed pulls end to end: two int8 runs (real syncer and learner processes), one pulling
full fp32 weights (sync.pullCompression none) and one pulling int8 weight updates
(pullCompression auto). The second pulls at least 3x fewer bytes and ends within 2% of the first's
eval loss (the runs' own spread under load is about 1%: see the assertion)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.run import LocalRun

from .conftest import deep_merge
from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    CONVERGENCE_SPEC,
    local_run,
    start_synchronised,
)

pytestmark = pytest.mark.e2e

# Twice the convergence test's rounds at half its H (the same inner steps): every learner pulls
# each round, so the two full pulls at the joins weigh less against the per-round pulls.
ROUNDS = 20
INNER_STEPS = 5
ISLANDS = 2


def pull_run(
    pull_compression: str, make_spec: Callable[..., JobSpec], make_run: Callable[..., LocalRun]
) -> LocalRun:
    """A two-island int8 run (not started) with every island in every merge, so that two runs
    differ only by the pull codec."""
    spec = make_spec(
        **deep_merge(
            CONVERGENCE_SPEC,
            {
                "islands": {"count": ISLANDS},
                "inner": {"steps": INNER_STEPS},
                "sync": {
                    "quorum": ISLANDS,
                    "compression": "int8",
                    "pullCompression": pull_compression,
                },
                "stopAfter": {"outerSteps": ROUNDS},
            },
        )
    )
    return make_run(spec)


def test_pull_compression_int8_updates_pull_3x_fewer_bytes_at_the_same_loss(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    # Both runs at once: their results do not depend on timing, and they share the start-up.
    runs = [pull_run(codec, make_spec, local_run) for codec in ("none", "auto")]
    start_synchronised(*runs)

    async def watch_both() -> list[SyncerStatus]:
        return await asyncio.wait_for(
            asyncio.gather(*(r.watch(time.monotonic()) for r in runs)), timeout=300
        )

    full, updates = asyncio.run(watch_both())
    assert full.eval_loss is not None and updates.eval_loss is not None
    assert updates.initial_eval_loss is not None
    print(
        f"pulled {full.bytes_out} B (pullCompression none) vs {updates.bytes_out} B "
        "(auto/int8); "
        f"eval loss {full.eval_loss:.4f} vs {updates.eval_loss:.4f}"
    )
    assert full.outer_step == updates.outer_step == ROUNDS
    assert full.tokens == updates.tokens
    assert (full.pull_compression, updates.pull_compression) == ("none", "int8")
    # Each learner pulls the fragment in full when it joins, then once per round: with updates,
    # every per-round pull is a one-update chain (each learner holds the version before the
    # merge it waits for). The status is read when the syncer finishes, so the final round's
    # pulls may not all be counted yet.
    assert full.pulls["updates"] == 0
    assert full.pulls["full"] >= ISLANDS * ROUNDS, full.pulls
    assert updates.pulls["full"] == ISLANDS, updates.pulls
    assert updates.pulls["updates"] >= ISLANDS * (ROUNDS - 1), updates.pulls
    assert updates.bytes_out * 3 <= full.bytes_out, (updates.bytes_out, full.bytes_out)
    # Pushes are int8 in both runs (their headers' numbers may differ in length).
    assert updates.bytes_in == pytest.approx(full.bytes_in, rel=1e-3)
    assert updates.eval_loss < 0.6 * updates.initial_eval_loss, "the run did not train"
    # 2%: the runs are not bit-for-bit repeatable under load (each codec's final loss over
    # eight runs, six of them three side by side: none 2.7317-2.7446, int8 updates
    # 2.7164-2.7453, at this revision and at 9926a4c alike; the CI rehearsal's pair differed by
    # 1.03%), so 1% judged the noise; a broken update chain is far off.
    assert abs(updates.eval_loss - full.eval_loss) <= 0.02 * full.eval_loss, (
        updates.eval_loss,
        full.eval_loss,
    )
