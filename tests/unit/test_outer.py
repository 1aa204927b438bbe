"""Outer Nesterov SGD: exact torch.optim.SGD semantics, fragments, state round trip."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from diloco_trainer.core.outer import OuterOptimizer, split_fraction
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


# ----- Delayed Nesterov: fractions of a round of work ------------------------------------------


@pytest.mark.parametrize(
    ("accumulated", "fraction", "portions", "after"),
    [
        (0.0, 1.0, [(1.0, True)], 0.0),  # a whole round: one fold
        (0.0, 0.25, [(0.25, False)], 0.25),
        (0.75, 0.5, [(0.25, True), (0.25, False)], 0.25),  # the excess opens the next round
        (0.0, 2.5, [(1.0, True), (1.0, True), (0.5, False)], 0.5),
        (2 / 3, 1 / 3, [(1 / 3, True)], 0.0),  # float sums that miss 1.0 by an ulp still close
        (0.5, 0.0, [], 0.5),
    ],
)
def test_split_fraction_by_hand(
    accumulated: float, fraction: float, portions: list[tuple[float, bool]], after: float
) -> None:
    got, left = split_fraction(accumulated, fraction)
    assert [c for _, c in got] == [c for _, c in portions]
    assert [p for p, _ in got] == pytest.approx([p for p, _ in portions])
    assert left == pytest.approx(after)


@pytest.mark.parametrize(
    ("accumulated", "fraction", "portions"),
    [
        (0.0, 0.883, [(0.883, True)]),  # short of a round by work, but every island is in it
        (0.825, 1.0, [(1.0, True)]),  # an old offset: one fold, not 0.175 closing + 0.825 open
        (0.5, 2.0, [(2.0, True)]),  # one fold per complete merge, however much work
        (0.4, 0.0, []),  # no work: nothing to fold, the round stays open
    ],
)
def test_split_fraction_of_a_complete_merge_closes_the_round_at_once(
    accumulated: float, fraction: float, portions: list[tuple[float, bool]]
) -> None:
    got, left = split_fraction(accumulated, fraction, complete=True)
    assert got == portions
    assert left == (accumulated if not portions else 0.0)


def test_split_fraction_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="work fraction"):
        split_fraction(0.0, -0.1)
    with pytest.raises(ValueError, match="accumulated"):
        split_fraction(1.0, 0.1)


@pytest.mark.parametrize("nesterov", [True, False])
def test_partial_merges_fold_momentum_once_per_round_by_hand(nesterov: bool) -> None:
    p = {"w": torch.tensor([1.0])}
    outer = OuterOptimizer(p, lr=0.5, momentum=0.9, nesterov=nesterov)
    # φ=0.5, g=2: θ -= 0.5·0.5·2 = 0.5; buffer 0.5·2 = 1; no fold.
    assert outer.step({"w": torch.tensor([2.0])}, fraction=0.5) == 0
    assert p["w"].item() == pytest.approx(0.5)
    assert (outer.rounds(), outer.accumulated()) == (0, 0.5)
    # φ=0.75, g=4: θ -= 0.5·0.75·4 = 1.5; 0.5 of it closes the round: buffer 1 + 0.5·4 = 3,
    # m = 3, θ -= 0.5·0.9·3 = 1.35 (Nesterov; heavy ball uses m_old = 0); 0.25·4 = 1 carried.
    assert outer.step({"w": torch.tensor([4.0])}, fraction=0.75) == 1
    assert p["w"].item() == pytest.approx(0.5 - 1.5 - (1.35 if nesterov else 0.0))
    assert (outer.rounds(), outer.accumulated()) == (1, pytest.approx(0.25))
    # φ=0.75, g=0 closes the next round: m = 0.9·3 + 1 = 3.7; θ -= 0.5·0.9·3.7 = 1.665
    # (heavy ball: 0.5·0.9·3 = 1.35).
    assert outer.step({"w": torch.tensor([0.0])}, fraction=0.75) == 1
    want = 0.5 - 1.5 - 1.35 - 1.665 if nesterov else 0.5 - 1.5 - 1.35
    assert p["w"].item() == pytest.approx(want)
    assert outer.state_tensors()["w"].item() == pytest.approx(3.7)
    assert (outer.rounds(), outer.accumulated(), outer.clock()) == (2, 0.0, 2.0)


def test_a_complete_merge_folds_the_open_buffer_with_all_of_its_work_by_hand() -> None:
    p = {"w": torch.tensor([0.0])}
    outer = OuterOptimizer(p, lr=0.5, momentum=0.9, nesterov=True)
    # A partial merge, φ = 0.5, g = 2: θ -= 0.5·0.5·2 = 0.5; buffer 1; open at 0.5.
    outer.step({"w": torch.tensor([2.0])}, fraction=0.5)
    # A complete merge, φ = 1, g = 4: θ -= 0.5·1·4 = 2; buffer 1 + 4 = 5 folds at once:
    # m = 5, θ -= 0.5·0.9·5 = 2.25. By work alone half of it (2) would have closed the round
    # (m = 3, θ -= 1.35) and the other half (2) stayed in the buffer.
    assert outer.step({"w": torch.tensor([4.0])}, fraction=1.0, complete=True) == 1
    assert p["w"].item() == pytest.approx(-0.5 - 2.0 - 2.25)
    assert outer.state_tensors() == {"w": pytest.approx(torch.tensor([5.0]))}
    assert (outer.rounds(), outer.accumulated()) == (1, 0.0)


@pytest.mark.parametrize("islands", [2, 4])
def test_one_island_per_merge_equals_synchronous_diloco(islands: int) -> None:
    """K=1: M merges of one island's Δ each (φ = 1/M) give, round after round, the θ of one
    synchronous DiLoCo step on the mean of the same Δs (torch SGD, Nesterov)."""
    params = _params()
    ref = [torch.nn.Parameter(p.clone()) for p in params.values()]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9, nesterov=True)
    for rnd in range(3):
        grads = _grads(rnd)  # every island's Δ in this round is the same
        for _ in range(islands):
            outer.step(grads, fraction=1.0 / islands)
        for p, g in zip(ref, grads.values(), strict=True):
            p.grad = g.clone()
        sgd.step()
        for p, q in zip(ref, params.values(), strict=True):
            torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6)
        assert outer.rounds() == rnd + 1
    # The per-merge rule this replaces (a full Nesterov step per merge) lands elsewhere.
    per_merge = _params()
    naive = OuterOptimizer(per_merge, lr=0.7, momentum=0.9, nesterov=True)
    for rnd in range(3):
        for _ in range(islands):
            naive.step({n: g / islands for n, g in _grads(rnd).items()})
    assert not torch.allclose(per_merge["a"], params["a"], rtol=1e-3)


def test_groups_keep_their_own_rounds_and_buffers() -> None:
    params = _params()
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9, nesterov=True)
    outer.step({"a": _grads(0)["a"]}, fraction=0.5, group=0)
    outer.step({"b": _grads(0)["b"]}, fraction=1.0, group=1)
    assert (outer.rounds(0), outer.accumulated(0)) == (0, 0.5)
    assert (outer.rounds(1), outer.accumulated(1)) == (1, 0.0)
    assert set(outer.state_tensors()) == {"b", "buffer/a"}
    assert outer.progress_json() == {
        "0": {"rounds": 0, "accumulated": 0.5},
        "1": {"rounds": 1, "accumulated": 0.0},
    }


def test_open_round_state_round_trips() -> None:
    """Buffer, accumulated fraction, rounds and momentum survive a checkpoint: the restored
    optimizer continues exactly as the original."""
    params = _params()
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9, nesterov=True)
    outer.step(_grads(0), fraction=1.0)
    outer.step(_grads(1), fraction=0.4)
    restored_params = {k: v.clone() for k, v in params.items()}
    restored = OuterOptimizer(restored_params, lr=0.7, momentum=0.9, nesterov=True)
    restored.load_state_tensors(load(save(outer.state_tensors())))
    restored.load_progress(outer.progress_json())
    for o in (outer, restored):
        assert o.step(_grads(2), fraction=0.6) == 1
    for k in params:
        assert torch.equal(params[k], restored_params[k])
    assert restored.rounds() == outer.rounds() == 2
    with pytest.raises(ValueError, match="invalid"):
        restored.load_progress({"0": {"rounds": 1, "accumulated": 1.5}})


def test_momentum_zero_keeps_no_state_and_is_plain_sgd() -> None:
    p = {"w": torch.tensor([1.0])}
    outer = OuterOptimizer(p, lr=0.5, momentum=0.0, nesterov=True)
    outer.step({"w": torch.tensor([2.0])}, fraction=0.5)  # θ -= 0.5·0.5·2
    outer.step({"w": torch.tensor([2.0])}, fraction=0.5)
    assert p["w"].item() == pytest.approx(0.0)
    assert outer.state_tensors() == {} and outer.rounds() == 1


def _whole_tensor_step(
    state: dict[str, dict[str, torch.Tensor]],
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    portions: list[tuple[float, bool]],
    fraction: float,
    *,
    lr: float,
    beta: float,
    nesterov: bool,
) -> None:
    """The module docstring's rule on whole tensors, as the syncer computed it before it
    streamed slices: the reference the streamed step must match bit for bit."""
    for name, g in grads.items():
        update = g.mul(fraction)
        for portion, closes in portions:
            buf = state["b"].get(name)
            if buf is None:
                buf = state["b"][name] = g.mul(portion)
            else:
                buf.add_(g, alpha=portion)
            if closes:
                buf = state["b"].pop(name)
                m = state["m"].setdefault(name, torch.zeros_like(buf))
                m.mul_(beta)
                if nesterov:
                    m.add_(buf)
                    update.add_(m, alpha=beta)
                else:
                    term = m.clone()
                    m.add_(buf)
                    update.add_(term)
        params[name].add_(update, alpha=-lr)


def _recorder(seen: list[tuple[str, int]]) -> Callable[[str, slice], None]:
    return lambda name, sl: seen.append((name, sl.start))


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_streamed_step_matches_the_whole_tensor_rule_over_many_slices(
    nesterov: bool,
) -> None:
    """Tensors of several slices and a ragged tail, merges that open, cross and close rounds
    (φ = 0.4, 0.9, 1.7, a complete 0.3, 0, 0.5, 0.5, a complete 1, 1, 2, 0.25): the streamed
    step gives the same bits, momentum and open-round buffers as the whole-tensor rule."""
    from diloco_trainer.core.compress import SLICE

    gen = torch.Generator().manual_seed(3)
    shapes = {"big": (2 * SLICE + 77,), "mat": (SLICE // 64, 160), "one": (1,)}
    params = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    ref = {n: t.clone() for n, t in params.items()}
    state: dict[str, dict[str, torch.Tensor]] = {"b": {}, "m": {}}
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9, nesterov=nesterov)
    accumulated = 0.0
    for fraction, complete in [
        (0.4, False),
        (0.9, False),
        (1.7, False),
        (0.3, True),
        (0.0, False),
        (0.5, False),
        (0.5, False),  # closes the round with the open buffer (φ = 0.5 + 0.5)
        (1.0, True),  # a K = M merge: g read as it is
        (1.0, False),  # a whole round of work at once, closing at its end
        (2.0, False),  # two folds in one merge
        (0.25, False),  # a round left open: its buffer is kept
    ]:
        grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
        portions, accumulated = split_fraction(accumulated, fraction, complete=complete)
        seen: list[tuple[str, int]] = []
        outer.step(grads, fraction, complete=complete, each=_recorder(seen))
        _whole_tensor_step(
            state, ref, grads, portions, fraction, lr=0.7, beta=0.9, nesterov=nesterov
        )
        for n in shapes:
            assert torch.equal(params[n], ref[n]), n
        assert seen[:3] == [("big", 0), ("big", SLICE), ("big", 2 * SLICE)]
    tensors = outer.state_tensors()
    assert set(tensors) == {"big", "mat", "one", "buffer/big", "buffer/mat", "buffer/one"}
    for n in shapes:
        assert torch.equal(tensors[n], state["m"][n])
        assert torch.equal(tensors["buffer/" + n], state["b"][n])


def test_outer_load_state_tensors_takes_a_checkpoints_tensors_without_a_copy() -> None:
    """take=True keeps the given fp32 tensors (a resume holds one momentum, not two); without
    it the optimizer's state is its own copy; the steps after are the same either way."""
    state = {"a": torch.full((4, 3), 0.5), "b": torch.full((5,), -0.25)}
    took = OuterOptimizer(_params(), lr=0.7, momentum=0.9, nesterov=True)
    took.load_state_tensors(state, take=True)
    copied = OuterOptimizer(_params(), lr=0.7, momentum=0.9, nesterov=True)
    copied.load_state_tensors(state)
    assert took.state_tensors()["a"].data_ptr() == state["a"].data_ptr()
    assert copied.state_tensors()["a"].data_ptr() != state["a"].data_ptr()
    before = {n: t.clone() for n, t in state.items()}
    copied.step(_grads(1))
    assert all(torch.equal(state[n], before[n]) for n in state)  # a copy: the input untouched
    took.step(_grads(1))
    assert all(torch.equal(took.params[n], copied.params[n]) for n in state)


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, True), (0.9, False), (0.0, False)])
def test_reserved_momentum_is_a_first_fold_made_early(momentum: float, nesterov: bool) -> None:
    # The syncer reserves a fragment's momentum when its first push is folded: the steps that
    # follow are bit for bit those of an optimizer that made it at its first fold.
    params, early = _params(), _params()
    late = OuterOptimizer(params, lr=0.7, momentum=momentum, nesterov=nesterov)
    reserved = OuterOptimizer(early, lr=0.7, momentum=momentum, nesterov=nesterov)
    reserved.reserve(["a"])
    if momentum:
        assert set(reserved.state_tensors()) == {"a"}
        assert torch.equal(reserved.state_tensors()["a"], torch.zeros(4, 3))
        assert reserved.state_tensors()["a"].data_ptr() != early["a"].data_ptr()
    else:  # plain SGD keeps no state, reserved or not
        assert reserved.state_tensors() == {}
    for step in range(3):
        late.step({"a": _grads(step)["a"]})
        reserved.step({"a": _grads(step)["a"]})
    assert torch.equal(params["a"], early["a"])
    momentum_after = {k: v.clone() for k, v in reserved.state_tensors().items()}
    reserved.reserve(["a", "b"])  # a's momentum is kept as it is; b's is made
    state = reserved.state_tensors()
    for name, m in momentum_after.items():
        assert torch.equal(state[name], m)
    assert set(state) == ({"a", "b"} if momentum else set())


