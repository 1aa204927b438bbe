"""θ_pub in its pull body (global_model.py, publisher.py, payloads.SplitBody): with compressed
pulls each fragment's published weights are the data part of its full pull body, served as
they are in memory (no second copy of P); a merge writes the new θ_pub into a new buffer, so a
body being served never changes under its reader; a new outer step gives a new prefix, not a
new copy; the bytes on the wire are exactly safetensors' body."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from diloco_trainer.api import protocol
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.core.published import UpdateWriter, publish_update
from diloco_trainer.syncer.edge import http
from diloco_trainer.syncer.edge.http import build_app
from diloco_trainer.syncer.service.service import Syncer

from .test_syncer import FakeClock, body, delta, make_spec, run, started

Tensors = dict[str, torch.Tensor]


def _spec(pull: str = "int8") -> object:
    return make_spec(
        islands={"count": 1},
        sync={
            "quorum": 1,
            "graceSeconds": 0,
            "compression": "int8",
            "pullCompression": pull,
            "fragments": 2,
        },
    )


def test_body_data_views_serve_as_safetensors_bytes() -> None:
    g = torch.Generator().manual_seed(3)
    tensors = {
        "w": torch.randn(3, 4, generator=g),
        "h": torch.randn(5, generator=g).half(),
        "e": torch.zeros(0),
        "s": torch.tensor(2.5),
        **encode_tensors({"q": torch.randn(300, generator=g)}, "int8"),
    }
    data, views = payloads.body_data(tensors)
    for name, view in views.items():
        view.copy_(tensors[name])
    meta = {"kind": "full", "version": 7}
    split = payloads.split_body(data, tensors, meta)
    want = bytes(payloads.encode_body_buffer(tensors, meta))
    assert bytes(split) == want and len(split) == len(want)
    # The body's data is the views' memory: a write through a view is in the body.
    views["w"][0, 0] = 42.0
    got, _ = payloads.decode_body(payloads.split_body(data, tensors, meta))
    assert float(got["w"][0, 0]) == 42.0


def test_update_writer_into_a_new_buffer_is_bit_for_bit_the_in_place_update() -> None:
    g = torch.Generator().manual_seed(4)
    exact = {"a": torch.randn(5000, generator=g), "b": torch.randn(70, 30, generator=g)}
    pub = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in exact.items()}
    in_place = {n: t.clone() for n, t in pub.items()}
    before = {n: t.clone() for n, t in pub.items()}
    out = {n: torch.empty_like(t) for n, t in pub.items()}
    a = publish_update(exact, in_place, ["a", "b"], "int8", 1)
    b = publish_update(exact, pub, ["a", "b"], "int8", 1, out)
    for n in exact:
        assert torch.equal(out[n], in_place[n])
        assert torch.equal(pub[n], before[n])  # the old θ_pub is untouched
    assert a.checksum == b.checksum
    assert all(torch.equal(a.encoded[k], b.encoded[k]) for k in a.encoded)
    assert isinstance(UpdateWriter(exact, pub, ["a"], "int8", 1, out).out, dict)


def test_published_weights_are_the_served_body_and_a_merge_leaves_the_old_one(
    tmp_path: Path,
) -> None:
    async def scenario() -> tuple[Syncer, list[object], list[bytes], list[int]]:
        syncer = await started(_spec(), tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        first = await syncer.pull(0, after=-1, wait=0)
        old_bytes = bytes(first)  # type: ignore[arg-type]
        ptrs = [syncer.model.published_data[0].data_ptr()]
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 1)))
        await syncer.tick()
        ptrs.append(syncer.model.published_data[0].data_ptr())
        second = await syncer.pull(0, after=0, wait=0)
        # fragment 1 merged: fragment 0's body gets a new outer step, not a new copy
        await syncer.receive_push(1, body(syncer, 1, "island-0", delta(syncer, 1, 2)))
        await syncer.tick()
        third = await syncer.pull(0, after=0, wait=0)
        ptrs.append(syncer.model.published_data[0].data_ptr())
        await syncer.stop()
        return syncer, [first, second, third], [old_bytes], ptrs

    syncer, (first, second, third), (old_bytes,), ptrs = run(scenario())
    for got in (first, second, third):
        assert isinstance(got, payloads.SplitBody)
    # The first body, held by a slow reader through the merge, still reads as it did.
    assert bytes(first) == old_bytes  # type: ignore[arg-type]
    assert payloads.decode_body(old_bytes)[1]["version"] == "0"
    # θ_pub is the second body's data (a new buffer from the merge; the same after the outer
    # step moved: only the prefix changed).
    assert ptrs[0] != ptrs[1] == ptrs[2]
    tensors, meta = payloads.decode_body(third)  # type: ignore[arg-type]
    assert meta["version"] == "1" and meta[protocol.META_OUTER_STEP] == "1"
    assert payloads.decode_body(second)[1][protocol.META_OUTER_STEP] == "0"  # type: ignore[arg-type]
    for name, t in tensors.items():
        assert torch.equal(t, syncer.model.published[name])
    # θ_pub is the lossy copy learners hold, apart from θ_exact
    assert any(not torch.equal(syncer.model.published[n], syncer.model.weights[n]) for n in tensors)


def test_pull_codec_none_serves_a_copy_of_the_exact_weights_once_per_version(
    tmp_path: Path,
) -> None:
    async def scenario() -> tuple[Syncer, bytes, bytes, bytes]:
        syncer = await started(_spec("none"), tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        before = bytes(await syncer.pull(0, after=-1, wait=0))  # type: ignore[arg-type]
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 1)))
        await syncer.tick()
        merged = await syncer.pull(0, after=0, wait=0)
        merged_bytes = bytes(merged)  # type: ignore[arg-type]
        await syncer.receive_push(1, body(syncer, 1, "island-0", delta(syncer, 1, 2)))
        await syncer.tick()  # fragment 0's outer step moves, its weights do not
        moved = await syncer.pull(0, after=0, wait=0)
        assert isinstance(merged, payloads.SplitBody) and isinstance(moved, payloads.SplitBody)
        same_data = merged.parts[0].obj.ctypes.data == moved.parts[0].obj.ctypes.data  # type: ignore[union-attr]
        await syncer.stop()
        assert same_data
        return syncer, before, merged_bytes, bytes(moved)

    syncer, before, merged, moved = run(scenario())
    assert syncer.model.published is syncer.model.weights
    assert syncer.model.published_data == {}
    old = payloads.decode_body(before)[0]
    new, meta = payloads.decode_body(moved)
    assert meta["version"] == "1"
    for name, t in new.items():
        assert torch.equal(t, syncer.model.weights[name])
        assert not torch.equal(t, old[name])
    assert merged[8:] != moved[8:]  # the outer step in the header differs


@pytest.mark.parametrize("piece", [http.SEND_PIECE_BYTES, 1000])
def test_split_body_over_http_is_the_whole_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    # Sent a piece at a time (1000 bytes: hundreds of pieces, the last one short).
    monkeypatch.setattr(http, "SEND_PIECE_BYTES", piece)

    async def scenario() -> tuple[bytes, bytes]:
        syncer = await started(_spec(), tmp_path, FakeClock())
        served = await syncer.pull(1, after=-1, wait=0)
        app = build_app(syncer, "tok")
        async with TestClient(TestServer(app)) as client:
            resp = await client.get(
                protocol.ROUTE_FRAGMENT.format(fragment=1),
                headers={"Authorization": "Bearer tok"},
            )
            assert resp.status == 200
            assert resp.content_length == len(served)  # type: ignore[arg-type]
            got = await resp.read()
        await syncer.stop()
        return bytes(served), got  # type: ignore[arg-type]

    want, got = run(scenario())
    assert got == want
    tensors, meta = payloads.decode_body(got)
    assert meta[protocol.META_KIND] == protocol.KIND_FULL and tensors


def test_a_merge_writes_the_new_published_weights_in_its_folds_accumulator(
    tmp_path: Path,
) -> None:
    async def scenario() -> tuple[int, int, Syncer]:
        syncer = await started(_spec(), tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 1)))
        folded = syncer.model.folds._folds[0]
        assert folded is not None
        acc = next(iter(folded.fold.acc.values())).untyped_storage().data_ptr()
        await syncer.tick()
        await syncer.stop()
        return acc, syncer.model.published_data[0].data_ptr(), syncer

    acc, published, syncer = run(scenario())
    # The accumulator's memory became the new θ_pub and its pull body: no buffer of its own.
    assert acc == published
    assert syncer.state.versions[0] == 1
