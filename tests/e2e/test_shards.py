"""`syncer.shards: 2` end to end, with real processes (`diloco run`'s LocalRun): a gpt-tiny job of
two islands and two fragments, each fragment merged only by its shard; the learners pull both;
`diloco export` (from the running shards and from their checkpoints) gives the shards' weights;
one shard SIGKILLed and restarted from its checkpoint loses at most its checkpoint cadence while
the other keeps merging, and the job finishes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.payloads import PulledFragment
from diloco_trainer.export import from_checkpoint, pull_snapshot
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.local import launch, syncer_shards
from diloco_trainer.local.run import LocalRun
from diloco_trainer.local.syncer_shards import SyncerShards

from .conftest import http_request, restart_safe_port, wait_until
from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    local_run,
    run_to_finish,
    start_synchronised,
)

pytestmark = pytest.mark.e2e

APPLIED = re.compile(r"fragment (\d+) applied version (\d+)")


def shards_of(run: LocalRun) -> SyncerShards:
    assert isinstance(run.syncer, SyncerShards)
    return run.syncer


def shard_status(run: LocalRun, shard: int) -> dict[str, Any]:
    """Shard `shard`'s own /v1/status document."""
    assert run.files is not None
    url = shards_of(run).urls[shard]
    code, doc = http_request("GET", url + "/v1/status", token=run.files.token)
    assert code == 200, (code, doc)
    return doc


def applied(run: LocalRun) -> dict[int, int]:
    """The newest version of each fragment any learner applied (from their logs)."""
    newest: dict[int, int] = {}
    for proc in run.learners:
        for f, v in APPLIED.findall(proc.log_text()):
            newest[int(f)] = max(newest.get(int(f), 0), int(v))
    return newest


async def pull_own(run: LocalRun) -> dict[str, torch.Tensor]:
    """Each fragment pulled straight from the shard that owns it (shard f of 2)."""
    assert run.files is not None
    weights: dict[str, torch.Tensor] = {}
    for f, url in enumerate(shards_of(run).urls):
        async with SyncerClient(url, run.files.token) as client:
            pulled = await client.pull_fragment(f)
            assert isinstance(pulled, PulledFragment)
            weights.update(pulled.tensors)
    return weights


def shard_spec(make_spec: Callable[..., JobSpec], **overrides: Any) -> JobSpec:
    base: dict[str, Any] = {
        "islands": {"count": 2},
        "sync": {"fragments": 2, "quorum": 2, "graceSeconds": 0.2, "compression": "none"},
        "syncer": {"shards": 2, "checkpoint": {"everyOuterSteps": 1, "keep": 2}},
    }
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value}
    return make_spec(**base)


def test_two_shards_merge_their_fragments_and_export_assembles_them(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    # K = M: each shard waits for an island that has not joined yet (Membership.expect) while
    # the learners start on a busy machine: every merge has both islands' pushes.
    spec = shard_spec(make_spec, sync={"heartbeatTimeoutSeconds": 120}, stopAfter={"outerSteps": 3})
    run = local_run(spec)
    start_synchronised(run)
    status = run_to_finish(run, timeout=600)
    assert status.finished and status.outer_step == 3
    # Each shard merged its own fragment only (the other stays at version 0 there).
    zero, one = shard_status(run, 0), shard_status(run, 1)
    assert zero["versions"][0] >= 3 and zero["versions"][1] == 0, zero["versions"]
    assert one["versions"][1] >= 3 and one["versions"][0] == 0, one["versions"]
    assert status.versions == [zero["versions"][0], one["versions"][1]]
    # Both islands pushed to both shards, and learners applied merged versions from both.
    for doc in (zero, one):
        islands = {c["island"] for m in doc["merges"] for c in m["contributors"]}
        assert islands == {"island-0", "island-1"}
    seen = applied(run)
    assert seen.get(0, 0) >= 1 and seen.get(1, 0) >= 1, seen
    # A shard refuses another shard's fragment, naming the owner.
    assert run.files is not None
    code, doc = http_request(
        "GET", shards_of(run).urls[0] + "/v1/fragments/1", token=run.files.token
    )
    assert code == 421 and doc["code"] == "wrong_shard", (code, doc)
    assert "fragment 1 belongs to syncer shard 1 of 2" in doc["error"]
    # The export from the running shards equals each shard's own weights of its fragment...
    assert run.files is not None
    exported, meta = asyncio.run(pull_snapshot(run.url, run.files.token))
    own = asyncio.run(pull_own(run))
    assert set(exported) == set(own)
    assert all(torch.equal(exported[n], own[n]) for n in own)
    assert meta["outerStep"] == "3"
    # ...and, once the shards stopped (a final checkpoint each), so does the export of their
    # checkpoints (compression none: the pulled weights are the exact ones).
    run.wait_learners(120)
    run.stop_all(timeout=30)
    from_disk, disk_meta = from_checkpoint(run.workdir / "syncer")
    assert all(torch.equal(from_disk[n], own[n]) for n in own)
    assert disk_meta["shards"] == "2"


def test_a_shard_killed_and_restarted_loses_at_most_its_cadence_while_the_other_merges(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The shards' ports outside the ephemeral range, so shard 1's is still free when it restarts.
    monkeypatch.setattr(syncer_shards, "free_port", restart_safe_port)
    cadence = 2
    spec = shard_spec(
        make_spec,
        inner={"steps": 5},
        sync={"heartbeatTimeoutSeconds": 20},
        stopAfter={"outerSteps": 10},
        syncer={"checkpoint": {"everyOuterSteps": cadence, "keep": 2}, "evalEveryOuterSteps": 1000},
    )
    run = local_run(spec)
    start_synchronised(run)
    wait_until(
        lambda: shard_status(run, 1)["outerStep"] >= 3, timeout=300, what="3 outer steps at shard 1"
    )
    group = shards_of(run)
    before = shard_status(run, 1)["outerStep"]
    other_before = shard_status(run, 0)["versions"][0]
    group.procs[1].kill()
    group.procs[1].wait()
    # Shard 0 keeps merging while shard 1 is down.
    wait_until(
        lambda: shard_status(run, 0)["versions"][0] >= other_before + 2,
        timeout=300,
        what="two merges at shard 0 while shard 1 is down",
    )
    assert not group.procs[1].alive
    group.start(1)  # same port, same state dir: it resumes from its newest checkpoint
    resumed = shard_status(run, 1)
    assert resumed["resumedFrom"] is not None
    assert resumed["outerStep"] >= before - cadence
    status = run_to_finish(run, timeout=600)
    assert status.finished and status.outer_step == 10
    # Both islands carried on with the restarted shard: it merged again after the restart.
    after = shard_status(run, 1)
    assert after["versions"][1] > resumed["versions"][1]
    run.wait_learners(120)
    assert [p.returncode for p in run.learners] == [0, 0]


def test_a_syncer_told_a_shard_the_job_does_not_have_exits_2_naming_it(
    make_spec: Callable[..., JobSpec], workdir: Path
) -> None:
    files = launch.write_job_files(shard_spec(make_spec), workdir / "job")
    proc = launch.start_syncer(
        files,
        port=launch.free_port(),
        state_dir=workdir / "state",
        job_name="test",
        log_file=workdir / "syncer.log",
        shard=2,
    )
    assert proc.wait(timeout=120) == 2
    log = proc.log_text()
    assert "DILOCO_SYNCER_SHARD=2 is not a shard of syncer.shards (2)" in log
    assert "Traceback" not in log