def test_a_stale_merge_feeds_the_momentum_only_its_share() -> None:
    # θ = 1, g = 2, lr 0.5, β 0.9, Nesterov, a merge closing a round with momentum share 0.25:
    # buffer 0.25·2 = 0.5, m = 0.9·0 + 0.5 = 0.5, θ ← 1 − 0.5·(2 + 0.9·0.5) = −0.225
    # (all of g into the momentum, as before: m = 2, θ ← 1 − 0.5·(2 + 1.8) = −0.9).
    p = {"w": torch.tensor([1.0])}
    outer = OuterOptimizer(p, lr=0.5, momentum=0.9, nesterov=True)
    assert outer.step({"w": torch.tensor([2.0])}, momentum_share=0.25) == 1
    assert p["w"].item() == pytest.approx(-0.225)
    assert outer.state_tensors()["w"].item() == pytest.approx(0.5)


def test_a_stale_partial_merge_buffers_its_share_and_moves_theta_by_all_of_it() -> None:
    # lr 0.5, β 0.9, θ = 1. Merge 1: φ 0.5, g 2, share 0.5: θ ← 1 − 0.5·0.5·2 = 0.5, buffer
    # 0.5·0.5·2 = 0.5. Merge 2: φ 0.5, g 4, fresh (share 1), closes the round: buffer 0.5 + 2 =
    # 2.5 = m, θ ← 0.5 − 0.5·(0.5·4 + 0.9·2.5) = −1.625 (share 1 both times: −1.85).
    p = {"w": torch.tensor([1.0])}
    outer = OuterOptimizer(p, lr=0.5, momentum=0.9, nesterov=True)
    assert outer.step({"w": torch.tensor([2.0])}, 0.5, momentum_share=0.5) == 0
    assert p["w"].item() == pytest.approx(0.5)
    assert outer.step({"w": torch.tensor([4.0])}, 0.5) == 1
    assert p["w"].item() == pytest.approx(-1.625)
    assert outer.state_tensors()["w"].item() == pytest.approx(2.5)


def test_heavy_ball_momentum_share_leaves_the_gradient_term() -> None:
    # Heavy ball, lr 0.5, β 0.9, after a fresh round with g = 2 (m = 2, θ = 1 − 0.5·2 = 0):
    # a stale one with g = 2, share 0.25: θ ← 0 − 0.5·(2 + 0.9·2) = −1.9 (the term is β·m_old),
    # m = 0.9·2 + 0.5 = 2.3.
    p = {"w": torch.tensor([1.0])}
    outer = OuterOptimizer(p, lr=0.5, momentum=0.9, nesterov=False)
    outer.step({"w": torch.tensor([2.0])})
    outer.step({"w": torch.tensor([2.0])}, momentum_share=0.25)
    assert p["w"].item() == pytest.approx(-1.9)
    assert outer.state_tensors()["w"].item() == pytest.approx(2.3)


@pytest.mark.parametrize("share", [-0.1, 1.5, math.nan])
def test_outer_step_refuses_a_momentum_share_outside_0_1(share: float) -> None:
    outer = OuterOptimizer({"w": torch.tensor([1.0])}, lr=0.5, momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="momentum share"):
        outer.step({"w": torch.tensor([2.0])}, momentum_share=share)
