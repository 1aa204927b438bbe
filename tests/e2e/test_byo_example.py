"""examples/byo: the team's own model and data loader, run with `diloco run` as the docs say,
its weights exported with `diloco export` and loaded with plain torch; its cluster manifest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import yaml
from diloco_trainer.api.spec import load_spec

from .conftest import run_to_end

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BYO = REPO / "examples" / "byo"


def _diloco(args: list[str], log: Path, timeout: float) -> int:
    """`diloco ARGS` from the repository root with the example package on PYTHONPATH, as the
    example's local.yaml says to run it; output in `log`."""
    env = {**os.environ, "PYTHONPATH": str(BYO)}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diloco_trainer.cli", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return run_to_end(proc, timeout)


def test_byo_example_trains_exports_and_loads_with_plain_torch(tmp_path: Path) -> None:
    run_dir, summary_file = tmp_path / "run", tmp_path / "summary.json"
    code = _diloco(
        [
            "run",
            str(BYO / "local.yaml"),
            "--workdir",
            str(run_dir),
            "--summary",
            str(summary_file),
            "--quiet",
        ],
        tmp_path / "run.log",
        timeout=600,
    )
    log = (tmp_path / "run.log").read_text()
    assert code == 0, log
    summary = json.loads(summary_file.read_text())
    assert summary["finished"] and summary["outer_steps"] == 6
    initial, final = summary["initial_eval_loss"], summary["final_eval_loss"]
    assert final < initial - 1.5, summary["eval_history"]  # from ~5.5 (uniform over bytes)
    # diloco run says where the weights are and how to get them out: run what it printed.
    printed = re.search(r"^  (\S*diloco) export (\S+) -o model\.safetensors$", log, re.MULTILINE)
    assert printed is not None, log
    program, checkpoint = printed.group(1), Path(printed.group(2))
    assert checkpoint == run_dir  # the run folder: diloco export finds its newest checkpoint
    # Runnable as printed from where diloco run ran: on PATH, or the venv's own script.
    assert program == "diloco" or (REPO / program).is_file(), program

    out = tmp_path / "model.safetensors"
    export_log = tmp_path / "export.log"
    with export_log.open("wb") as f:
        code = subprocess.run(
            [program, "export", str(checkpoint), "-o", str(out)],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(BYO)},
        ).returncode
    assert code == 0, export_log.read_text()

    # The user's side: their package, plain torch and safetensors.
    sys.path.insert(0, str(BYO))
    try:
        from diloco_byo.build import build
        from diloco_byo.model import CharGRU
        from diloco_trainer.models.parts import evaluate

        model = CharGRU()
        model.load_state_dict(safetensors.torch.load_file(out))
        spec = load_spec(BYO / "local.yaml")
        parts = build(
            spec,
            shard_index=0,
            num_shards=1,
            rank=0,
            world_size=1,
            device="cpu",
            with_train=False,
        )
        loss = evaluate(parts, model)
    finally:
        sys.path.remove(str(BYO))
    # The exported weights are the ones the job reported its final eval loss for.
    assert loss == pytest.approx(final, rel=1e-5, abs=1e-6)


def test_byo_manifest_mounts_the_filled_corpus_in_every_learner() -> None:
    from diloco_operator.api import parse_job_spec
    from diloco_operator.resources import JobRef, build_learner_pod_template

    docs = list(yaml.safe_load_all((BYO / "job.yaml").read_text()))
    (job,) = docs  # the text comes from a ConfigMap through an init step, not a claim
    spec = parse_job_spec(job["spec"])
    local = load_spec(BYO / "local.yaml")
    assert spec.model.entrypoint == local.model.entrypoint == "diloco_byo.build:build"
    ref = JobRef(name=job["metadata"]["name"], namespace="team", uid="u-1")
    pod = build_learner_pod_template(ref, spec, 0)["spec"]
    (learner,) = [c for c in pod["containers"] if c["name"] == "learner"]
    (mount,) = [m for m in learner["volumeMounts"] if m["name"] == "corpus"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "corpus"]
    assert "emptyDir" in volume and [c["name"] for c in pod["initContainers"]] == ["fetch-text"]
    assert spec.data.source == mount["mountPath"]
    # The learner's own volumes survive the merge (the template adds, it does not replace).
    assert len(pod["volumes"]) > 1 and len(learner["volumeMounts"]) > 1


def test_byo_dockerfile_adds_the_package_to_the_trainer_image() -> None:
    lines = [
        ln.strip()
        for ln in (BYO / "Dockerfile").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert any(ln.startswith("ARG TRAINER_IMAGE=") and "diloco-trainer" in ln for ln in lines)
    assert "FROM ${TRAINER_IMAGE}" in lines
    copy = next(ln for ln in lines if ln.startswith("COPY "))
    source, target = copy.split()[1:]
    assert (BYO / source).is_dir() and (BYO / source / "build.py").is_file()
    path = next(ln for ln in lines if ln.startswith("ENV PYTHONPATH="))
    assert target.rstrip("/") == f"{path.split('=', 1)[1]}/diloco_byo"
