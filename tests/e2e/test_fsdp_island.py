"""Islands of two FSDP2 ranks in bf16 (gloo on the CPU) against islands of two DDP ranks in fp32:
the same job, equal tokens, real syncer and learner processes; the eval losses agree within 2%."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
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

DIGEST = re.compile(r"weights digest ([0-9a-f]+)")


def island_job(parallelism: str, precision: str) -> dict[str, Any]:
    return deep_merge(
        CONVERGENCE_SPEC,
        {
            "islands": {"count": 2, "replicas": 2, "parallelism": parallelism},
            "inner": {"precision": precision, "microBatches": 2, "batchSize": 4},
            # Two fragments with overlap: pushes gathered and arrivals mixed on shards.
            "sync": {"quorum": 2, "fragments": 2, "overlapSteps": 1},
        },
    )


def test_fsdp_bf16_islands_reach_ddp_fp32_loss(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    results = {}
    for parallelism, precision in (("ddp", "fp32"), ("fsdp", "bf16")):
        spec = make_spec(**island_job(parallelism, precision))
        run = local_run(spec)
        start_synchronised(run)
        status = run_to_finish(run, timeout=600)
        run.stop_all(timeout=5)
        assert status.outer_step == ROUNDS
        results[parallelism] = status
        if parallelism == "fsdp":
            # Each rank of a sharded island trained its own half: the digests differ.
            for island in ("island-0", "island-1"):
                digests = [
                    DIGEST.findall((run.logs / f"{island}-rank{r}.log").read_text()) for r in (0, 1)
                ]
                assert digests[0] and digests[1] and digests[0] != digests[1], digests
    ddp, fsdp = results["ddp"], results["fsdp"]
    # A round of work is both islands' H steps of 2 ranks x 2 micro-batches x 4 x 32 tokens.
    # At K = M each island trains its share, ROUNDS x H steps, and drains (learner/drain.py):
    # fragment 1's last half round (its first push holds 1.5 rounds) is pushed and merged as
    # a partial round, gathered from the shards, so both fragments hold exactly ROUNDS rounds.
    per_round = 2 * INNER_STEPS * 2 * 2 * 4 * 32
    assert ddp.tokens == fsdp.tokens, (ddp.tokens, fsdp.tokens)
    assert fsdp.tokens == ROUNDS * per_round, fsdp.tokens
    assert ddp.eval_loss is not None and fsdp.eval_loss is not None
    assert ddp.initial_eval_loss is not None
    assert ddp.eval_loss < 0.6 * ddp.initial_eval_loss, "the ddp job did not train"
    print(f"eval loss at {fsdp.tokens} tokens: ddp+fp32 {ddp.eval_loss:.4f}, ", end="")
    print(f"fsdp+bf16 {fsdp.eval_loss:.4f}")
    assert abs(fsdp.eval_loss - ddp.eval_loss) <= 0.02 * ddp.eval_loss, (
        f"fsdp+bf16 {fsdp.eval_loss:.4f} vs ddp+fp32 {ddp.eval_loss:.4f}"
    )
