"""Compressed pulls in the syncer engine (in-process) and through HTTP to a learner's SyncerLink:
update chains rebuild the published weights bit-exactly, evicted history and far-behind pullers
get the full fragment, a failed checksum falls back to a full pull, and the published weights and
the push-answer table survive a checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestServer
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core import payloads
from diloco_trainer.core.published import apply_updates, weights_checksum
from diloco_trainer.learner import syncer_client
from diloco_trainer.learner.syncer_link import HeldFragment, SyncerLink
from diloco_trainer.syncer.edge.http import build_app
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .test_syncer import FakeClock, body, delta, make_spec, run, started

Tensors = dict[str, torch.Tensor]


def pull_spec(**sync: Any) -> JobSpec:
    """One island, merges at once, checkpoint after every outer step."""
    return make_spec(
        islands={"count": 1},
        sync={"quorum": 1, "graceSeconds": 0, "compression": "int8", **sync},
        syncer={"checkpoint": {"everyOuterSteps": 1, "keep": 2}},
    )


def _wire(body: bytes | bytearray | memoryview | None) -> bytes | None:
    """A pull's body as a client receives it (the syncer serves a view of memory torch wrote)."""
    return None if body is None else bytes(body)


def copy(tensors: Tensors, names: list[str]) -> Tensors:
    return {n: tensors[n].clone() for n in names}


async def merge_rounds(syncer: Syncer, rounds: int, held: list[Tensors]) -> None:
    """`rounds` merges of fragment 0 from island-0; appends the published weights after each."""
    names = syncer.fragments[0]
    for _ in range(rounds):
        v = syncer.state.versions[0]
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 100 + v)))
        await syncer.tick()
        assert syncer.state.versions[0] == v + 1
        held.append(copy(syncer.model.published, names))


def chain_of(raw: bytes) -> tuple[dict[str, str], list[Tensors]]:
    tensors, meta = payloads.decode_body(raw)
    assert meta[protocol.META_KIND] == protocol.KIND_UPDATES, meta
    chain = payloads.split_update_chain(
        tensors, int(meta[protocol.META_FROM_VERSION]), int(meta[protocol.META_VERSION])
    )
    return meta, chain


