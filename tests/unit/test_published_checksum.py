"""θ_pub's checksum fed a slice at a time (core/published.RunningChecksum): the CRC-32 the
learner computes (weights_checksum) bit for bit, in order on a worker thread, and computed whole
when the slices did not come in the checksum's order."""

from __future__ import annotations

import struct
import threading
import zlib

import torch
from diloco_trainer.core.compress import SLICE
from diloco_trainer.core.published import (
    RunningChecksum,
    UpdateWriter,
    weights_checksum,
)


def three() -> dict[str, torch.Tensor]:
    # "a" empty, sorted first; "b" two values; "c" one; given out of name order
    return {
        "c": torch.tensor([0.5]),
        "a": torch.empty(0),
        "b": torch.tensor([1.0, -2.0]),
    }


def hand_crc() -> str:
    """CRC-32 over each tensor's 'name|dtype|shape|' and its little-endian fp32 bytes, by name."""
    data = (
        b"a|torch.float32|(0,)|"
        + b"b|torch.float32|(2,)|"
        + struct.pack("<2f", 1.0, -2.0)
        + b"c|torch.float32|(1,)|"
        + struct.pack("<f", 0.5)
    )
    return f"crc32:{zlib.crc32(data):08x}"


def checksum_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("checksum")]


def test_fed_in_order_it_is_the_hand_derived_crc() -> None:
    ts = three()
    assert weights_checksum(ts) == hand_crc()
    crc = RunningChecksum(ts)
    crc.feed("b", slice(0, 1))
    crc.feed("b", slice(1, 2))
    crc.feed("c", slice(0, 1))
    assert crc.follows
    assert crc.result() == hand_crc()
    assert crc.follows  # the running value answered, nothing was computed again
    assert not checksum_threads()  # result() stopped its worker


def test_an_empty_tensor_last_is_in_the_crc() -> None:
    ts = {"a": torch.tensor([3.0]), "z": torch.empty(0, 4)}
    crc = RunningChecksum(ts)
    crc.feed("a", slice(0, 1))
    want = zlib.crc32(
        b"a|torch.float32|(1,)|" + struct.pack("<f", 3.0) + b"z|torch.float32|(0, 4)|"
    )
    assert crc.result() == f"crc32:{want:08x}" == weights_checksum(ts)
    assert crc.follows


def test_out_of_order_a_gap_or_a_missing_end_are_computed_whole() -> None:
    cases = {
        "names out of order": [("c", slice(0, 1)), ("b", slice(0, 2))],
        "a slice skipped": [("b", slice(1, 2)), ("c", slice(0, 1))],
        "a tensor left unfinished": [("b", slice(0, 1)), ("c", slice(0, 1))],
        "the last tensor never fed": [("b", slice(0, 2))],
        "nothing fed": [],
        "a name fed twice": [("b", slice(0, 2)), ("b", slice(0, 2)), ("c", slice(0, 1))],
    }
    for case, feeds in cases.items():
        crc = RunningChecksum(three())
        for name, sl in feeds:
            crc.feed(name, sl)
        assert crc.result() == hand_crc(), case
        assert not crc.follows, case
    assert not checksum_threads()


def test_the_running_value_sees_each_slice_as_fed() -> None:
    """A slice is read once it is fed (it must be final then): the running value is that of the
    values fed, while a changed tensor afterwards makes it differ from the whole CRC, which
    shows the worker's value was the one answered."""
    ts = {"w": torch.arange(6, dtype=torch.float32)}
    before = weights_checksum(ts)
    crc = RunningChecksum(ts)
    crc.feed("w", slice(0, 3))
    crc.feed("w", slice(3, 6))
    crc.close()  # the worker has read every slice
    ts["w"][0] = 100.0
    assert crc.result() == before != weights_checksum(ts)


def test_update_writer_in_name_order_answers_with_the_running_crc() -> None:
    """UpdateWriter's update carries θ_pub's checksum from its slices as written (several slices
    and a ragged tail), equal to weights_checksum of the new θ_pub."""
    gen = torch.Generator().manual_seed(3)
    shapes = {"a": (2 * SLICE + 5,), "b": (7, 9), "c": (0,)}
    exact = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    published = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in exact.items()}
    out = {n: torch.empty_like(t) for n, t in exact.items()}
    writer = UpdateWriter(exact, published, list(shapes), "int8", 1, out)
    for n in sorted(shapes):
        for start in range(0, exact[n].numel(), SLICE):
            writer.slice(n, slice(start, min(exact[n].numel(), start + SLICE)))
    update = writer.finish()
    assert writer.checksum.follows
    assert update.checksum == weights_checksum(out)
    assert update.checksum != weights_checksum(published)  # θ_pub moved
    assert not checksum_threads()
