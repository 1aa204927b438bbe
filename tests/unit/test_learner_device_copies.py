"""A GPU learner's host/device copies (learner/device_copies.py) on the CPU, where they are the
identity: host tensors come back as they are, with nothing to wait for. (The CUDA side runs in
hack/gpu-check.sh's MODE=injob and MODE=pull, where a GPU is lent: bench/log/2026-11-27.md,
"compressed pulls applied on the GPU".) The device rebuild of a compressed pull is run here on the
CPU: the same ops, without pinned memory."""

from __future__ import annotations

import pytest
import torch
from diloco_trainer.api.spec import ConfigError
from diloco_trainer.core import compress, payloads
from diloco_trainer.core.published import apply_updates, check_updates, weights_checksum
from diloco_trainer.learner.device_copies import (
    adopt,
    apply_pulls_on_device,
    crossed_to,
    rebuilt_on,
    snapshot,
    to_host,
)
from diloco_trainer.learner.push_encoding import encode_delta, encode_for_wire


def test_host_tensors_are_not_copied_and_need_no_wait() -> None:
    x = torch.arange(6, dtype=torch.int8)
    out, ready = to_host({"x": x})
    ready()
    assert out["x"] is x


def test_adopt_leaves_host_tensors_alone() -> None:
    x = torch.ones(3)
    assert adopt({"x": x})["x"] is x


def test_encode_for_wire_is_encode_delta_and_its_wait() -> None:
    delta = {"w": torch.linspace(-1.0, 1.0, 64).reshape(8, 8)}
    encoded, ready = encode_for_wire(delta, "int8", None)
    ready()
    plain = encode_delta(delta, "int8", None)
    assert encoded.keys() == plain.keys()
    for k in plain:
        assert torch.equal(encoded[k], plain[k])
        assert encoded[k].device.type == "cpu"


def test_snapshot_copies_into_fresh_fp32_memory() -> None:
    params = {
        "a": torch.arange(6.0).reshape(2, 3),
        "b": torch.tensor([1.5, -0.0], dtype=torch.bfloat16),
    }
    snap = snapshot(params)
    assert snap["a"].shape == (2, 3) and snap["a"].dtype == torch.float32
    assert torch.equal(snap["a"], params["a"]) and snap["b"].tolist() == [1.5, -0.0]
    assert str(snap["b"][1].item()) == "-0.0"  # bits kept, sign of zero included
    params["a"].add_(1.0)  # the parameters move on; the snapshot does not
    assert snap["a"][0, 0].item() == 0.0
    assert snapshot({}) == {}


def _chain(held: dict[str, torch.Tensor], steps: int) -> list[dict[str, torch.Tensor]]:
    """`steps` int8 updates as a learner receives them: one pulled body, each update's tensors
    views of the one host copy that decode_body_unlocked makes."""
    gen = torch.Generator().manual_seed(3)
    updates = []
    for v in range(1, steps + 1):
        u = {n: 1e-3 * torch.randn(t.shape, generator=gen) for n, t in held.items()}
        updates.append((v, compress.encode_tensors(u, "int8", on=None)))
    body = payloads.encode_update_chain(updates, {})
    tensors, _ = payloads.decode_body_unlocked(body)
    return payloads.split_update_chain(tensors, 0, steps)


def test_rebuilt_on_a_device_is_apply_updates_bit_for_bit() -> None:
    # Odd sizes: tensors whose tails end mid-block, and one of a single value.
    gen = torch.Generator().manual_seed(1)
    held = {
        "a": torch.randn(3, 130, generator=gen),
        "b": torch.randn(1, generator=gen),
        "c": torch.randn(257, generator=gen),
    }
    chain = _chain(held, 3)
    check_updates({n: t.shape for n, t in held.items()}, chain, "int8")
    there, host = rebuilt_on(held, chain, "int8", torch.device("cpu"), pin=False)
    want = apply_updates(held, chain, "int8")
    for n in held:
        assert torch.equal(there[n], want[n]) and torch.equal(host[n], want[n]), n
        assert not torch.equal(want[n], held[n]), n  # the updates moved every tensor
    assert weights_checksum(host) == weights_checksum(want)
    # `held` is never written to.
    again = apply_updates(held, chain, "int8")
    assert all(torch.equal(again[n], want[n]) for n in held)


def test_crossed_tensors_are_one_copy_of_them_all() -> None:
    chain = _chain({"w": torch.zeros(2, 200), "v": torch.zeros(5)}, 2)
    update = {**chain[1], "empty": torch.zeros(0, 3), "odd": torch.arange(3, dtype=torch.int8)}
    crossed = crossed_to(update, torch.device("cpu"), pin=False)
    assert crossed.keys() == update.keys()
    storages = {t.untyped_storage().data_ptr() for t in crossed.values() if t.numel()}
    assert len(storages) == 1  # one buffer crossed ...
    sources = {t.untyped_storage().data_ptr() for t in update.values()}
    assert storages.isdisjoint(sources)  # ... a copy, not the body
    for k, t in update.items():
        assert crossed[k].dtype == t.dtype and crossed[k].shape == t.shape, k
        assert torch.equal(crossed[k], t), k
        assert crossed[k].data_ptr() % 64 == 0, k


def test_pull_apply_setting() -> None:
    assert apply_pulls_on_device("") and apply_pulls_on_device("device")
    assert not apply_pulls_on_device("host")
    with pytest.raises(ConfigError, match="DILOCO_PULL_APPLY='gpu'"):
        apply_pulls_on_device("gpu")
