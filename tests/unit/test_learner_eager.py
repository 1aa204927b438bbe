"""sync.lateMergeRule eager (issue 45): the proxy of the coming outer step a learner moves to
right after a push, and the receipt that keeps only the steps taken from it; values by hand."""

from __future__ import annotations

import pytest
import torch
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.core.outer import OuterOptimizer
from diloco_trainer.learner.fragment_state import FragmentState
from diloco_trainer.learner.mixing import eager_proxy, outer_proxy_coefficients


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_coefficients_of_the_proxy_step() -> None:
    # Nesterov: lr (1 + β) on Δ, β² on the last update; heavy ball: lr and β.
    c_delta, c_update = outer_proxy_coefficients(lr=0.7, momentum=0.9, nesterov=True)
    assert c_delta == pytest.approx(1.33) and c_update == pytest.approx(0.81)
    assert outer_proxy_coefficients(lr=0.7, momentum=0.9, nesterov=False) == (0.7, 0.9)


def test_eager_proxy_by_hand() -> None:
    base, at_push, last = {"w": t(1.0, 2.0)}, {"w": t(0.5, 2.5)}, {"w": t(0.1, 0.2)}
    # Δ = (0.5, -0.5); θ_proxy = θ_base − 1.33·Δ − 0.81·u = (1 − 0.665 − 0.081, 2 + 0.665 − 0.162)
    out = eager_proxy(base, at_push, last, lr=0.7, momentum=0.9, nesterov=True, work=1.0)
    assert torch.allclose(out["w"], t(0.254, 2.503), atol=1e-6)
    # 1.5 rounds of work (a fragment's first push): Δ/w = (1/3, -1/3); no update received yet.
    out = eager_proxy(base, at_push, None, lr=0.7, momentum=0.9, nesterov=True, work=1.5)
    assert torch.allclose(out["w"], t(1.0 - 1.33 / 3, 2.0 + 1.33 / 3), atol=1e-6)
    # Heavy ball: θ_base − 0.7·Δ − 0.9·u = (1 − 0.35 − 0.09, 2 + 0.35 − 0.18)
    out = eager_proxy(base, at_push, last, lr=0.7, momentum=0.9, nesterov=False, work=1.0)
    assert torch.allclose(out["w"], t(0.56, 2.17), atol=1e-6)
    # Only the momentum's part guessed (own=False): θ_push − 0.81·u = (0.5 − 0.081, 2.5 − 0.162)
    out = eager_proxy(base, at_push, last, lr=0.7, momentum=0.9, nesterov=True, work=1.5, own=False)
    assert torch.allclose(out["w"], t(0.419, 2.338), atol=1e-6)
    with pytest.raises(ValueError):
        eager_proxy(base, at_push, None, lr=0.7, momentum=0.9, nesterov=True, work=0.0)


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_proxy_is_the_outer_step_when_its_guesses_hold(nesterov: bool) -> None:
    """Every island's Δ equal to ours, and (heavy ball always; Nesterov in a steady state, g
    constant) lr·m = the last update: the proxy is exactly the syncer's next step."""
    beta, lr = 0.9, 0.7
    g = t(0.2, -0.4)
    theta = t(1.0, 1.0)
    outer = OuterOptimizer({"w": theta}, lr=lr, momentum=beta, nesterov=nesterov)
    # A steady state: rounds of the same g until m = g / (1 − β) to float precision.
    for _ in range(400):
        before = theta.clone()
        outer.step({"w": g}, 1.0, complete=True)
    last = {"w": before - theta}
    base = theta.clone()
    proxy = eager_proxy(
        {"w": base}, {"w": base - g}, last, lr=lr, momentum=beta, nesterov=nesterov, work=1.0
    )
    outer.step({"w": g}, 1.0, complete=True)
    assert torch.allclose(proxy["w"], theta, atol=1e-4)


