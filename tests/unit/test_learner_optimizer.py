"""The inner AdamW across rounds: receiving a fragment leaves its state alone, and a learner
that joins a running job re-warms its learning rate (its AdamW is fresh)."""

from __future__ import annotations

import threading

import pytest
import torch
from diloco_trainer.api.contract import LearnerEnv
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.learner.loop import Learner
from diloco_trainer.models.parts import inner_lr

SPEC = {
    "model": {"preset": "gpt-tiny"},
    "data": {"evalTokens": 2048},
    "inner": {"steps": 4, "batchSize": 2, "seqLen": 16, "lr": 1e-3, "warmupSteps": 10},
    "sync": {"fragments": 1},
}


def learner() -> Learner:
    env = LearnerEnv.offline(device="cpu", job_name="t")
    out = Learner(parse_spec(SPEC), env, "cpu", threading.Event())
    out.layout = [list(out.params)]
    return out


def test_receiving_a_fragment_keeps_the_adamw_state() -> None:
    torch.manual_seed(0)
    lrn = learner()
    for _ in range(3):
        lrn._inner_step()
    state = lrn.optimizer.state
    before = {n: {k: v.clone() for k, v in state[p].items()} for n, p in lrn.params.items()}
    objects = {n: state[p]["exp_avg"] for n, p in lrn.params.items()}
    targets = {n: p.detach().clone() + 1.0 for n, p in lrn.params.items()}
    lrn._apply([0], {0: targets})
    for n, p in lrn.params.items():
        assert torch.equal(p.detach(), targets[n])
        assert state[p]["exp_avg"] is objects[n]
        for k, v in before[n].items():
            assert torch.equal(state[p][k], v), (n, k)
    lrn._inner_step()
    p0 = next(iter(lrn.params.values()))
    assert float(state[p0]["step"]) == 4.0  # the fourth step of the same AdamW, not a fresh one


def test_a_learner_joining_mid_job_rewarms_its_learning_rate() -> None:
    lrn = learner()
    lrn.lr_offset = 100  # joined at outer step 25 of H = 4
    lrn._inner_step()
    expected = inner_lr(lrn.spec, 100) * (1 / 10)
    assert lrn.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    for _ in range(9):
        lrn._inner_step()
    assert lrn.optimizer.param_groups[0]["lr"] == pytest.approx(inner_lr(lrn.spec, 109))


def test_a_learner_at_the_job_start_follows_the_schedule() -> None:
    lrn = learner()
    lrn._inner_step()
    assert lrn.optimizer.param_groups[0]["lr"] == pytest.approx(inner_lr(lrn.spec, 0))
