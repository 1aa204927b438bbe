"""`diloco submit` and `diloco export --job` (issue 48's cluster path): the manifest's images
moved to the user's registry, the text's ConfigMap, refusals before anything is created (exit 2,
the field named), and the export's kubectl steps. The real cluster run is
tests/node/test_readme_cluster_path.py."""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_trainer import cluster_path as cp

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gpt-on-my-text" / "job.yaml"
CORPUS = REPO / "examples" / "byo" / "sample-corpus"


class Recorder:
    """kubectl as the cluster would answer, each call recorded (the node test runs the real one)."""

    def __init__(self, answers: dict[str, bytes] | None = None) -> None:
        self.calls: list[tuple[list[str], bytes | None]] = []
        self.timeouts: list[float | None] = []
        self.answers = answers or {}

    def __call__(
        self, args: Sequence[str], stdin: bytes | None, timeout: float | None
    ) -> subprocess.CompletedProcess[bytes]:
        self.calls.append((list(args), stdin))
        self.timeouts.append(timeout)
        key = " ".join(args)
        out = next((v for k, v in self.answers.items() if k in key), b"")
        return subprocess.CompletedProcess(list(args), 0, out, b"")


def test_registry_replaces_the_placeholder_everywhere_and_only_it() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    moved = cp.with_registry(doc, "registry.example.com/you/")
    text = json.dumps(moved)
    assert cp.PLACEHOLDER not in text and cp.placeholder_images(moved) == []
    assert moved["spec"]["image"] == "registry.example.com/you/diloco-trainer:0.1.0"
    init = moved["spec"]["islands"]["template"]["spec"]["initContainers"][0]
    assert init["image"] == "registry.example.com/you/diloco-trainer:0.1.0"
    # Everything else is the same document.
    assert cp.with_registry(doc, cp.PLACEHOLDER) == doc
    assert moved["spec"]["inner"] == doc["spec"]["inner"]


def test_configmap_of_a_folder(tmp_path: Path) -> None:
    assert cp.configmap_names(yaml.safe_load(EXAMPLE.read_text())) == ["my-text"]
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "b.bin").write_bytes(b"\xff\x00")
    (tmp_path / "sub").mkdir()
    cm = cp.configmap_manifest("my-text", tmp_path, "ns1")
    assert cm["metadata"] == {"name": "my-text", "namespace": "ns1"}
    assert cm["data"] == {"a.txt": "hello\n"}
    assert base64.b64decode(cm["binaryData"]["b.bin"]) == b"\xff\x00"


def _submit_args(config: Path, **kw: Any) -> argparse.Namespace:
    return argparse.Namespace(
        config=str(config), registry=kw.get("registry"), data=kw.get("data"), namespace=kw.get("ns")
    )


