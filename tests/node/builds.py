"""Running the hack/ build scripts from the node tier's fixtures: instant when their cache is
full, otherwise a build whose progress lines reach the terminal despite output capture."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HACK_DIR = Path(__file__).resolve().parents[2] / "hack"
BUILD_TIMEOUT = float(os.environ.get("DILOCO_NODE_BUILD_TIMEOUT", "3600"))
# Scripts that build from Go sources (build-images.sh needs no Go).
GO_SCRIPTS = ("build-binaries.sh", "build-node.sh")


def say(config: pytest.Config, line: str) -> None:
    """A line on the terminal despite output capture (build progress)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None and capman is not None:
        with capman.global_and_fixture_disabled():
            reporter.write_line(line)


def run_build(config: pytest.Config, script: str, log_path: Path) -> Path:
    """Run hack/SCRIPT, its progress lines on the terminal; the directory it prints last."""
    if (
        script in GO_SCRIPTS
        and shutil.which("go") is None
        and not os.access("/usr/local/go/bin/go", os.X_OK)
        and subprocess.run(["bash", str(HACK_DIR / script), "--check"], check=False).returncode
    ):
        pytest.fail(f"the node tier needs Go >= 1.26 to run hack/{script} (nothing is cached)")
    lines: list[str] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", str(HACK_DIR / script)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            lines.append(line.rstrip("\n"))
            if line.startswith("[build-") and "using" not in line:
                say(config, line.rstrip("\n"))
        rc = proc.wait(timeout=BUILD_TIMEOUT)
    if rc != 0 or not lines:
        pytest.fail(f"hack/{script} failed (exit {rc}); log: {log_path}\n" + "\n".join(lines[-30:]))
    return Path(lines[-1])
