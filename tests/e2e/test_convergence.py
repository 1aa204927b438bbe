"""DiLoCo with M islands (real syncer and learner processes) against synchronous data-parallel
training on the same number of tokens: the final eval losses agree within 5%.

Also home of the helpers the other learner e2e modules share (a LocalRun fixture, starting the
learners lined up at their joins, running to the finish).
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_trainer.api.contract import island_name
from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.launch import Proc
from diloco_trainer.local.run import LocalRun
from diloco_trainer.local.syncer_shards import SyncerShards
from diloco_trainer.models.reference import train_synchronous
from rich.console import Console

from .conftest import deep_merge, http_request, wait_until

pytestmark = pytest.mark.e2e

INNER_STEPS = 10  # H
ROUNDS = 10  # outer steps; every island runs ROUNDS * H inner steps
# A short run: DiLoCo's outer defaults (lr 0.7, Nesterov 0.9) overshoot over 10 rounds of a tiny
# model; lr 0.5 with momentum 0.5 (an effective step of about one Δ) tracks data-parallel training.
CONVERGENCE_SPEC: dict[str, Any] = {
    "data": {"evalTokens": 4096},
    "inner": {
        "steps": INNER_STEPS,
        "batchSize": 8,
        "seqLen": 32,
        "lr": 3e-3,
        "warmupSteps": 10,
        # Every island's round H, as the baseline's workers: with the default (auto) the syncer
        # sizes rounds from measured step times, and on a loaded 2-core CI machine four identical
        # islands read far enough apart that a round was cut (84,992 of 102,400 tokens at K = 4).
        # Round sizing has its own tests and bench/hetero.
        "stepsPerIsland": "fixed",
    },
    "outer": {"lr": 0.5, "momentum": 0.5, "nesterov": True},
    # One fragment and no overlap (the defaults stream 2 fragments with overlap): plain blocking
    # DiLoCo, whose merges carry exactly the baseline's tokens (tests/e2e/test_quorum_quality.py
    # and bench/decoupled_quality.py run the defaults).
    "sync": {
        "graceSeconds": "auto",
        "heartbeatTimeoutSeconds": 60,
        "compression": "none",
        "fragments": 1,
        "overlapSteps": 0,
    },
    "stopAfter": {"outerSteps": ROUNDS},
    "syncer": {"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 5},
}


@pytest.fixture
def local_run(workdir: Path) -> Iterator[Callable[..., LocalRun]]:
    """Factory: local_run(spec, slowdowns={island: factor}) -> a LocalRun (not started yet).

    Every process of every run is stopped (process groups killed) at teardown.
    """
    runs: list[LocalRun] = []

    def make(spec: JobSpec, *, slowdowns: dict[int, float] | None = None) -> LocalRun:
        run = LocalRun(
            name="test",
            spec=spec,
            workdir=workdir / f"run-{len(runs)}",
            slowdowns=dict(slowdowns or {}),
            console=Console(file=io.StringIO()),
            quiet=True,
        )
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.stop_all(timeout=5)


def status_of(run: LocalRun) -> dict[str, Any]:
    """The syncer's /v1/status document."""
    assert run.files is not None
    code, doc = http_request("GET", run.url + "/v1/status", token=run.files.token)
    assert code == 200, (code, doc)
    return doc


# What a learner logs just before it joins the syncer (learner/loop.py): its imports, data and
# model are done; its join, first pull and start-together wait are all that is left before its
# first step.
AT_JOIN = re.compile(r"diloco\.learner: island \S+ rank 0/\d+ on ")
# How long the learners may take to reach their joins (a learner's start-up took 37 s at a load
# of 6 on two cores).
START_UP_SECONDS = 300.0


