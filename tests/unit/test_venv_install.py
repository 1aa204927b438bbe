"""hack/venv_install.py (issue 48, the slim install): torch's CPU build where the platform allows,
kept when installed, from TORCH_WHEELS offline, and a fallback to PyPI when the CPU index cannot
be reached (a real pip against a closed port)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from hack import venv_install as vi
from hack.localcluster.ports import free_port

LINUX = {"system": "Linux", "machine": "x86_64", "wheels": ""}


def test_linux_x86_64_takes_the_cpu_index_with_a_fallback() -> None:
    step = vi.torch_step(have_torch=False, **LINUX)
    assert step.pip_args[:3] == ("install", "--index-url", vi.PYTORCH_CPU_INDEX)
    assert step.pip_args[-1] == "torch>=2.2" and "PyPI" in step.fallback
    # A bounded wait on an unreachable index, not pip's default retries.
    assert step.pip_args[step.pip_args.index("--retries") + 1] == str(vi.INDEX_RETRIES)
    mirror = vi.torch_step(have_torch=False, cpu_index="http://mirror/cpu", **LINUX)
    assert mirror.pip_args[2] == "http://mirror/cpu"


def test_kept_wheels_and_other_platforms() -> None:
    assert vi.torch_step(have_torch=True, **LINUX).pip_args == ()
    wheels = vi.torch_step(
        have_torch=False, system="Linux", machine="x86_64", wheels="w", wheel_version="2.13.0+cpu"
    )
    # Pinned to the folder's version: PyPI's build (a newer CUDA one) never wins.
    assert wheels.pip_args == ("install", "--find-links", "w", "torch==2.13.0+cpu")
    assert wheels.fallback == ""  # a folder that was asked for and fails is an error
    for system, machine in (("Darwin", "arm64"), ("Linux", "aarch64")):
        step = vi.torch_step(have_torch=False, system=system, machine=machine, wheels="")
        assert step.pip_args == () and "PyPI" in step.why


def test_an_unreachable_cpu_index_falls_back_to_pypi(capsys: pytest.CaptureFixture[str]) -> None:
    # A real pip against a closed local port: it fails, and the install goes on with the project
    # (whose install, recorded here rather than run, then takes torch from PyPI).
    closed = f"http://127.0.0.1:{free_port()}/simple"
    step = vi.torch_step(have_torch=False, cpu_index=closed, **LINUX)
    calls: list[Sequence[str]] = []

    def run(args: Sequence[str]) -> int:
        calls.append(args)
        if "--index-url" not in args:
            return 0
        # --ignore-installed: this environment has torch, so pip must ask the index.
        extra = ["--dry-run", "--no-deps", "--no-cache-dir", "--ignore-installed"]
        cmd = [sys.executable, "-m", "pip", *args, *extra]
        return subprocess.run(cmd, capture_output=True, timeout=120, check=False).returncode

    assert vi.install("trainer,local", step, run, project=Path("proj")) == 0
    out = capsys.readouterr().out
    assert f"{closed} could not be reached" in out
    assert [c[0] for c in calls] == ["install", "install"]
    assert list(calls[1]) == ["install", "--quiet", "-e", "proj[trainer,local]"]


def test_a_failed_wheel_folder_stops_the_install() -> None:
    step = vi.TorchStep("torch from TORCH_WHEELS=w", ("install", "torch"))
    calls: list[Sequence[str]] = []
    assert vi.install("dev", step, lambda a: calls.append(a) or 1) == 1
    assert len(calls) == 1  # the project was not installed over a missing torch


def test_wheel_version_is_the_newest_in_the_folder(tmp_path: Path) -> None:
    for name in ("torch-2.9.1+cpu-cp311-cp311-linux_x86_64", "torch-2.13.0+cpu-cp311-cp311-x"):
        (tmp_path / f"{name}.whl").write_bytes(b"")
    (tmp_path / "numpy-9.0-cp311-cp311-x.whl").write_bytes(b"")
    assert vi.wheel_version(tmp_path) == "2.13.0+cpu"  # 13 > 9 as numbers, not as text


def test_wheel_folder_without_torch_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TORCH_WHEELS", str(tmp_path))
    assert vi.main(["dev"]) == 2
    assert "holds no torch-*.whl" in capsys.readouterr().err
