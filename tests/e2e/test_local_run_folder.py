"""`diloco run` into its run folder, resumed, and exported from it (issue 48): runs/NAME holds the
weights, logs, summary and plot; running the same command again resumes and the summary covers
both sessions; `diloco export runs/NAME` writes the weights with what loading them needs, and
`diloco sample` generates text from either."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from diloco_trainer.api.spec import JobSpec
from safetensors import safe_open

pytestmark = pytest.mark.e2e


def diloco(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diloco_trainer.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_run_folder_resume_and_export(workdir: Path, make_spec: Callable[..., JobSpec]) -> None:
    spec = make_spec(
        islands={"count": 2},
        sync={"quorum": 2, "fragments": 2, "overlapSteps": 1},
        stopAfter={"outerSteps": 2},
    )
    manifest = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": "folder-test"},
        "spec": json.loads(spec.to_json()),
    }
    config = workdir / "job.yaml"
    config.write_text(yaml.safe_dump(manifest))
    first = diloco(["run", str(config)], workdir)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    folder = workdir / "runs" / "folder-test"
    assert "run folder runs/folder-test" in out, out
    for part in ("syncer", "logs", "summary.json", "loss.png", "spec.json", "run.json"):
        assert (folder / part).exists(), part
    assert "diloco export runs/folder-test -o model.safetensors" in " ".join(out.split()), out
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["sessions"] == 1 and summary["outer_steps"] >= 2

    # The same command again resumes from the folder's checkpoint; the summary is the job's.
    again = diloco(["run", str(config)], workdir)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out
    assert "resuming from the checkpoints in runs/folder-test" in out, out
    resumed = json.loads((folder / "summary.json").read_text())
    assert resumed["sessions"] == 2
    assert resumed["wall_seconds"] > summary["wall_seconds"]
    assert resumed["bytes_pushed"] >= summary["bytes_pushed"]

    exported = diloco(["export", "runs/folder-test", "-o", "model.safetensors"], workdir)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    with safe_open(str(workdir / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["preset"], meta["seqLen"], meta["tokenizer"]) == ("gpt-tiny", "32", "bytes")
    assert meta["job"] == "folder-test"

    # `diloco sample` generates from the run folder and from its export alike (one seed, one
    # text), the prompt continued with bytes of the trained model.
    args = ["--prompt", "def ", "--tokens", "40", "--seed", "3"]
    from_folder = diloco(["sample", "runs/folder-test", *args], workdir)
    assert from_folder.returncode == 0, from_folder.stderr
    assert from_folder.stdout.startswith("def ") and len(from_folder.stdout) > len("def ")
    assert "gpt-tiny from" in from_folder.stderr
    from_file = diloco(["sample", "model.safetensors", *args], workdir)
    assert (from_file.returncode, from_file.stdout) == (0, from_folder.stdout), from_file.stderr
