"""A GPU learner's host/device copies (learner/device_copies.py) on the CPU, where they are the
identity: host tensors come back as they are, with nothing to wait for. (The CUDA side runs in
hack/gpu-check.sh's MODE=injob, where a GPU is lent: bench/RESULTS.md.)"""

from __future__ import annotations

import torch
from diloco_trainer.learner.device_copies import adopt, snapshot, to_host
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
