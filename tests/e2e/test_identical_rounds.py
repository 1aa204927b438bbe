"""Identical islands keep their rounds (inner.stepsPerIsland auto, core/island_rounds.py) on a
loaded shared host: test_convergence's K = M job of four islands at H = 10 with the default auto,
every merge a full round of every island (issue 47: on a loaded 2-core CI machine the syncer cut
an identical island's round, 84,992 of 102,400 tokens merged)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from diloco_trainer.api.documents import MergeRecord
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.run import LocalRun

from .conftest import deep_merge
from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    CONVERGENCE_SPEC,
    INNER_STEPS,
    ROUNDS,
    local_run,
    run_to_finish,
    start_synchronised,
)

pytestmark = pytest.mark.e2e

ISLANDS = 4


def test_identical_islands_keep_their_rounds_at_k_equal_m(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    spec = make_spec(
        **deep_merge(
            CONVERGENCE_SPEC,
            {
                "islands": {"count": ISLANDS},
                "sync": {"quorum": ISLANDS},
                "inner": {"stepsPerIsland": "auto"},
            },
        )
    )
    run = local_run(spec)
    start_synchronised(run)
    status = run_to_finish(run, timeout=600)
    run.stop_all(timeout=5)

    changes = re.findall(
        r".*rounds of \d+ inner steps \(was.*", (run.logs / "syncer.log").read_text()
    )
    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    short = [(m.version, c.island, c.steps) for m in merges for c in m.contributors
             if c.steps != INNER_STEPS]  # fmt: skip
    changes = [c for c in changes if "(was 10)" in c and "rounds of 10 " not in c]
    assert not changes, "\n".join(changes)
    assert not short, short
    assert status.outer_step == ROUNDS
    assert status.tokens == ISLANDS * ROUNDS * INNER_STEPS * 8 * 32
