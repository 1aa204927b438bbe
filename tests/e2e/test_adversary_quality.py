"""One bad island of two ratchets in one fixed direction, on a live `diloco syncer`, and the job
stops before it degrades (issue 46: with f >= M/2 no aggregator is robust, so the promise is
bounded damage and detection).

The honest island's one push lowers the eval loss (it shrinks the weights of the random start:
logits nearer uniform), so that model is the best and is checkpointed at once. The bad island
then pushes one fixed random direction at 0.9 x the learned bound of a job of two (normFactor x
the honest median): every push is accepted, and the eval loss climbs. After
syncer.qualityGuard's patience (3) evaluations above 1.05 x the best, the syncer stops merging
and ends the job: finished, the health problem evalLossRose, and its final checkpoint the best
one, not the weights that rose. The `diloco syncer` process restarted on the same state dir (and
port) stays finished: the same final checkpoint and problem, no merge (storage/guard_end.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from diloco_trainer.local import launch
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .conftest import SyncerHandle, deep_merge, wait_until
from .test_adversary import SPEC, join_all, push_as
from .test_adversary import start_syncer as start_syncer_of

pytestmark = pytest.mark.e2e

JOB = "adversary-quality"
HONEST = "island-0"
ADVERSARY = "island-1"
NORM_FACTOR = 10
# Two islands, each push two rounds of work (8 steps of H = 4): every merge is an outer step,
# evaluated; the guard at 5% and three in a row.
QUALITY = deep_merge(
    SPEC,
    {
        "islands": {"count": 2},
        "syncer": {
            "evalEveryOuterSteps": 1,
            "qualityGuard": {"margin": 0.05, "patience": 3, "warmupOuterSteps": 0},
            # No movement cap: the shrink is no AdamW round, and the guard is judged alone.
            "guards": {
                "warmupPushes": 1,
                "normFactor": NORM_FACTOR,
                "maxDeltaNorm": 1e6,
                "movementFactor": 0,
            },
            # Regular checkpoints every 2 outer steps, keep 1: the pruning must leave the best,
            # and the trip set aside the ones after it.
            "checkpoint": {"everyOuterSteps": 2, "keep": 1},
        },
    },
)
STEPS = 8
TOKENS = STEPS * 2 * 32  # batchSize x seqLen
MAX_PUSHES = 40


@pytest.fixture
def syncer(tmp_path: Path) -> Iterator[SyncerHandle]:
    handle = start_syncer_of(tmp_path, QUALITY, JOB)
    try:
        yield handle
    finally:
        handle.proc.stop(timeout=10)


def restart(handle: SyncerHandle, job: str = JOB) -> SyncerHandle:
    """Stop the syncer (SIGTERM: its final checkpoint) and start `diloco syncer` of `job` again
    on its state dir and port (a restart_safe_port: still free); the caller stops the new one."""
    handle.proc.stop(timeout=30)
    log_file = handle.log_file.with_name("syncer-restarted.log")
    proc = launch.start_syncer(
        handle.files,
        port=handle.port,
        state_dir=handle.state_dir,
        job_name=job,
        log_file=log_file,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    try:
        launch.wait_ready(handle.url, handle.token, timeout=90, proc=proc)
    except BaseException:
        proc.stop(timeout=5)
        raise
    return dataclasses.replace(handle, proc=proc, log_file=log_file)


def norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((t * t).sum()) for t in tensors.values()))


def test_bad_island_of_two_ratchets_and_the_job_stops_at_its_best(syncer: SyncerHandle) -> None:
    weights = join_all(syncer, (HONEST, ADVERSARY))  # fp32 pulls: fragment 0's weights
    shrink = {n: 0.2 * t for n, t in weights.items()}
    code, doc = push_as(syncer, HONEST, shrink, steps=STEPS, tokens=TOKENS)
    assert code == 200 and doc["accepted"], doc
    best = wait_until(
        lambda: (s := syncer.status())["checkpoint"] and s["checkpoint"], timeout=60, what="best"
    )
    gen = torch.Generator().manual_seed(0)
    direction = {n: torch.randn(t.shape, generator=gen) for n, t in weights.items()}
    scale = 0.9 * NORM_FACTOR * norm(shrink) / norm(direction)  # inside the bound of a pair
    ratchet = {n: scale * t for n, t in direction.items()}
    accepted = 0
    for _ in range(MAX_PUSHES):
        if syncer.status()["finished"]:
            break
        version = syncer.status()["versions"][0]
        code, doc = push_as(syncer, ADVERSARY, ratchet, steps=STEPS, tokens=TOKENS)
        if code == 200 and doc.get("accepted"):
            accepted += 1
            wait_until(
                lambda v=version: (s := syncer.status())["versions"][0] > v or s["finished"],
                timeout=60,
                what="the adversary's merge",
            )
    status = wait_until(
        lambda: (s := syncer.status())["finished"] and s, timeout=60, what="the job's end"
    )
    losses = [e["evalLoss"] for e in status["evalHistory"]]
    # The honest push was the best; the adversary's accepted pushes raised the loss, and the
    # guard ended the job after three evaluations above 1.05 x that best (not at its budget:
    # stopAfter is 100000 outer steps).
    assert best["outerStep"] == 1 and losses[1] < losses[0]
    # Every merged push was an outer step, evaluated (the last one accepted may have come in
    # while the trip's evaluation ran: never merged); the last three rose above the limit, and
    # the three before them did not all (the guard ended the job at its first chance).
    limit = 1.05 * losses[1]
    assert status["outerStep"] == len(losses) - 1 >= 4, losses
    assert accepted in (status["outerStep"] - 1, status["outerStep"]), (accepted, losses)
    assert all(x > limit for x in losses[-3:]), losses
    assert not all(x > limit for x in losses[-4:-1]), losses
    kinds = {p["kind"]: p["message"] for p in status["health"]["problems"]}
    assert "evalLossRose" in kinds and f"best ({losses[1]:.4f})" in kinds["evalLossRose"]
    # The final checkpoint (the operator's finalCheckpoint, the exported model) is the best,
    # on disk and intact, and the newest there: the regular ones after it (their weights rose)
    # were set aside, so a restart or an export of the state dir takes the best too.
    assert status["checkpoint"] == best
    kept = ckpt.load_checkpoint(Path(best["path"]))
    assert kept.outer_step == 1
    state_dir = Path(best["path"]).parents[1]
    assert [p.name for p in ckpt.list_checkpoints(state_dir)] == [Path(best["path"]).name]
    # keep 1: of the regular ones (2, 4, ...) only the newest was left to set aside
    aside = sorted(p.name for p in (state_dir / "checkpoints").iterdir())
    # (none is written at the trip's own step)
    newest = ckpt.checkpoint_name((status["outerStep"] - 1) // 2 * 2)
    assert aside == [Path(best["path"]).name, ckpt.ROSE_PREFIX + newest], aside
    # Merging stopped: a push after the end moves nothing.
    push_as(syncer, ADVERSARY, ratchet, steps=STEPS, tokens=TOKENS)
    assert syncer.status()["versions"] == status["versions"]
    # A restart on the same state dir remembers the end: it resumed from the best (outer step
    # 1), is finished, names the same final checkpoint and problem, and merges nothing.
    again = restart(syncer)
    try:
        after = again.status()
        assert after["finished"] and after["checkpoint"] == best
        assert after["resumedFrom"] == best["path"] and after["outerStep"] == 1
        problems = {p["kind"]: p["message"] for p in after["health"]["problems"]}
        assert problems == {"evalLossRose": kinds["evalLossRose"]}
        join_all(again, (ADVERSARY,))
        code, doc = push_as(again, ADVERSARY, ratchet, steps=STEPS, tokens=TOKENS)
        assert code == 200 and doc["finished"] and not doc["accepted"], doc
        assert again.status()["versions"] == after["versions"]
        assert [p.name for p in ckpt.list_checkpoints(state_dir)] == [Path(best["path"]).name]
    finally:
        again.proc.stop(timeout=10)