def test_syncer_pull_update_chains_rebuild_the_published_weights(tmp_path: Path) -> None:
    async def scenario() -> tuple[Syncer, list[Tensors], dict[int, bytes]]:
        syncer = await started(pull_spec(), tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        held = [copy(syncer.model.published, syncer.fragments[0])]
        await merge_rounds(syncer, 4, held)
        bodies = {}
        for have in (-1, 0, 1, 3):
            got = await syncer.pull(0, after=have, wait=0, have=have)
            assert got is not None
            bodies[have] = bytes(got)  # as a client receives it (_wire)
        await syncer.stop()
        return syncer, held, bodies

    syncer, held, bodies = run(scenario())
    names = syncer.fragments[0]
    # θ_exact and θ_pub are different tensors with (slightly) different values.
    assert syncer.model.published is not syncer.model.weights
    assert any(not torch.equal(syncer.model.weights[n], syncer.model.published[n]) for n in names)
    # int8 with maxStaleness 2 keeps 3 updates: a learner at version 0 needs 4 -> full weights.
    full, meta = payloads.decode_body(bodies[0])[0], protocol.read_metadata(bodies[0])
    assert meta[protocol.META_KIND] == protocol.KIND_FULL and meta[protocol.META_VERSION] == "4"
    assert all(torch.equal(full[n], syncer.model.published[n]) for n in names)
    assert protocol.read_metadata(bodies[-1])[protocol.META_KIND] == protocol.KIND_FULL
    for have, length in ((1, 3), (3, 1)):
        meta, chain = chain_of(bodies[have])
        assert len(chain) == length and meta[protocol.META_CODEC] == "int8"
        rebuilt = apply_updates(held[have], chain, meta[protocol.META_CODEC])
        for n in names:
            assert torch.equal(rebuilt[n], syncer.model.published[n]), n
        assert weights_checksum(rebuilt) == meta[protocol.META_CHECKSUM]
        assert len(bodies[have]) < len(bodies[-1]) / (3.5 / length)
    status = run(syncer.status())
    assert status["pulls"] == {"full": 2, "updates": 2}
    assert status["pullCompression"] == "int8"
    assert status["bytesOut"] == sum(len(b) for b in bodies.values())


def test_syncer_pull_compression_none_publishes_the_exact_weights(tmp_path: Path) -> None:
    async def scenario() -> tuple[Syncer, bytes | None]:
        syncer = await started(pull_spec(pullCompression="none"), tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await merge_rounds(syncer, 1, [])
        got = await syncer.pull(0, after=0, wait=0, have=0)
        await syncer.stop()
        return syncer, _wire(got)

    syncer, got = run(scenario())
    assert syncer.model.published is syncer.model.weights  # no second copy
    assert got is not None and protocol.read_metadata(got)[protocol.META_KIND] == protocol.KIND_FULL
    (latest,) = ckpt.list_checkpoints(tmp_path)
    assert not (latest / ckpt.PUBLISHED_FILE).exists()


def test_syncer_pull_checkpoint_keeps_the_published_weights(tmp_path: Path) -> None:
    spec = pull_spec()

    async def first() -> tuple[str, list[Tensors]]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        held = [copy(syncer.model.published, syncer.fragments[0])]
        await merge_rounds(syncer, 2, held)
        await syncer.stop()  # the checkpoint is written in the background
        return syncer.digest(), held

    async def second() -> tuple[Syncer, bytes | None, bytes | None]:
        syncer = await started(spec, tmp_path, FakeClock())
        no_history = await syncer.pull(0, after=1, wait=0, have=1)
        await merge_rounds(syncer, 1, [])
        chain = await syncer.pull(0, after=2, wait=0, have=2)
        await syncer.stop()
        return syncer, _wire(no_history), _wire(chain)

    digest, held = run(first())
    resumed, no_history, chain = run(second())
    assert no_history is not None and chain is not None
    # The resumed syncer has no updates yet: a learner at version 1 gets the full weights once.
    assert protocol.read_metadata(no_history)[protocol.META_KIND] == protocol.KIND_FULL
    assert all(
        torch.equal(t, held[2][n]) for n, t in payloads.decode_body(no_history)[0].items()
    ), "the resumed syncer serves the published weights of its checkpoint"
    # A learner that held version 2 before the restart rebuilds version 3 from the first update.
    meta, updates = chain_of(chain)
    rebuilt = apply_updates(held[2], updates, "int8")
    assert weights_checksum(rebuilt) == meta[protocol.META_CHECKSUM]
    assert all(torch.equal(rebuilt[n], resumed.model.published[n]) for n in rebuilt)
    assert digest != resumed.digest()  # it merged once more since

    # An older checkpoint without published.safetensors: θ_pub starts as θ_exact.
    for path in ckpt.list_checkpoints(tmp_path):
        (path / ckpt.PUBLISHED_FILE).unlink()
        manifest = json.loads((path / ckpt.MANIFEST_FILE).read_text())
        del manifest[ckpt.INTEGRITY_KEY]  # such a syncer recorded no file hashes either
        (path / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest))
    old = run(started(spec, tmp_path, FakeClock()))
    assert old.model.published is not old.model.weights
    assert all(torch.equal(old.model.published[n], t) for n, t in old.model.weights.items())


def test_syncer_retried_push_after_a_restart_counts_once(tmp_path: Path) -> None:
    """A push merged and checkpointed, whose answer was lost in a crash, is retried with the same
    pushId at the restarted syncer: it is answered as a duplicate, not merged a second time."""
    spec = pull_spec(compression="none", maxStaleness=4)

    async def first() -> tuple[bytes, dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        raw = body(syncer, 0, "island-0", delta(syncer, 0, 1), tokens=100, push_id="p-1")
        answer = await syncer.receive_push(0, raw)
        await syncer.tick()
        await syncer.stop()  # the checkpoint of outer step 1 is written
        return raw, answer

    async def second(raw: bytes) -> tuple[Syncer, dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        answer = await syncer.receive_push(0, raw)
        await syncer.stop()
        return syncer, answer

    raw, answer = run(first())
    resumed, retried = run(second(raw))
    # The first answer again, named by the run that gives it (its merge is this run's version)
    assert retried == {**answer, "duplicate": True, "run": resumed.run}
    assert resumed.run != answer["run"]
    assert resumed.state.rounds[0].pending == {}
    assert resumed.tokens == 100 and resumed.state.versions == [1]


@contextlib.asynccontextmanager
async def served_link(
    tmp_path: Path, spec: JobSpec | None = None, joined: tuple[str, ...] = ("island-0",)
) -> AsyncIterator[tuple[Syncer, SyncerLink]]:
    """A syncer (`spec`, default pull_spec; `joined` islands joined) behind a real HTTP server,
    and island-0's learner link."""
    syncer = Syncer(spec or pull_spec(), job_name="unit", state_dir=tmp_path, clock=FakeClock())
    server = TestServer(build_app(syncer, "tok"), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    link = SyncerLink(syncer_client.SyncerClient(url, "tok"), island="island-0", replicas=1)
    try:
        for island in joined:
            await syncer.islands.join(island, 1)
        yield syncer, link
    finally:
        await asyncio.to_thread(link.close, leave=False)
        await server.close()


def test_syncer_link_rebuilds_from_updates_and_falls_back_on_a_bad_checksum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Over HTTP, as a learner's rank 0 pulls: a chain applied to the right base is taken; applied
    to a base that differs in one value it fails the checksum, and the full fragment is pulled."""
    caplog.set_level(logging.WARNING, logger="diloco.learner")

    async def scenario() -> tuple[Syncer, list[Any], dict[str, int]]:
        async with served_link(tmp_path) as (syncer, link):
            held = [copy(syncer.model.published, syncer.fragments[0])]
            await merge_rounds(syncer, 2, held)
            good = HeldFragment(version=1, tensors=held[1])
            bad_tensors = copy(held[1], list(held[1]))
            next(iter(bad_tensors.values())).view(-1)[0] += 1e-3
            bad = HeldFragment(version=1, tensors=bad_tensors)
            pulled = []
            for h in (good, bad):
                future = link.submit(link._pull_newer(0, 1, h))
                got, on_device = await asyncio.wrap_future(future)
                assert on_device is None  # a learner on the CPU holds no device copy
                pulled.append(got)
            return syncer, pulled, dict(link.pull_counts)

    syncer, (from_chain, from_full), counts = run(scenario())
    for got in (from_chain, from_full):
        assert got.version == 2
        assert all(torch.equal(t, syncer.model.published[n]) for n, t in got.tensors.items())
    assert counts == {"updates": 1, "rebuildFailed": 1}
    assert syncer.publisher.pulls == {"full": 1, "updates": 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("do not rebuild" in m and "checksum" in m for m in warnings), warnings
