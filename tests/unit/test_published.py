"""Compressed pulls, the pure parts: published updates rebuild bit-exactly, the residual is carried,
the checksum notices changes, and the update history keeps only chains worth sending."""

from __future__ import annotations

import itertools

import pytest
import torch
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import decode_tensor, encode_tensors
from diloco_trainer.core.published import (
    SLICED_ADD,
    WeightUpdate,
    apply_updates,
    history_length,
    publish_update,
    weights_checksum,
)

SHAPES = {"emb": (37, 16), "w": (16, 48), "b": (48,), "gain": ()}


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(s, generator=g) for n, s in SHAPES.items()}


def outer_steps(codec: str, rounds: int) -> tuple[list[dict], list[WeightUpdate], dict]:
    """Exact weights moved by random 'outer steps'; after each, one published update. Returns
    the published weights after every version (index = version), the updates and the exact."""
    exact = tensors(0)
    published = {n: t.clone() for n, t in exact.items()}
    history = [{n: t.clone() for n, t in published.items()}]
    updates = []
    for v in range(1, rounds + 1):
        for n, t in tensors(v, scale=1e-2).items():
            exact[n] += t
        updates.append(publish_update(exact, published, list(SHAPES), codec, v))
        history.append({n: t.clone() for n, t in published.items()})
    return history, updates, exact


@pytest.mark.parametrize("codec", ["int8", "int4", "fp16", "bf16"])
def test_published_chain_rebuilds_the_syncer_weights_bit_exactly(codec: str) -> None:
    history, updates, exact = outer_steps(codec, rounds=5)
    for held in range(5):
        chain = [u.encoded for u in updates[held:]]
        # Through the wire format, as a learner receives them.
        body = payloads.encode_update_chain(
            [(u.version, u.encoded) for u in updates[held:]], {"kind": "updates"}
        )
        received = payloads.split_update_chain(payloads.decode_body(body)[0], held, 5)
        for rebuilt in (
            apply_updates(history[held], chain, codec),
            apply_updates(history[held], received, codec),
        ):
            for n in SHAPES:
                assert torch.equal(rebuilt[n], history[5][n]), (codec, held, n)
            assert weights_checksum(rebuilt) == updates[-1].checksum
    # The base a learner holds is never written to.
    assert torch.equal(history[0]["w"], tensors(0)["w"])
    # Lossy codecs: the published weights differ from the exact ones, by less than the last
    # update's rounding (the updates move them by ~1e-2 per value).
    gap = max(float((exact[n] - history[5][n]).abs().max()) for n in SHAPES)
    assert 0 < gap < 5e-3


def test_published_residual_is_carried_into_the_next_update() -> None:
    """What int4 drops in one update is sent with the next: with the exact weights standing
    still, every update shrinks the gap (error feedback without a separate residual)."""
    exact = tensors(0)
    published = {n: t - 0.1 * torch.sign(t) for n, t in exact.items()}

    def gap() -> float:
        return max(float((exact[n] - published[n]).abs().max()) for n in SHAPES)

    gaps = [gap()]
    for v in range(1, 4):
        publish_update(exact, published, list(SHAPES), "int4", v)
        gaps.append(gap())
    # int4 leaves at most half a step of absmax/7 per block: the gap falls by >= 7x each time.
    assert all(b <= a / 7 for a, b in itertools.pairwise(gaps)), gaps
    assert gaps[-1] < 1e-3 * gaps[0]


def test_published_checksum_sees_one_changed_or_swapped_value() -> None:
    base = tensors(3)
    ref = weights_checksum(base)
    assert (
        ref.startswith("crc32:")
        and weights_checksum({n: t.clone() for n, t in base.items()}) == ref
    )
    flipped = {n: t.clone() for n, t in base.items()}
    bits = flipped["w"].view(torch.int32)
    bits[5, 7] ^= 1  # the lowest mantissa bit of one value
    assert weights_checksum(flipped) != ref
    swapped = {n: t.clone() for n, t in base.items()}
    swapped["b"][[0, 1]] = swapped["b"][[1, 0]]
    assert weights_checksum(swapped) != ref


def test_published_apply_updates_refuses_a_chain_for_other_shapes() -> None:
    _, updates, _ = outer_steps("int8", rounds=1)
    base = tensors(0)
    base["w"] = torch.zeros(16, 47)
    with pytest.raises(ValueError, match="w"):
        apply_updates(base, [updates[0].encoded], "int8")


@pytest.mark.parametrize(
    ("codec", "max_staleness", "want"),
    [
        ("int8", 4, 3),  # 4 int8 updates (3.88x smaller each) would outweigh the fragment
        ("int4", 4, 5),  # maxStaleness + 1
        ("int4", 20, 7),
        ("int4", 0, 2),  # at least 2: one more merge may land before the pull
        ("fp16", 4, 1),  # two fp16 updates weigh as much as the fp32 fragment
    ],
)
def test_published_history_length(codec: str, max_staleness: int, want: int) -> None:
    from diloco_trainer.core.compress import expected_encoded

    shapes = {"w": torch.Size([256, 512])}
    full = 256 * 512 * 4
    upd = sum(s.numel() * d.itemsize for d, s in expected_encoded(shapes, codec).values())
    assert history_length(full, upd, max_staleness) == want


