"""The batched int8 push encoder (learner/push_encoding.py) against the per-tensor one, bit for
bit: the same q values, scales and error-feedback residuals over several pushes, for tensors
whose sizes are and are not whole codec blocks, with all-zero and tiny blocks among them. And a
host learner's one-pass push (snapshot_and_encode_int8) against the copy, Δ and encoding it
replaces, and which of the two a host fragment's push takes (ONE_PASS_FROM)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from diloco_trainer.core import compress
from diloco_trainer.learner.device_copies import snapshot
from diloco_trainer.learner.fragment_state import FragmentState
from diloco_trainer.learner.mixing import pseudo_gradient
from diloco_trainer.learner.push_encoding import (
    ONE_PASS_FROM,
    encode_delta,
    encode_for_wire,
    encode_int8_batched,
    int8_bytes,
    one_pass,
    snapshot_and_encode_int8,
)

SHAPES = {
    "wte": (7, 128),  # whole blocks
    "ln.bias": (5,),  # one padded block
    "attn.w": (3, 100),  # 300 values: 3 blocks, the last padded
    "zeros": (130,),  # an all-zero block and a padded one
    "tiny": (129,),  # values under FLUSH_TO_ZERO
}


def pushes(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(3):
        d = {n: torch.randn(s, generator=g) * (10.0**-k) for n, s in SHAPES.items()}
        d["zeros"][:128] = 0.0
        d["tiny"] = d["tiny"] * 1e-32
        out.append(d)
    return out


def per_tensor(delta: dict[str, torch.Tensor], fb: compress.ErrorFeedback | None) -> dict:
    """The rule the batched path must keep: compensate, encode each tensor, decode, record."""
    sent = {n: fb.compensate(n, d) for n, d in delta.items()} if fb else dict(delta)
    encoded = compress.encode_tensors(sent, "int8", on=None)
    if fb is not None:
        decoded = compress.decode_tensors(encoded, "int8", {n: t.shape for n, t in sent.items()})
        for n, t in sent.items():
            fb.record(n, t, decoded[n])
    return encoded


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        # Bits, not values: -0.0 and 0.0 must not be taken for each other.
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def batched(delta: dict[str, torch.Tensor], fb: compress.ErrorFeedback | None) -> dict:
    """The GPU learner's path, run here on the CPU (the same ops; the CUDA run: gpu-check.sh)."""
    encoded, ready = encode_int8_batched(delta, fb)
    ready()
    return encoded


def test_batched_int8_is_the_per_tensor_encoding_bit_for_bit() -> None:
    for delta in pushes(0):
        assert_same(batched(delta, None), per_tensor(delta, None))
        assert_same(encode_delta(delta, "int8", None), per_tensor(delta, None))


def test_batched_int8_carries_the_same_residuals_over_pushes() -> None:
    ours, theirs = compress.ErrorFeedback(), compress.ErrorFeedback()
    for delta in pushes(1):
        assert_same(batched(delta, ours), per_tensor(delta, theirs))
        assert_same(ours.state_tensors(), theirs.state_tensors())
    # The residuals are what the codec missed: nonzero somewhere, and as shaped as their tensors.
    assert any(bool(r.abs().max() > 0) for r in ours.residuals.values())
    assert {n: r.shape for n, r in ours.residuals.items()} == {
        n: torch.Size(s) for n, s in SHAPES.items()
    }


def test_a_residual_of_another_shape_is_refused_with_its_name() -> None:
    fb = compress.ErrorFeedback()
    fb.keep("w", torch.zeros(4))
    try:
        encode_int8_batched({"w": torch.ones(5)}, fb)
    except ValueError as err:
        assert "'w'" in str(err) and "(5,)" in str(err)
    else:
        raise AssertionError("a residual of another shape was added")


def test_the_encoded_tensors_decode_as_the_syncer_reads_them() -> None:
    delta = pushes(2)[0]
    encoded = batched(delta, None)
    decoded = compress.decode_tensors(encoded, "int8", {n: t.shape for n, t in delta.items()})
    for n, d in delta.items():
        scale = encoded[n + compress.SCALE_SUFFIX].max()
        assert float((decoded[n] - d).abs().max()) <= float(scale) / 2 + 1e-12, n


# A host learner's one-pass push: two slices and a short, padded last one (compress.SLICE).
HOST_SHAPES = {**SHAPES, "big": (compress.SLICE + 300,)}


def test_a_host_push_is_the_copy_delta_and_encoding_it_replaces_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(4)
    params = {n: torch.randn(s, generator=g) for n, s in HOST_SHAPES.items()}
    params["zeros"][:128] = 0.0
    params["tiny"] = params["tiny"] * 1e-32
    ours, theirs = compress.ErrorFeedback(), compress.ErrorFeedback()
    for k, fb in enumerate([(None, None), (ours, theirs), (ours, theirs)]):
        base = {n: p + torch.randn(p.shape, generator=g) * 10.0**-k for n, p in params.items()}
        base["zeros"][:128] = 0.0
        base["tiny"] = params["tiny"] * 2.0  # Δ under FLUSH_TO_ZERO: sent as zeros
        local, encoded = snapshot_and_encode_int8(params, base, fb[0])
        want_local = snapshot(params)
        assert_same(local, want_local)
        assert_same(encoded, per_tensor(pseudo_gradient(base, want_local), fb[1]))
        if fb[0] is not None:
            assert_same(ours.state_tensors(), theirs.state_tensors())
        # Copies, not aliases: the steps after the push do not move them.
        for p in params.values():
            p.add_(1.0)
        assert_same(local, want_local)
    assert any(bool(r.abs().max() > 0) for r in ours.residuals.values())


