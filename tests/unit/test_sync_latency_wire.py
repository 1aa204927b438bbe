"""The sync latency on the wire (sync.overlapMode auto): a pull body says its merge's seconds
(protocol.META_MERGE_SECONDS), a learner's client reads it, and a learner's sync over HTTP to
a real syncer reports a latency that holds it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from diloco_trainer.api import protocol
from diloco_trainer.learner import syncer_client
from diloco_trainer.learner.push_encoding import encode_delta
from diloco_trainer.learner.syncer_link import HeldFragment
from diloco_trainer.syncer.edge.http import build_app
from diloco_trainer.syncer.service.service import Syncer

from .test_syncer import FakeClock, delta, run
from .test_syncer_pull import copy, merge_rounds, pull_spec, served_link


def test_pull_bodies_carry_the_merge_seconds_and_the_client_reads_them(tmp_path: Path) -> None:
    async def scenario() -> dict[str, Any]:
        syncer = Syncer(pull_spec(), job_name="unit", state_dir=tmp_path, clock=FakeClock())
        server = TestServer(build_app(syncer, "tok"), host="127.0.0.1")
        await server.start_server()
        client = syncer_client.SyncerClient(str(server.make_url("")).rstrip("/"), "tok")
        try:
            await syncer.islands.join("island-0", 1)
            out: dict[str, Any] = {"start": bytes(await syncer.pull(0, after=-1, wait=0, have=-1))}
            held = [copy(syncer.model.published, syncer.fragments[0])]
            await merge_rounds(syncer, 2, held)
            out["full"] = bytes(await syncer.pull(0, after=-1, wait=0, have=-1))
            out["chain"] = bytes(await syncer.pull(0, after=1, wait=0, have=1))
            out["client_full"] = await client.pull_fragment(0, after=-1)
            out["client_chain"] = await client.pull_fragment(0, after=1, have=1)
            out["merges"] = (await syncer.status())["merges"]
            return out
        finally:
            await client.close()
            await server.close()

    got = run(scenario())
    assert protocol.META_MERGE_SECONDS not in protocol.read_metadata(got["start"])
    last = next(m for m in got["merges"] if m["version"] == 2)
    seconds = {}
    for kind in ("full", "chain"):
        meta = protocol.read_metadata(got[kind])
        seconds[kind] = protocol.meta_seconds(meta, protocol.META_MERGE_SECONDS)
        assert seconds[kind] is not None
        # Timed up to the body's encoding: within the merge's mergeSeconds (to the install).
        assert 0 <= seconds[kind] <= last["mergeSeconds"] + 1e-6, (kind, meta, last)
    assert seconds["full"] == seconds["chain"]
    for kind, raw in (("client_full", got["full"]), ("client_chain", got["chain"])):
        cost = got[kind].cost
        assert cost.merge_seconds == seconds["full"] and cost.body_bytes == len(raw), kind
        # The syncer said how long it held the request: the pull's own time is known.
        assert cost.pull_seconds is not None and cost.pull_seconds >= 0, kind


def test_pull_seconds_is_the_pull_less_the_syncers_hold() -> None:
    header = protocol.HEADER_HELD_SECONDS
    assert syncer_client.pull_seconds(0.5, {header: "0.3"}) == pytest.approx(0.2)
    assert syncer_client.pull_seconds(0.5, {header.lower(): "0.125"}) == pytest.approx(0.375)
    assert syncer_client.pull_seconds(0.2, {header: "0.3"}) == 0.0  # clocks apart: never < 0
    assert syncer_client.pull_seconds(0.5, {}) is None  # an older syncer
    assert syncer_client.pull_seconds(0.5, {header: "soon"}) is None


def test_meta_seconds_ignores_what_is_not_a_duration() -> None:
    key = protocol.META_MERGE_SECONDS
    assert protocol.meta_seconds({key: "0.25"}, key) == 0.25
    for bad in ("-1", "NaN", "Infinity", "x", "[1]", "true", '"0.5"'):
        assert protocol.meta_seconds({key: bad}, key) is None, bad
    assert protocol.meta_seconds({}, key) is None


def test_a_learner_sync_over_http_reports_its_latency(tmp_path: Path) -> None:
    async def scenario() -> tuple[Any, float]:
        async with served_link(tmp_path) as (syncer, link):
            names = syncer.fragments[0]
            held = HeldFragment(version=0, tensors=copy(syncer.model.published, names))
            encoded = encode_delta(delta(syncer, 0, 7), "int8", None)
            meta = protocol.PushMeta(
                island="island-0",
                base_version=0,
                tokens=100,
                steps=4,
                loss=3.0,
                step_time=0.01,
                codec="int8",
            )
            began = asyncio.get_running_loop().time()
            future = link.submit(link.sync_fragment(0, encoded, meta, held))
            result = await asyncio.wrap_future(future)
            return result, asyncio.get_running_loop().time() - began

    result, elapsed = run(scenario())
    assert result.outcome == "merged" and result.pulled.version == 1
    assert result.pulled.cost.merge_seconds is not None
    assert result.pulled.cost.pull_seconds is not None
    assert result.latency is not None
    # The push, the merge and the pull estimate: at least the merge, at most the whole sync
    # plus the pull estimate (a pull the size of the push, at the push's rate).
    assert result.pulled.cost.merge_seconds <= result.latency <= 3 * elapsed, (result, elapsed)
