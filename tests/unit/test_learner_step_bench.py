"""bench/learner_step.py and `diloco run`'s learner device: the benchmark runs both sides on a
tiny model and reports consistent figures; DILOCO_DEVICE reaches the local learners."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_trainer.api import contract
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.local.run import LocalRun
from rich.console import Console

from bench import learner_step


def test_learner_step_bench_reports_both_sides_and_their_ratio() -> None:
    args = learner_step.parse_args(
        [
            "--preset=gpt-tiny",
            "--batch-size=2",
            "--micro-batches=2",
            "--seq-len=16",
            "--steps=2",
            "--warmup=1",
            "--rounds=1",
            "--precision=bf16",
            "--data-batches=5",
        ]
    )
    result = learner_step.run(args)
    # gpt-tiny at seqLen 16: 2 blocks of 12·64² + 13·64, embeddings and head 2·256·64, 16
    # positions x 64, the final LayerNorm 2·64.
    assert result["parameters"] == 2 * (12 * 64**2 + 13 * 64) + 2 * 256 * 64 + 16 * 64 + 2 * 64
    for side in ("plain", "learner"):
        figures = result[side]
        # 2 steps of 2 x 2 x 16 = 64 tokens each.
        assert figures["tokens_per_s"] == pytest.approx(64 * figures["steps_per_s"])
        assert figures["peak_memory_gib"] > 0
    assert result["ratio_learner_to_plain"] == pytest.approx(
        result["learner"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
    )
    assert "learner / plain tokens/s" in learner_step.report(result)


def test_local_learners_run_on_diloco_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = parse_spec({"islands": {"count": 2}})
    run = LocalRun("t", spec, tmp_path, {}, Console(), devices={1: "cpu"})
    monkeypatch.delenv(contract.DEVICE, raising=False)
    assert run._learner_env(0)[contract.DEVICE] == "cpu"
    monkeypatch.setenv(contract.DEVICE, "cuda")
    env = run._learner_env(0)
    assert env[contract.DEVICE] == "cuda"
    assert int(env["OMP_NUM_THREADS"]) >= 1
    # --island-device 1=cpu: island 1 on the CPU beside the job's cuda
    assert run._learner_env(1)[contract.DEVICE] == "cpu"
