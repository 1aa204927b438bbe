"""Compressed pseudo-gradients end to end: an int8 run (per-block scales on the wire, fp32
accumulation at the syncer) ends within 1% of the uncompressed run's eval loss, same seed and
steps, with about 4x fewer bytes pushed."""

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
    ROUNDS,
    local_run,
    start_synchronised,
)

pytestmark = pytest.mark.e2e


def codec_run(
    codec: str, make_spec: Callable[..., JobSpec], make_run: Callable[..., LocalRun]
) -> LocalRun:
    """A two-island run (not started) with every island in every merge, so that two runs
    differ only by the codec."""
    spec = make_spec(
        **deep_merge(
            CONVERGENCE_SPEC,
            {"islands": {"count": 2}, "sync": {"quorum": 2, "compression": codec}},
        )
    )
    return make_run(spec)


def test_codecs_int8_run_matches_uncompressed_run(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    # Both runs at once: their results do not depend on timing, and they share the start-up.
    runs = [codec_run(codec, make_spec, local_run) for codec in ("none", "int8")]
    start_synchronised(*runs)

    async def watch_both() -> list[SyncerStatus]:
        return await asyncio.wait_for(
            asyncio.gather(*(r.watch(time.monotonic()) for r in runs)), timeout=600
        )

    plain, int8 = asyncio.run(watch_both())
    assert plain.outer_step == int8.outer_step == ROUNDS
    assert plain.tokens == int8.tokens
    assert plain.eval_loss is not None and int8.eval_loss is not None
    assert int8.initial_eval_loss is not None
    assert int8.eval_loss < 0.6 * int8.initial_eval_loss, "the int8 run did not train"
    assert abs(int8.eval_loss - plain.eval_loss) <= 0.01 * plain.eval_loss, (
        int8.eval_loss,
        plain.eval_loss,
    )
    # int8 plus one fp32 scale per block: close to 4x fewer bytes than fp32.
    assert int8.bytes_in < plain.bytes_in / 3.5, (int8.bytes_in, plain.bytes_in)
