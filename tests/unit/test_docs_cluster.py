"""docs/cluster.md as written: its sampling snippet runs on a file `diloco export` writes, and
its commands name the example's job, files and images."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from diloco_trainer.export import write_weights
from diloco_trainer.models.model import build_model

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/cluster.md"
EXAMPLE = ROOT / "examples/gpt-on-my-text/job.yaml"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), re.DOTALL)


def test_docs_cluster_sampling_snippet_runs_on_an_exported_model(tmp_path: Path) -> None:
    (snippet,) = _blocks("python")
    job = yaml.safe_load(EXAMPLE.read_text())["spec"]
    torch.manual_seed(0)
    model = build_model(job["model"]["preset"], job["inner"]["seqLen"], 256)
    write_weights(dict(model.named_parameters()), tmp_path / "model.safetensors", {"job": "x"})
    out = subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert out.startswith("The island ")
    assert len(out.encode()) >= len("The island ") + 150  # 200 bytes sampled (some multi-byte)


def test_docs_cluster_commands_name_the_example() -> None:
    text = PAGE.read_text()
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    named = set(re.findall(r"dj[/ ]([\w-]+)", text)) | set(
        re.findall(r"deploy/([\w-]+)-syncer", text)
    )
    assert named == {name}, named
    bash = "\n".join(_blocks("bash"))
    for path in re.findall(r"(examples/[\w./-]+)", bash):
        assert (ROOT / path).exists(), path
    # One registry variable: every image the commands build, push or install is $REGISTRY's.
    images = re.findall(r"-t (\S+)|image\.repository=(\S+)", bash)
    assert images and all(i.startswith("$REGISTRY/") for pair in images for i in pair if i)
