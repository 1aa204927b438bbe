"""Pseudo-gradient codecs: error bounds, sizes, validation, error feedback."""

from __future__ import annotations

import pytest
import torch
from diloco_trainer.core.compress import (
    BLOCK_SIZE,
    CODECS,
    ErrorFeedback,
    decode_tensors,
    encode_tensors,
    encoded_nbytes,
)
from safetensors.torch import load, save


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "h.0.attn.weight": torch.randn(16, 24, generator=g) * 1e-3,
        "h.0.attn.bias": torch.randn(7, generator=g),  # odd length: int4 padding
        "outlier": torch.cat([torch.randn(300, generator=g), torch.tensor([1e4])]),
        "zeros": torch.zeros(5, 3),
        "scalar": torch.tensor(0.5),
    }


def _shapes(ts: dict[str, torch.Tensor]) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in ts.items()}


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per-element absmax of the element's block."""
    flat = x.reshape(-1)
    n = flat.numel()
    nb = -(-n // BLOCK_SIZE)
    padded = torch.zeros(nb * BLOCK_SIZE)
    padded[:n] = flat.abs()
    return padded.view(nb, BLOCK_SIZE).amax(1).repeat_interleave(BLOCK_SIZE)[:n]


@pytest.mark.parametrize("codec", CODECS)
def test_decode_tensors_round_trip_is_fp32_with_model_shapes(codec: str) -> None:
    ts = _tensors()
    out = decode_tensors(encode_tensors(ts, codec), codec, _shapes(ts))
    assert set(out) == set(ts)
    for name, t in ts.items():
        assert out[name].dtype == torch.float32
        assert out[name].shape == t.shape
    assert torch.equal(out["zeros"], ts["zeros"])


def test_codec_none_is_lossless() -> None:
    ts = _tensors()
    out = decode_tensors(encode_tensors(ts, "none"), "none", _shapes(ts))
    assert all(torch.equal(out[k], ts[k]) for k in ts)


@pytest.mark.parametrize(("codec", "qmax"), [("int8", 127), ("int4", 7)])
def test_int_codecs_error_is_at_most_half_a_step_per_block(codec: str, qmax: int) -> None:
    ts = _tensors()
    out = decode_tensors(encode_tensors(ts, codec), codec, _shapes(ts))
    for name, t in ts.items():
        bound = _block_absmax(t) / qmax / 2
        err = (out[name] - t).reshape(-1).abs()
        assert (err <= bound * (1 + 1e-5) + 1e-12).all(), name
    # The outlier only coarsens its own block: the first block keeps a fine grid.
    first = (out["outlier"][:BLOCK_SIZE] - ts["outlier"][:BLOCK_SIZE]).abs().max()
    assert first < 1.0


# Half a unit in the last place; fp16 has a fixed absolute step of 2**-24 below 2**-14
# (subnormals), which matters for tiny pseudo-gradients.
@pytest.mark.parametrize(("codec", "rel", "abs_"), [("fp16", 2**-11, 2**-25), ("bf16", 2**-8, 0)])
def test_float_codecs_relative_error(codec: str, rel: float, abs_: float) -> None:
    ts = _tensors()
    out = decode_tensors(encode_tensors(ts, codec), codec, _shapes(ts))
    for name in ("h.0.attn.weight", "h.0.attn.bias"):
        w = ts[name]
        assert ((out[name] - w).abs() <= rel * w.abs() + abs_).all(), name


def test_encode_tensors_int_layout_and_sizes() -> None:
    x = {"w": torch.randn(1000)}
    int8 = encode_tensors(x, "int8")
    int4 = encode_tensors(x, "int4")
    assert set(int8) == {"w::q", "w::scale"}
    assert int8["w::q"].dtype == torch.int8 and int8["w::q"].shape == (1000,)
    assert int4["w::q"].dtype == torch.uint8 and int4["w::q"].shape == (500,)
    assert int8["w::scale"].dtype == torch.float32 and int8["w::scale"].shape == (8,)
    assert int8["w::q"].abs().max() == 127  # the block absmax maps to the grid's end
    assert encoded_nbytes(encode_tensors(x, "none")) == 4000
    assert encoded_nbytes(encode_tensors(x, "bf16")) == 2000
    assert encoded_nbytes(int8) == 1000 + 8 * 4
    assert encoded_nbytes(int4) == 500 + 8 * 4
    assert all(t.is_contiguous() for t in int4.values())


def test_int4_packs_known_values() -> None:
    x = torch.tensor([7.0, -7.0, 0.0, 1.0, -1.0])  # absmax 7 -> scale 1: exact
    enc = encode_tensors({"v": x}, "int4")
    # (7+8) | (-7+8) << 4 = 15 | 16; (0+8) | (1+8) << 4; (-1+8) | padding zero (8) << 4
    assert enc["v::q"].tolist() == [15 | (1 << 4), 8 | (9 << 4), 7 | (8 << 4)]
    assert torch.equal(decode_tensors(enc, "int4", {"v": x.shape})["v"], x)


def test_decode_tensors_rejects_wrong_shape_with_clear_message() -> None:
    enc = encode_tensors({"h.0.attn.weight": torch.randn(3)}, "int8")
    with pytest.raises(ValueError) as err:
        decode_tensors(enc, "int8", {"h.0.attn.weight": torch.Size([16])})
    assert str(err.value) == (
        "pseudo-gradient 'h.0.attn.weight::q' has shape (3,) but the model expects (16,)"
    )


def test_decode_tensors_rejects_missing_and_extra_names() -> None:
    enc = encode_tensors({"a": torch.randn(4), "b": torch.randn(4)}, "fp16")
    with pytest.raises(ValueError, match=r"missing: 'c'.*unexpected: 'b'"):
        decode_tensors(enc, "fp16", {"a": torch.Size([4]), "c": torch.Size([4])})


@pytest.mark.parametrize(
    ("codec", "key", "bad"),
    [
        ("none", "a", torch.zeros(4, dtype=torch.float64)),
        ("bf16", "a", torch.zeros(4, dtype=torch.float16)),
        ("int8", "a::q", torch.zeros(4, dtype=torch.uint8)),
        ("int4", "a::scale", torch.zeros(1, dtype=torch.float16)),
    ],
)
def test_decode_tensors_rejects_wrong_dtype(codec: str, key: str, bad: torch.Tensor) -> None:
    enc = encode_tensors({"a": torch.randn(4)}, codec)
    enc[key] = bad
    with pytest.raises(ValueError, match=rf"'{key}' has dtype"):
        decode_tensors(enc, codec, {"a": torch.Size([4])})


@pytest.mark.parametrize(("codec", "key"), [("none", "a"), ("fp16", "a"), ("int4", "a::scale")])
def test_decode_tensors_rejects_non_finite(codec: str, key: str) -> None:
    enc = encode_tensors({"a": torch.randn(4)}, codec)
    enc[key] = enc[key].clone()
    enc[key][0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        decode_tensors(enc, codec, {"a": torch.Size([4])})
    enc[key][0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        decode_tensors(enc, codec, {"a": torch.Size([4])})


def test_decode_tensors_rejects_int8_minus_128() -> None:
    enc = encode_tensors({"a": torch.randn(4)}, "int8")
    enc["a::q"][1] = -128
    with pytest.raises(ValueError, match="-128"):
        decode_tensors(enc, "int8", {"a": torch.Size([4])})


def test_encode_tensors_unknown_codec_names_field() -> None:
    with pytest.raises(ValueError, match=r"sync\.compression 'int2'"):
        encode_tensors({"a": torch.zeros(1)}, "int2")


def test_error_feedback_carries_what_the_codec_dropped() -> None:
    g = torch.Generator().manual_seed(1)
    deltas = [torch.randn(512, generator=g) for _ in range(20)]
    ef = ErrorFeedback()
    sent_total = torch.zeros(512)
    for d in deltas:
        sent = ef.compensate("w", d)
        dec = decode_tensors(encode_tensors({"w": sent}, "int4"), "int4", {"w": d.shape})["w"]
        ef.record("w", sent, dec)
        sent_total += dec
    true_total = torch.stack(deltas).sum(0)
    # With feedback the running sum is off by only the last residual (one quantisation error);
    # without it the per-round errors add up.
    with_ef = (sent_total - true_total).abs().max()
    assert torch.allclose(sent_total + ef.residuals["w"], true_total, atol=1e-4)
    no_ef = sum(
        decode_tensors(encode_tensors({"w": d}, "int4"), "int4", {"w": d.shape})["w"] - d
        for d in deltas
    )
    assert with_ef < 0.5 * no_ef.abs().max()


def test_error_feedback_first_compensate_is_a_copy_and_state_round_trips() -> None:
    ef = ErrorFeedback()
    d = torch.ones(3)
    out = ef.compensate("w", d)
    out += 1
    assert torch.equal(d, torch.ones(3))
    ef.record("w", torch.ones(3), torch.zeros(3))
    other = ErrorFeedback()
    other.load_state_tensors(ef.state_tensors())
    assert torch.equal(other.compensate("w", torch.zeros(3)), torch.ones(3))
    with pytest.raises(ValueError, match="shape"):
        other.compensate("w", torch.zeros(4))
    other.reset(["w"])
    assert torch.equal(other.compensate("w", torch.zeros(3)), torch.zeros(3))


@pytest.mark.parametrize("codec", CODECS)
def test_encode_tensors_survives_safetensors_even_from_a_flat_buffer(codec: str) -> None:
    # Learners may hold parameters as views of one flat buffer; encoded tensors must not share
    # memory (safetensors refuses that) nor alias the caller's buffer.
    flat = torch.randn(300)
    views = {"a": flat[:130].view(10, 13), "b": flat[130:]}
    enc = encode_tensors(views, codec)
    flat.zero_()
    dec = decode_tensors(
        load(save(enc)), codec, {"a": torch.Size([10, 13]), "b": torch.Size([170])}
    )
    assert float(dec["a"].abs().sum()) > 0 and float(dec["b"].abs().sum()) > 0


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_int_codecs_flush_denormal_blocks_to_zero(codec: str) -> None:
    x = torch.zeros(2 * BLOCK_SIZE)
    x[0] = 1e-40  # its reciprocal overflows fp32
    x[BLOCK_SIZE] = 1e-3
    enc = encode_tensors({"w": x}, codec)
    assert enc["w::scale"][0] == 0
    out = decode_tensors(enc, codec, {"w": x.shape})["w"]
    assert torch.isfinite(out).all()
    assert out[0] == 0 and out[BLOCK_SIZE] == pytest.approx(1e-3)


def test_decoded_slices_are_decode_tensor_bit_for_bit() -> None:
    """compress.decoded_slices: consecutive slices covering the tensor, whose values are
    decode_tensor's bit for bit, for every codec, with ragged tails and a one-element tensor."""
    from diloco_trainer.core.compress import SLICE, decode_tensor, decoded_slices

    shapes = {"big": torch.Size([2 * SLICE + 77]), "m": torch.Size([3, 43]), "one": torch.Size([1])}
    gen = torch.Generator().manual_seed(11)
    raw = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    for codec in ("int8", "int4", "fp16", "bf16", "none"):
        flat = encode_tensors(raw, codec)
        for name, shape in shapes.items():
            want = decode_tensor(flat, name, codec, shape).reshape(-1)
            end = 0
            for sl, piece in decoded_slices(flat, name, codec, shape):
                assert sl.start == end and piece.dtype == torch.float32
                assert torch.equal(piece, want[sl]), (codec, name, sl)
                end = sl.stop
            assert end == shape.numel()