def test_fragment_state_eager_jump_and_receipt_keep_only_the_steps_from_the_proxy() -> None:
    state = FragmentState(names=["w"], track_update=True)
    state.take_global({"w": t(1.2, 2.4)}, 3)
    assert state.last_update is None
    # A first merge received without a push: u = old base − new base = (0.2, 0.4).
    state.receive({"w": t(1.0, 2.0)}, 4, {"w": t(1.0, 2.0)}, alpha=0.0)
    assert torch.allclose(state.last_update["w"], t(0.2, 0.4))
    for _ in range(30):
        state.counters.add(10, 1.0, 0.1)
    state.begin_push({"w": t(0.5, 2.5)})  # Δ = (0.5, -0.5), 30 steps = one round at H = 30
    proxy = state.eager_jump(lr=0.7, momentum=0.9, nesterov=True, inner_steps=30)
    # θ_base − 1.33·Δ − 0.81·u = (1 − 0.665 − 0.162, 2 + 0.665 − 0.324)
    assert torch.allclose(proxy["w"], t(0.173, 2.341), atol=1e-6)
    # Two steps from the proxy move it by (0.1, −0.1); the merge is (0.3, 2.6).
    now = {"w": proxy["w"] + t(0.1, -0.1)}
    state.counters.add(10, 1.0, 0.1)
    state.counters.add(10, 1.0, 0.1)
    out = state.receive({"w": t(0.3, 2.6)}, 5, now, alpha=0.0)
    assert torch.allclose(out["w"], t(0.4, 2.5), atol=1e-6)  # θ_global + (θ_now − θ_proxy)
    assert torch.allclose(state.last_update["w"], t(0.7, -0.6), atol=1e-6)
    assert state.counters.steps == 2  # the steps since the push go into the next Δ


def test_the_spec_field_and_its_default() -> None:
    assert parse_spec({}).sync.late_merge_rule in ("keep", "eager")
    assert parse_spec({"sync": {"lateMergeRule": "eager"}}).sync.late_merge_rule == "eager"
    with pytest.raises(Exception, match=r"lateMergeRule|late_merge_rule"):
        parse_spec({"sync": {"lateMergeRule": "stale"}})


def test_a_learner_moves_to_the_proxy_at_its_push_and_keeps_only_the_steps_from_it() -> None:
    from .test_learner_fragment_sync import FakeLink, make_spec, make_sync, step

    # K = 1 of 2 (τ = overlapSteps = 2, pinned: overlapMode fixed), H = 4, the outer step the
    # spec's (0.7, 0.9, Nesterov); the fake syncer moves the global weights by 0.25·Δ.
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=1, lateMergeRule="eager", overlapMode="fixed"), link)
    sync.fragments[0].track_update = True
    for _ in range(3):
        assert step(sync, w) == {}
    # Step 4: w = 4, Δ = 0 − 4 = −4 over one round; θ_proxy = 0 − 1.33·(−4) = 5.32, given to
    # every rank at once.
    out = step(sync, w)
    assert torch.allclose(out[0]["w"], torch.full((2,), 5.32))
    assert torch.allclose(w.detach(), torch.full((2,), 5.32))
    assert step(sync, w) == {}  # step 5: 6.32
    step(sync, w)  # step 6 = 4 + τ: the weights are 7.32, the merge 0 − 0.25·(−4) = 1
    # θ_global + (θ_now − θ_proxy) = 1 + (7.32 − 5.32) = 3 (keep: 1 + (6 − 4), the same, as the
    # fake steps add 1 wherever they start; only where the steps are taken from differs).
    assert torch.allclose(w.detach(), torch.full((2,), 3.0))
    assert torch.allclose(sync.fragments[0].last_update["w"], torch.full((2,), -1.0))


def test_no_jump_under_keep_or_without_overlap() -> None:
    from .test_learner_fragment_sync import FakeLink, make_spec, make_sync, step

    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=1, lateMergeRule="keep"), link)
    sync.fragments[0].track_update = True
    for _ in range(4):
        assert step(sync, w) == {}  # pushed at step 4, nothing to install
    assert torch.equal(w.detach(), torch.full((2,), 4.0))
    link = FakeLink(outer_lr=0.25)
    sync, w = make_sync(make_spec(quorum=1, overlapSteps=0, lateMergeRule="eager"), link)
    sync.fragments[0].track_update = True
    for _ in range(4):
        step(sync, w)
    # τ = 0: pushed and received at step 4, θ_global = 1 exactly (no proxy in between).
    assert torch.equal(w.detach(), torch.full((2,), 1.0))
