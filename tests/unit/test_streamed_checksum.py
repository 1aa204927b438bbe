"""θ_pub's checksum hashed as the merge writes each slice (core/published.StreamedChecksum):
weights_checksum's value when the slices come in name order, and None (the caller hashes the
tensors whole) when they do not."""

from __future__ import annotations

import torch
from diloco_trainer.core.compress import SLICE, slices
from diloco_trainer.core.published import StreamedChecksum, UpdateWriter, weights_checksum


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "b.w": torch.randn(SLICE * 2 + 77, generator=g),  # three slices, the last short
        "a.empty": torch.empty(0),
        "c.bias": torch.randn(5, generator=g),
        "z.empty": torch.empty(0, 3),
    }


def streamed(ts: dict[str, torch.Tensor], order: list[str]) -> str | None:
    sums = StreamedChecksum(ts)
    for name in order:
        for sl in slices(ts[name].numel()):
            sums.add(name, sl)
    return sums.value


def test_slices_in_name_order_give_weights_checksum() -> None:
    ts = tensors()
    assert streamed(ts, sorted(ts)) == weights_checksum(ts)


def test_a_changed_value_changes_it() -> None:
    ts = tensors()
    before = streamed(ts, sorted(ts))
    ts["b.w"][SLICE + 3] += 1.0
    assert streamed(ts, sorted(ts)) not in (before, None)


def test_another_order_or_a_missing_slice_gives_none() -> None:
    ts = tensors()
    assert streamed(ts, ["c.bias", "b.w"]) is None
    sums = StreamedChecksum(ts)
    sums.add("b.w", slice(0, SLICE))
    sums.add("b.w", slice(2 * SLICE, 2 * SLICE + 77))  # skips the middle slice
    assert sums.value is None


def test_the_update_writer_checksum_is_the_whole_pass_one() -> None:
    g = torch.Generator().manual_seed(1)
    names = ["x", "w"]
    exact = {"w": torch.randn(SLICE + 9, generator=g), "x": torch.randn(130, generator=g)}
    published = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in exact.items()}
    for order in (sorted(names), names):  # streamed, then the fallback
        out = {n: torch.empty_like(t) for n, t in published.items()}
        writer = UpdateWriter(exact, published, names, "int8", 1, out)
        for n in order:
            for sl in slices(exact[n].numel()):
                writer.slice(n, sl)
        assert writer.finish().checksum == weights_checksum(out)
