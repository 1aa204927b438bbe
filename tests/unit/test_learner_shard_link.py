"""A learner's link to two syncer shards over real HTTP (two in-process syncers, each serving
shard i of 2): it joins and heartbeats at both, pushes and pulls each fragment at its owner, and
reads the job as finished only once both shards are; the JSON client given both URLs reads them
as one syncer and sets an island's membership at both."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestServer
from diloco_trainer.api import protocol
from diloco_trainer.api.client import SyncerJsonClient
from diloco_trainer.api.sharding import join_urls
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.learner import syncer_client
from diloco_trainer.learner.syncer_link import SyncerLink
from diloco_trainer.syncer.edge.http import build_app
from diloco_trainer.syncer.edge.shard_scope import wrong_shard_middleware
from diloco_trainer.syncer.service.service import Syncer

from .test_syncer import FakeClock, delta, make_spec, run


def _meta(syncer: Syncer, fragment: int) -> protocol.PushMeta:
    return protocol.PushMeta(
        island="island-0",
        base_version=syncer.state.versions[fragment],
        tokens=100,
        steps=4,
        loss=3.0,
        step_time=0.01,
        codec=syncer.codec,
    )


async def _until(predicate: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _reported(shards: list[Syncer]) -> list[int | None]:
    return [s.state.membership.islands["island-0"].reported_step for s in shards]


def test_link_routes_each_fragment_to_its_shard_and_finishes_with_both(tmp_path: Path) -> None:
    spec = make_spec(
        islands={"count": 1},
        sync={"quorum": 1, "graceSeconds": 0, "fragments": 2},
        syncer={"shards": 2},
        stopAfter={"outerSteps": 1},
    )
    shards = [
        Syncer(spec, job_name="unit", state_dir=tmp_path / f"s{i}", clock=FakeClock(), shard=i)
        for i in range(2)
    ]

    async def scenario() -> dict[str, Any]:
        servers = []
        for i, syncer in enumerate(shards):
            app = build_app(syncer, "tok")
            app.middlewares.append(wrong_shard_middleware(i, 2))
            servers.append(TestServer(app, host="127.0.0.1"))
            await servers[-1].start_server()
        urls = join_urls([str(s.make_url("")).rstrip("/") for s in servers])
        link = SyncerLink(syncer_client.SyncerClient(urls, "tok"), island="island-0", replicas=1)
        seen: dict[str, Any] = {"clients": [c.base_url for c in link.clients]}
        try:
            info = await asyncio.wrap_future(link.submit(link.join(threading.Event())))
            seen["joined"] = [sorted(s.state.membership.islands) for s in shards]
            seen["join_versions"] = info.versions
            link.progress["holding"] = True  # what fragment_sync sets at the step cap
            link.report(step=7, tokens=700, loss=2.5, step_time=0.1)
            seen["progress"] = dict(link.progress)
            link.submit(link.heartbeats(0.05))
            await _until(lambda: _reported(shards) == [7, 7], "heartbeats at both shards")
            one = shards[1]
            encoded = encode_tensors(delta(one, 1, 5), one.codec)
            synced = link.submit(link.sync_fragment(1, encoded, _meta(one, 1)))
            first = await asyncio.wrap_future(synced)
            seen["after_first"] = (first.pulled.version, first.pulled.finished)
            seen["finished_after_first"] = link.finished.is_set()
            zero = shards[0]
            encoded = encode_tensors(delta(zero, 0, 6), zero.codec)
            synced = link.submit(link.sync_fragment(0, encoded, _meta(zero, 0)))
            second = await asyncio.wrap_future(synced)
            seen["after_second"] = (second.pulled.version, second.pulled.finished)
            seen["finished_after_second"] = link.finished.is_set()
            # The drain's heartbeat, sent at once and to every shard.
            link.progress["drained"] = True
            await asyncio.wrap_future(link.submit(link.report_now()))
            seen["drained"] = [s.state.membership.islands["island-0"].drained for s in shards]
            return seen
        finally:
            await asyncio.to_thread(link.close, leave=True)
            seen["left"] = [s.state.membership.islands["island-0"].state for s in shards]
            # The JSON client of the operator and `diloco run`, given every shard's URL.
            async with SyncerJsonClient(urls, "tok") as client:
                seen["status"] = await client.status()
                await client.set_membership("island-0", "dropped", "a test")
            for server in servers:
                await server.close()

    seen = run(scenario())
    assert len(seen["clients"]) == 2
    # report() keeps the flags beside the figures (heartbeats read every key).
    assert seen["progress"] == {
        "step": 7,
        "tokens": 700,
        "loss": 2.5,
        "step_time": 0.1,
        "holding": True,
        "drained": False,
    }
    assert seen["drained"] == [True, True]
    # Both shards hold the membership.
    assert seen["joined"] == [["island-0"], ["island-0"]]
    assert seen["join_versions"] == [0, 0]
    # Fragment 1 merged at shard 1 only, fragment 0 at shard 0 only.
    assert shards[1].state.versions == [0, 1]
    assert shards[0].state.versions == [1, 0]
    # Shard 1 finished first (stopAfter 1 outer step), but the job is not finished until shard 0.
    assert seen["after_first"] == (1, False)
    assert seen["finished_after_first"] is False
    assert seen["after_second"] == (1, True)
    assert seen["finished_after_second"] is True
    # The goodbye reached both shards, then the drop.
    assert seen["left"] == ["left", "left"]
    assert [s.state.membership.islands["island-0"].state for s in shards] == ["dropped"] * 2
    # The status read as one syncer's: each fragment's version from its owner, finished.
    status = seen["status"]
    assert (status.versions, status.outer_step, status.finished) == ([1, 1], 1, True)
    assert status.merge_count == 2


def test_link_hears_its_stop_target_in_a_push_answer(tmp_path: Path) -> None:
    """A stop target set, the next push answer names it (PushAnswer.stop_at), no heartbeat
    needed: the learner's link holds it as it holds a heartbeat's (the lowest heard stands)."""
    spec = make_spec(islands={"count": 1}, sync={"quorum": 1, "graceSeconds": 0})
    syncer = Syncer(spec, job_name="unit", state_dir=tmp_path / "s", clock=FakeClock())

    async def scenario() -> list[int | None]:
        server = TestServer(build_app(syncer, "tok"), host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        link = SyncerLink(syncer_client.SyncerClient(url, "tok"), island="island-0", replicas=1)
        heard = []
        try:
            await asyncio.wrap_future(link.submit(link.join(threading.Event())))
            for target in (None, 896, 1024):
                if target is not None:
                    syncer.islands.targets = {"island-0": target}  # as _set_targets sets them
                encoded = encode_tensors(delta(syncer, 0, 5), syncer.codec)
                await asyncio.wrap_future(
                    link.submit(link.sync_fragment(0, encoded, _meta(syncer, 0)))
                )
                heard.append(link.stop_at)
            return heard
        finally:
            await asyncio.to_thread(link.close, leave=True)
            await server.close()

    assert run(scenario()) == [None, 896, 896]
