"""Outer Nesterov SGD: exact torch.optim.SGD semantics, fragments, state round trip."""

from __future__ import annotations

import pytest
import torch
from diloco_trainer.core.outer import OuterOptimizer
from safetensors.torch import load, save


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, True), (0.9, False), (0.0, False)])
def test_outer_optimizer_matches_torch_sgd(momentum: float, nesterov: bool) -> None:
    params = _params()
    ref = [torch.nn.Parameter(p.clone()) for p in params.values()]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=momentum, nesterov=nesterov)
    outer = OuterOptimizer(params, lr=0.7, momentum=momentum, nesterov=nesterov)
    for step in range(4):
        grads = _grads(step)
        outer.step(grads)
        for p, g in zip(ref, grads.values(), strict=True):
            p.grad = g.clone()
        sgd.step()
    for p, q in zip(ref, params.values(), strict=True):
        assert torch.equal(p.detach(), q)


def test_outer_optimizer_nesterov_formula_by_hand() -> None:
    p = {"w": torch.tensor([1.0])}
    outer = OuterOptimizer(p, lr=0.5, momentum=0.9, nesterov=True)
    outer.step({"w": torch.tensor([2.0])})  # buf = 2; w -= 0.5 * (2 + 0.9*2) = 1.9
    assert p["w"].item() == pytest.approx(1.0 - 1.9)
    outer.step({"w": torch.tensor([1.0])})  # buf = 0.9*2 + 1 = 2.8; w -= 0.5*(1 + 2.52)
    assert p["w"].item() == pytest.approx(1.0 - 1.9 - 1.76)


def test_outer_optimizer_steps_only_the_given_fragment() -> None:
    params = _params()
    before_b = params["b"].clone()
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9, nesterov=True)
    outer.step({"a": _grads(1)["a"]})
    assert torch.equal(params["b"], before_b)
    assert set(outer.state_tensors()) == {"a"}
    # Fragment b's first step behaves as if it were the only fragment.
    solo = {"b": before_b.clone()}
    OuterOptimizer(solo, lr=0.7, momentum=0.9, nesterov=True).step({"b": _grads(2)["b"]})
    outer.step({"b": _grads(2)["b"]})
    assert torch.equal(params["b"], solo["b"])
    assert all(p.grad is None for p in params.values())


def test_outer_optimizer_state_round_trips_through_safetensors() -> None:
    params = _params()
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9, nesterov=True)
    outer.step(_grads(0))
    restored_params = {k: v.clone() for k, v in params.items()}
    blob = save(outer.state_tensors())  # must be contiguous, unshared, named by parameter
    restored = OuterOptimizer(restored_params, lr=0.7, momentum=0.9, nesterov=True)
    restored.load_state_tensors(load(blob))
    outer.step(_grads(1))
    restored.step(_grads(1))
    for k in params:
        assert torch.equal(params[k], restored_params[k])


def test_outer_optimizer_load_state_copies_buffers() -> None:
    params = _params()
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9, nesterov=True)
    state = {"a": torch.ones(4, 3)}
    outer.load_state_tensors(state)
    outer.step({"a": torch.zeros(4, 3)})
    assert torch.equal(state["a"], torch.ones(4, 3))


def test_outer_optimizer_rejects_bad_names_and_shapes() -> None:
    outer = OuterOptimizer(_params(), lr=0.7, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="unknown tensor 'c'"):
        outer.step({"c": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'a' has shape \(3,\), expected \(4, 3\)"):
        outer.step({"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="unknown tensor 'z'"):
        outer.load_state_tensors({"z": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        outer.load_state_tensors({"b": torch.zeros(4)})
    with pytest.raises(ValueError, match="float32"):
        OuterOptimizer({"h": torch.zeros(2, dtype=torch.float16)}, lr=1, momentum=0, nesterov=False)


def test_outer_optimizer_lr_can_be_changed() -> None:
    p = {"w": torch.tensor([0.0])}
    outer = OuterOptimizer(p, lr=1.0, momentum=0.0, nesterov=True)
    outer.lr = 0.25
    outer.step({"w": torch.tensor([4.0])})
    assert outer.lr == 0.25
    assert p["w"].item() == -1.0