@pytest.mark.parametrize("codec", ["int8", "int4", "bf16", "fp16", "none"])
def test_published_update_streamed_by_slices_gives_the_whole_tensor_bytes(codec: str) -> None:
    """publish_update works a slice at a time; the update, θ_pub and the checksum are what the
    whole-tensor encoding (the reference below: encode u, decode, add) gives, bit for bit, for
    tensors of several slices with ragged (odd, part-block) tails."""
    from diloco_trainer.core.compress import SLICE, decode_tensors, encode_tensors

    gen = torch.Generator().manual_seed(5)
    shapes = {"big": (2 * SLICE + 77,), "mat": (SLICE // 64, 160), "odd": (3,)}
    exact = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    published = {
        n: t + 1e-2 * torch.randn(s, generator=gen)
        for (n, t), s in zip(exact.items(), shapes.values(), strict=True)
    }
    reference = {n: t.clone() for n, t in published.items()}
    want = encode_tensors({n: exact[n] - reference[n] for n in shapes}, codec)
    decoded = decode_tensors(want, codec, {n: torch.Size(s) for n, s in shapes.items()})
    for n in shapes:
        reference[n].add_(decoded[n])
    update = publish_update(exact, published, list(shapes), codec, 4)
    assert update.encoded.keys() == want.keys()
    for key, t in want.items():
        assert update.encoded[key].dtype == t.dtype and torch.equal(update.encoded[key], t), key
    for n in shapes:
        assert torch.equal(published[n], reference[n]), n
    assert update.checksum == weights_checksum(reference)
    assert update.nbytes == sum(t.numel() * t.element_size() for t in want.values())


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_published_update_of_zero_and_flushed_blocks_is_the_codecs(codec: str) -> None:
    """Blocks where θ_exact = θ_pub (u = 0), blocks of denormal differences (below
    FLUSH_TO_ZERO: sent as zeros with scale 0) and a ragged last block: the slice-wise update
    gives the codec's own bytes, and θ_pub moves exactly by their decoded values."""
    from diloco_trainer.core.compress import BLOCK_SIZE, decode_tensors, encode_tensors

    gen = torch.Generator().manual_seed(9)
    n = 5 * BLOCK_SIZE + 3
    published = {"w": torch.randn(n, generator=gen)}
    exact = {"w": published["w"].clone()}
    exact["w"][BLOCK_SIZE : 2 * BLOCK_SIZE] += 1e-2  # a live block
    exact["w"][3 * BLOCK_SIZE] = published["w"][3 * BLOCK_SIZE] + 1e-3  # one value live
    tiny = torch.zeros(n)
    tiny[2 * BLOCK_SIZE : 3 * BLOCK_SIZE] = 1e-39  # a denormal block, flushed to zero
    u = (exact["w"] - published["w"]) + tiny
    exact["w"] = published["w"] + u
    want = encode_tensors({"w": exact["w"] - published["w"]}, codec)
    scales = want["w::scale"]
    assert scales[0] == 0 and scales[2] == 0 and scales[1] > 0 and scales[5] == 0
    moved = published["w"] + decode_tensors(want, codec, {"w": torch.Size([n])})["w"]
    update = publish_update(exact, published, ["w"], codec, 1)
    for key, t in want.items():
        assert torch.equal(update.encoded[key], t), key
    assert torch.equal(published["w"], moved)
    assert torch.equal(published["w"][:BLOCK_SIZE], exact["w"][:BLOCK_SIZE])  # u = 0: no move


@pytest.mark.parametrize("codec", ["int8", "int4", "none"])
def test_published_apply_updates_on_the_host_by_slices_is_the_whole_tensor_sum(codec: str) -> None:
    # Over SLICED_ADD, in slices and a short, padded last one (compress.SLICE); under it, a
    # matrix and a scalar, decoded whole.
    shapes = {"big": (SLICED_ADD + 300,), "w": (16, 48), "gain": ()}
    g = torch.Generator().manual_seed(6)
    base = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    chain = [
        encode_tensors({n: 1e-2 * torch.randn(s, generator=g) for n, s in shapes.items()}, codec)
        for _ in range(2)
    ]
    want = {n: t.clone() for n, t in base.items()}
    for encoded in chain:
        for n, t in want.items():
            t.add_(decode_tensor(encoded, n, codec, t.shape))
    rebuilt = apply_updates(base, chain, codec)
    for n in shapes:
        assert torch.equal(rebuilt[n].view(torch.int32), want[n].view(torch.int32)), n
        assert not torch.equal(rebuilt[n], base[n]), n  # the updates moved every tensor
