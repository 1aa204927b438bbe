"""The learner's inner step (learner/inner_step.py): gradient accumulation gives the larger
batch's loss and update, token counts and the learning-rate schedule follow the step, bf16 keeps
fp32 master weights, fp16 is refused off CUDA with the field named."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_trainer.api import contract
from diloco_trainer.api.contract import LearnerEnv
from diloco_trainer.api.spec import ConfigError, parse_spec
from diloco_trainer.learner import loop
from diloco_trainer.learner.inner_step import check_precision, compiled
from diloco_trainer.learner.loop import Learner
from diloco_trainer.models.parts import inner_lr


def make_spec(**inner: Any) -> dict[str, Any]:
    return {
        "model": {"preset": "gpt-tiny", "seed": 5},
        "data": {"evalTokens": 2048},
        "inner": {"steps": 4, "seqLen": 16, "lr": 1e-3, "warmupSteps": 10, **inner},
        "sync": {"fragments": 1},
    }


def learner(doc: dict[str, Any]) -> Learner:
    env = LearnerEnv.offline(device="cpu", job_name="t")
    return Learner(parse_spec(doc), env, "cpu", threading.Event())


def test_micro_batches_give_the_larger_batchs_loss_and_weights() -> None:
    # 2 micro-batches of 2 sequences read the same windows, in the same order, as 1 batch of 4:
    # the mean of the halves' mean losses is the whole batch's mean loss, and so is the gradient.
    whole = learner(make_spec(batchSize=4, microBatches=1))
    halves = learner(make_spec(batchSize=2, microBatches=2))
    for _ in range(3):
        loss_whole, tokens_whole = whole._inner_step()
        loss_halves, tokens_halves = halves._inner_step()
        assert loss_halves == pytest.approx(loss_whole, rel=0.01)
        assert loss_halves == pytest.approx(loss_whole, rel=1e-5)  # in fact equal up to rounding
        assert tokens_halves == tokens_whole == 4 * 16
    for name, p in whole.params.items():
        torch.testing.assert_close(halves.params[name], p, rtol=1e-4, atol=1e-6)


def test_micro_batches_count_tokens_and_follow_the_schedule_per_optimizer_step() -> None:
    lrn = learner(make_spec(batchSize=2, microBatches=3))
    loss, tokens = lrn._inner_step()
    assert tokens == 2 * 3 * 16 == 96
    assert loss > 0
    lrn._inner_step()
    # Two inner steps are two optimizer steps (not six), at the schedule's second step.
    p0 = next(iter(lrn.params.values()))
    assert float(lrn.optimizer.state[p0]["step"]) == 2.0
    assert lrn.optimizer.param_groups[0]["lr"] == pytest.approx(inner_lr(lrn.spec, 1))
    assert lrn.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 2 / 10)
    assert lrn.parts.train is not None
    assert lrn.parts.train.tokens_consumed == 2 * 96  # type: ignore[attr-defined]


def test_bf16_runs_the_forward_in_bf16_and_keeps_fp32_master_weights() -> None:
    fp32 = learner(make_spec(batchSize=2))
    bf16 = learner(make_spec(batchSize=2, precision="bf16"))
    seen: list[torch.dtype] = []
    bf16.model.head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    loss32, _ = fp32._inner_step()
    loss16, _ = bf16._inner_step()
    assert seen == [torch.bfloat16]
    # bf16 keeps about 3 significant digits: the same first loss within 2%, but not bit-equal.
    assert loss16 == pytest.approx(loss32, rel=0.02)
    assert loss16 != loss32
    for p in bf16.params.values():
        assert p.dtype == torch.float32
        assert p.grad is not None and p.grad.dtype == torch.float32
        state = bf16.optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_fp16_is_refused_off_cuda_with_the_field_named() -> None:
    with pytest.raises(ConfigError, match=r"inner\.precision fp16 needs a CUDA device"):
        check_precision("fp16", "cpu")
    with pytest.raises(ConfigError, match=r"inner\.precision"):
        learner(make_spec(precision="fp16"))
    check_precision("bf16", "cpu")
    check_precision("fp32", "cpu")


def learner_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any], **extra: str
) -> None:
    """A learner's contract variables for `spec` on the CPU, a syncer nobody answers at."""
    config = tmp_path / "spec.json"
    config.write_text(json.dumps(spec))
    token = tmp_path / "token"
    token.write_text("t" * 32)
    for name, value in {
        contract.ISLAND: "island-0",
        contract.SYNCER_URL: "http://127.0.0.1:1",
        contract.TOKEN_FILE: str(token),
        contract.CONFIG_FILE: str(config),
        contract.DEVICE: "cpu",
        **extra,
    }.items():
        monkeypatch.setenv(name, value)


def test_learner_exits_2_for_fp16_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    learner_environment(tmp_path, monkeypatch, make_spec(precision="fp16"))
    assert loop.main(argparse.Namespace()) == 2
    assert "inner.precision fp16" in caplog.text


def test_learner_exits_2_for_an_unknown_pull_apply_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    learner_environment(tmp_path, monkeypatch, make_spec(), DILOCO_PULL_APPLY="gpu")
    assert loop.main(argparse.Namespace()) == 2
    assert "DILOCO_PULL_APPLY='gpu'" in caplog.text


def test_compile_wraps_the_module_it_trains_and_keeps_its_parameters() -> None:
    model = torch.nn.Linear(3, 2)
    assert compiled(model, False) is model
    wrapped = compiled(model, True)
    assert wrapped is not model
    assert getattr(wrapped, "_orig_mod", None) is model
    assert list(wrapped.parameters()) == list(model.parameters())
