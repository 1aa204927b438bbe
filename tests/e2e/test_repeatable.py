"""A seeded K = M job with no overlap repeats bit for bit (docs/algorithm.md, "What a seed
repeats"): two real `diloco run` processes of the same job, run side by side so that each
loads the other and their pushes reach their syncers in different orders, end with the same
weights, byte for byte, and the same merge log's losses."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diloco_trainer.api.spec import JobSpec
from safetensors.torch import load_file

from .conftest import run_to_end

pytestmark = pytest.mark.e2e


def k_equals_m_job(make_spec: Callable[..., JobSpec]) -> JobSpec:
    """Three islands, every one in every merge (quorum 3), no overlap, rounds of H, int8 on the
    wire (its pushes folded from their encoded bytes, as the default codec's are), two
    fragments."""
    return make_spec(
        islands={"count": 3, "replicas": 1},
        inner={
            "steps": 4,
            "batchSize": 2,
            "seqLen": 32,
            "lr": 3e-3,
            "warmupSteps": 2,
            "stepsPerIsland": "fixed",  # auto sizes rounds from measured step times
        },
        sync={
            "quorum": 3,
            "fragments": 2,
            "overlapSteps": 0,
            "compression": "int8",
            "heartbeatTimeoutSeconds": 60,
        },
        stopAfter={"outerSteps": 4},
        syncer={"checkpoint": {"everyOuterSteps": 4, "keep": 1}},
    )


def run_options(folder: Path) -> list[str]:
    return ["--workdir", str(folder), "--quiet"]


def start_run(config: Path, folder: Path) -> subprocess.Popen[bytes]:
    """`diloco run CONFIG --workdir FOLDER`, its own process group, output in FOLDER.log."""
    log = folder.with_suffix(".log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "diloco_trainer.cli", "run", str(config), *run_options(folder)],
        cwd=config.parent,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[bytes], folder: Path) -> None:
    code = run_to_end(proc)
    assert code == 0, folder.with_suffix(".log").read_text()


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    newest = max((folder / "syncer" / "checkpoints").glob("ckpt-*"))
    return load_file(str(newest / "weights.safetensors"))


def merges(folder: Path) -> list[dict]:
    lines = (folder / "syncer" / "merges.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_seeded_k_equals_m_job_repeats_bit_for_bit(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> None:
    config = workdir / "job.json"
    config.write_text(k_equals_m_job(make_spec).to_json())
    folders = [workdir / "first", workdir / "second"]
    procs = [start_run(config, folder) for folder in folders]
    for proc, folder in zip(procs, folders, strict=True):
        finish(proc, folder)
    first, second = (final_weights(folder) for folder in folders)
    assert first.keys() == second.keys() and first
    for name in first:
        assert torch.equal(first[name], second[name]), name
    # every merge held every island's push of the same round, with the same losses
    # (matched by fragment and version: the drain pushes both fragments at once, and which of
    # their last merges is written first is the syncer's threads' race, not the schedule's)
    logs = [
        sorted(merges(folder), key=lambda m: (m["fragment"], m["version"])) for folder in folders
    ]
    assert len(logs[0]) == len(logs[1]) >= 8  # 2 fragments x 4 outer steps
    for a, b in zip(*logs, strict=True):
        assert (a["fragment"], a["version"]) == (b["fragment"], b["version"])
        assert len(a["contributors"]) == 3
        losses = [[(c["island"], c["loss"], c["steps"]) for c in m["contributors"]] for m in (a, b)]
        assert losses[0] == losses[1], (a["fragment"], a["version"])
    summaries = [json.loads((folder / "summary.json").read_text()) for folder in folders]
    assert summaries[0]["final_eval_loss"] == summaries[1]["final_eval_loss"]