def test_submit_applies_the_configmap_then_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    kubectl = Recorder({"apply": b"dilocojob.diloco.dev/gpt-on-my-text created"})
    args = _submit_args(EXAMPLE, registry="reg.example/you", data=str(CORPUS), ns="team")
    assert cp.submit(args, kubectl) == 0
    out = capsys.readouterr().out
    assert [c[0] for c in kubectl.calls] == [["apply", "-n", "team", "-f", "-"]] * 2
    cm = json.loads(kubectl.calls[0][1] or b"")
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "my-text"
    assert sorted(cm["data"]) == sorted(p.name for p in CORPUS.iterdir())
    job = yaml.safe_load(kubectl.calls[1][1] or b"")
    assert job["spec"]["image"] == "reg.example/you/diloco-trainer:0.1.0"
    assert job["spec"]["data"]["source"] == "/data"  # the pods' path, not the local copy
    assert "diloco export --job gpt-on-my-text -n team" in out
    assert "kubectl get dj gpt-on-my-text -n team -w" in out


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ("no-registry", "spec.image"),
        ("bare-spec", "kind"),
        ("two-configmaps", "--data"),
        ("bad-field", "sync.fragments (200)"),
        ("empty-data", "holds no files"),
    ],
)
def test_submit_refuses_before_creating_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str, needle: str
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    data = str(CORPUS)
    registry: str | None = "reg.example/you"
    if change == "no-registry":
        registry = None
    elif change == "bare-spec":
        doc = doc["spec"]
    elif change == "two-configmaps":
        doc["spec"]["syncer"]["template"]["spec"]["volumes"][1]["configMap"]["name"] = "other"
    elif change == "bad-field":
        doc["spec"]["sync"]["fragments"] = 200  # more than gpt-tiny's tensors: the shared rule
    elif change == "empty-data":
        data = str(tmp_path / "empty")
        Path(data).mkdir()
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(doc))
    kubectl = Recorder()
    assert cp.submit(_submit_args(config, registry=registry, data=data), kubectl) == 2
    assert kubectl.calls == []  # nothing was created
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_export_job_runs_the_export_in_the_syncer_pod_and_copies_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pods = {"items": [
        {"metadata": {"name": "j-syncer-abc"}, "status": {"phase": "Running"}},
        {"metadata": {"name": "j-syncer-old", "deletionTimestamp": "x"},
         "status": {"phase": "Running"}},
    ]}  # fmt: skip
    kubectl = Recorder({
        "get pods": json.dumps(pods).encode(),
        " ls ": b"model.safetensors\nmodel.tokenizer.json\n",
        "cat /var/lib/diloco/export/model.safetensors": b"\x00weights",
        "cat /var/lib/diloco/export/model.tokenizer.json": b"{}",
        "diloco export": b"wrote /var/lib/diloco/export/model.safetensors",
    })  # fmt: skip
    out_dir = tmp_path / "j"
    args = argparse.Namespace(
        job="j", namespace=None, output=str(out_dir), wait="1h", dtype="float32"
    )
    assert cp.export_job(args, kubectl) == 0
    calls = [c[0] for c in kubectl.calls]
    assert calls[0] == ["get", "dj", "j", "-o", "name"]
    assert calls[1][:2] == ["wait", "dj/j"] and "--timeout=1h" in calls[1]
    # The wait is bounded by --wait alone (a job trains for longer than one kubectl call's limit).
    assert kubectl.timeouts[1] is None and kubectl.timeouts[0] == cp.KUBECTL_TIMEOUT_S
    export = next(c for c in calls if "diloco" in c)
    assert export[:5] == ["exec", "j-syncer-abc", "-c", "syncer", "--"]
    assert export[5:] == [
        "diloco", "export", "/var/lib/diloco", "--config", "/etc/diloco/config/spec.json",
        "-o", "/var/lib/diloco/export/model.safetensors", "--dtype", "float32",
    ]  # fmt: skip
    assert (out_dir / "model.safetensors").read_bytes() == b"\x00weights"
    assert (out_dir / "model.tokenizer.json").read_text() == "{}"
    assert f"diloco sample {out_dir}" in capsys.readouterr().out


def test_export_job_without_a_running_syncer_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    kubectl = Recorder({"get pods": b'{"items": []}'})
    args = argparse.Namespace(job="j", namespace="n", output=None, wait="0s", dtype="float32")
    assert cp.export_job(args, kubectl) == 1
    assert "no running syncer pod" in capsys.readouterr().err
    assert not any(c[0][0] == "wait" for c in kubectl.calls)  # --wait 0s: no wait


def test_a_kubectl_that_does_not_answer_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    # A real process that never answers (it reads a pipe whose writing end this test holds
    # open) is killed at the limit: the error names the call, no traceback.
    def slow(args: Sequence[str], stdin: bytes | None, timeout: float | None) -> Any:
        read_end, write_end = os.pipe()
        try:
            return subprocess.run(
                [sys.executable, "-c", "import sys; sys.stdin.read()"],
                stdin=read_end,
                timeout=0.2,
                check=False,
            )
        finally:
            os.close(read_end)
            os.close(write_end)

    args = argparse.Namespace(job="j", namespace=None, output=None, wait="0s", dtype="float32")
    assert cp.export_job(args, slow) == 1
    assert "kubectl get dj j -o name gave no answer" in capsys.readouterr().err


def test_export_job_wants_a_folder(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(job="j", namespace=None, output="m.safetensors", wait="0s",
                              dtype="float32")  # fmt: skip
    assert cp.export_job(args, Recorder()) == 2
    assert "-o DIR" in capsys.readouterr().err