def test_a_host_push_refuses_a_residual_of_another_shape_with_its_name() -> None:
    fb = compress.ErrorFeedback()
    fb.keep("w", torch.zeros(4))
    try:
        snapshot_and_encode_int8({"w": torch.ones(5)}, {"w": torch.zeros(5)}, fb)
    except ValueError as err:
        assert "'w'" in str(err) and "(5,)" in str(err)
    else:
        raise AssertionError("a residual of another shape was added")


def test_a_host_push_is_made_in_one_pass_only_above_one_pass_from_values() -> None:
    at_most = {"w": torch.zeros(ONE_PASS_FROM - 1), "b": torch.zeros(1)}
    above = {"w": torch.zeros(ONE_PASS_FROM), "b": torch.zeros(1)}
    assert not one_pass(at_most, "int8")
    assert one_pass(above, "int8")
    assert not one_pass(above, "int4") and not one_pass(above, "none")  # per tensor, as before
    assert not one_pass({}, "int8")


@pytest.mark.parametrize("extra", [-300, 300])
def test_a_host_fragments_push_is_the_per_tensor_rule_either_side_of_one_pass_from(
    extra: int,
) -> None:
    g = torch.Generator().manual_seed(5)
    sizes = {"a": ONE_PASS_FROM + extra - 500, "b": 500}
    params = {n: torch.randn(s, generator=g) for n, s in sizes.items()}
    assert one_pass(params, "int8") == (extra > 0)
    base = {n: p + 0.1 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    state = FragmentState(names=list(params), base=base)
    ours, theirs = compress.ErrorFeedback(), compress.ErrorFeedback()
    for _ in range(2):
        encoded, ready = state.encode_push(params, "int8", ours)
        ready()
        want_local = snapshot(params)
        assert_same(encoded, per_tensor(pseudo_gradient(base, want_local), theirs))
        assert state.at_push is not None
        assert_same(state.at_push, want_local)
        assert_same(ours.state_tensors(), theirs.state_tensors())
        for p in params.values():
            p.add_(0.01)


def test_a_deferred_host_push_encodes_the_weights_at_the_push_off_the_training_thread() -> None:
    """FragmentState.encode_push's deferred push (issue 45): the training thread makes only the
    copy; the encoding, done later by `ready` (the link's thread), is of the weights at the push,
    bit for bit snapshot_and_encode_int8's, even when steps moved the weights meanwhile."""
    g = torch.Generator().manual_seed(6)
    sizes = {"a": ONE_PASS_FROM + 300, "b": 500}
    params = {n: torch.randn(s, generator=g) for n, s in sizes.items()}
    base = {n: p + 0.1 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    state = FragmentState(names=list(params), base=base)
    assert state.defer_host_encoding
    for encoded in _deferred_pushes(
        state, params, lambda ef: snapshot_and_encode_int8(params, base, ef)
    ):
        assert sum(t.numel() * t.element_size() for t in encoded.values()) == int8_bytes(params)
    # A codec other than int8 is not deferred: encoded on the spot.
    small = {"w": torch.randn(1000, generator=g)}
    encoded, _ready = FragmentState(names=["w"], base={"w": torch.zeros(1000)}).encode_push(
        small, "fp16", None
    )
    assert encoded


def test_a_small_host_push_is_deferred_too_and_its_bytes_are_the_flat_buffers() -> None:
    """issue 45: a small host fragment's int8 push (at most ONE_PASS_FROM values: gpt-tiny's
    70K) takes only the copy of the weights on the training thread too; `ready` (the link's
    thread) encodes the weights at the push over the flat buffer, bit for bit what the training
    thread made before (encode_for_wire of Δ = base − snapshot), error feedback's residuals
    included, even when steps moved the weights meanwhile."""
    g = torch.Generator().manual_seed(7)
    params = {"a": torch.randn(700, generator=g), "b": torch.randn(3, 50, generator=g)}
    assert not one_pass(params, "int8")
    base = {n: p + 0.1 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    state = FragmentState(names=list(params), base=base)

    def expected(
        ef: compress.ErrorFeedback,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        local = snapshot(params)
        return local, encode_for_wire(pseudo_gradient(base, local), "int8", ef)[0]

    list(_deferred_pushes(state, params, expected))
    # Not deferred (defer_host_encoding off): the same bytes on the spot.
    state = FragmentState(names=list(params), base=base, defer_host_encoding=False)
    encoded, _ready = state.encode_push(params, "int8", None)
    assert encoded


def test_int8_bytes_is_a_byte_a_value_and_four_a_block() -> None:
    # 1000 values: 1000 bytes and ceil(1000 / BLOCK_SIZE) scales of 4 bytes.
    blocks = -(-1000 // compress.BLOCK_SIZE)
    assert int8_bytes({"w": torch.zeros(1000)}) == 1000 + 4 * blocks


def _deferred_pushes(
    state: FragmentState,
    params: dict[str, torch.Tensor],
    expected: Callable[
        [compress.ErrorFeedback], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
    ],
) -> Iterator[dict[str, torch.Tensor]]:
    """Two deferred int8 pushes of `params`: nothing encoded on the training thread, the copy at
    the push `expected`'s weights, and the bytes `ready` (the link's thread) makes after steps
    moved the weights `expected`'s too, error feedback's residuals included; each push's bytes."""
    ours, theirs = compress.ErrorFeedback(), compress.ErrorFeedback()
    for _ in range(2):
        want_local, want = expected(theirs)
        encoded, ready = state.encode_push(params, "int8", ours)
        assert encoded == {}  # nothing encoded on the training thread
        assert state.at_push is not None
        assert_same(state.at_push, want_local)
        for p in params.values():
            p.add_(0.5)  # the steps after the push, before the link's thread encodes
        ready()
        assert_same(encoded, want)
        assert_same(ours.state_tensors(), theirs.state_tensors())
        yield encoded