def start_synchronised(
    *runs: LocalRun, port: int | None = None, islands: int | None = None
) -> None:
    """Each run's syncer (on `port`; None: a free one), then every learner (`islands`: the
    first that many islands of each run only, the rest of the job never up), lined up at their
    joins: the syncers are held (SIGSTOP: their sockets accept, nothing is answered) from before
    the first learner starts until every learner has logged that it joins, so the joins are
    answered within moments of each other however long each learner's start-up took (a held
    join waits out its attempt, 120 s, and is sent again 0.2 s later: the skew stays that).

    The job's own rules need that only at K < M, and only on a loaded host: there the syncer
    waits for no island (a merge needs K pushes), and the learners' start-together rule
    (learner/start_together.py) holds a fresh decoupled job's first step until every island has
    joined for at most sync.heartbeatTimeoutSeconds, shorter than start-up skew can be (4 s in
    the tests that read paces from 1 s heartbeats). A learner that came up after it found the
    job (a second or two of work) done without it. At K = M the syncer waits for an island that
    has not joined (Membership.expect), so the hold only saves time there.

    No island is joined for its learner (the former pre-join): a pre-joined island is silent
    until its learner comes up, so it timed out after the heartbeat timeout, when it no longer
    counted towards the quorum, and at K = M the first learner up merged alone; at K < M it
    also told the start-together rule that every island was there."""
    assert port is None or len(runs) == 1, "one port, one syncer"
    for run in runs:
        run.start_syncer(port)
    held = [proc for run in runs for proc in syncer_procs(run)]
    for proc in held:
        os.killpg(proc.pid, signal.SIGSTOP)
    try:
        for run in runs:
            for i in range(run.spec.islands.count if islands is None else islands):
                run.start_island(i)
        wait_until(
            lambda: all(at_join(run, islands) for run in runs),
            timeout=START_UP_SECONDS,
            what="every learner to reach its join",
        )
    finally:
        for proc in held:
            os.killpg(proc.pid, signal.SIGCONT)


def syncer_procs(run: LocalRun) -> list[Proc]:
    """The run's syncer processes: one, or a process per shard."""
    if isinstance(run.syncer, SyncerShards):
        return list(run.syncer.procs)
    assert isinstance(run.syncer, Proc)
    return [run.syncer]


def at_join(run: LocalRun, islands: int | None = None) -> bool:
    """Every island's rank 0 (`islands`: of the first that many) has logged that it joins;
    raises if a learner exited before it did (then it never will)."""
    dead = [p.name for p in run.learners if not p.alive]
    assert not dead, f"learners exited before joining: {dead}"
    count = run.spec.islands.count if islands is None else islands
    logs = [run.logs / f"{island_name(run.spec.islands.name_prefix, i)}-rank0.log"
            for i in range(count)]  # fmt: skip
    return all(log.exists() and AT_JOIN.search(log.read_text(errors="replace")) for log in logs)


def run_to_finish(run: LocalRun, timeout: float) -> SyncerStatus:
    """Watch the run until the syncer says finished (RunError if a process fails); returns the
    syncer's last status."""
    return asyncio.run(asyncio.wait_for(run.watch(time.monotonic()), timeout))


@pytest.mark.parametrize("islands", [2, 4])
def test_convergence_matches_synchronous_data_parallel(
    islands: int, make_spec: Callable[..., JobSpec], local_run: Callable[..., LocalRun]
) -> None:
    spec = make_spec(
        **deep_merge(CONVERGENCE_SPEC, {"islands": {"count": islands}, "sync": {"quorum": islands}})
    )
    run = local_run(spec)
    start_synchronised(run)
    status = run_to_finish(run, timeout=600)
    run.stop_all(timeout=5)  # free the CPU for the baseline

    torch.set_num_threads(1)  # a shared, busy CPU: more threads only spin
    ref = train_synchronous(spec, num_workers=islands, total_steps=ROUNDS * INNER_STEPS)

    assert status.outer_step == ROUNDS
    # Every merge had every island's H steps: the very tokens the baseline trained on.
    assert status.tokens == ref["tokens"]
    assert status.initial_eval_loss == pytest.approx(ref["initial_eval_loss"], rel=1e-6)
    diloco, sync = status.eval_loss, ref["eval_loss"]
    assert diloco is not None and status.initial_eval_loss is not None
    assert diloco < 0.6 * status.initial_eval_loss, "DiLoCo did not train"
    assert abs(diloco - sync) <= 0.05 * sync, f"DiLoCo {diloco:.4f} vs synchronous {sync:.4f}"
