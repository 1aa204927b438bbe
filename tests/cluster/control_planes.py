"""The control planes of the cluster tier: the binaries built (first run only, progress on the
terminal) and clusters started and stopped through hack/localcluster/harness.py, failing (never
skipping) with a message when something is missing. conftest.py's fixtures call these."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import pytest

from hack.localcluster import harness
from hack.localcluster.harness import ControlPlane

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-binaries.sh"

# First build of the binaries takes ~30 min on 2 cores; later runs reuse the cache.
BUILD_TIMEOUT = float(os.environ.get("DILOCO_K8S_BUILD_TIMEOUT", "3600"))
# All attempts of `local-cluster up` together (one normally takes 10-30 s); kept below the
# pytest timeout of the first cluster test, whose set-up it is.
UP_TIMEOUT = float(os.environ.get("DILOCO_K8S_UP_TIMEOUT", "600"))
UP_ATTEMPTS = 3


def find_go() -> str | None:
    return (
        os.environ.get("GO")
        or shutil.which("go")
        or ("/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None)
    )


def ensure_binaries(config: pytest.Config, log_path: Path) -> Path:
    """Build (first run only) the control-plane binaries and return their directory."""
    override = os.environ.get("DILOCO_K8S_BIN_DIR")
    if override:
        return Path(override)
    if shutil.which("bash") is None:
        pytest.fail("bash is required to build the control-plane binaries (hack/build-binaries.sh)")
    check = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    if check.returncode == 0:
        path = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--print-bin-dir"],
            capture_output=True,
            text=True,
            check=True,
        )
        return Path(path.stdout.strip())
    if find_go() is None:
        pytest.fail(
            "the cluster tier needs the Go toolchain (>= 1.26) to build etcd, kube-apiserver, "
            "kube-controller-manager, kube-scheduler, kubectl, kwok and helm from source, but `go` "
            "is not on PATH or at /usr/local/go/bin/go. Install Go (https://go.dev/dl/) or point "
            "DILOCO_K8S_BIN_DIR at a directory holding those binaries."
        )
    # First run: show the build's progress lines on the terminal despite output capture.
    capman = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None and capman is not None:
            with capman.global_and_fixture_disabled():
                reporter.write_line(line)

    say(f"building the control-plane binaries (first run only, ~30 min); log: {log_path}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["bash", str(BUILD_SCRIPT)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        timer = threading.Timer(BUILD_TIMEOUT, proc.kill)
        timer.start()
        lines: list[str] = []
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                lines.append(line.rstrip("\n"))
                if line.startswith("[build-binaries]"):
                    say(line.rstrip("\n"))
            rc = proc.wait()
        finally:
            timer.cancel()
    if rc != 0 or not lines:
        pytest.fail(
            f"building the control-plane binaries failed (exit {rc}); log: {log_path}\n"
            + harness.tail_lines("\n".join(lines))
        )
    return Path(lines[-1])


def start_control_plane(name: str, base: Path, bin_dir: Path) -> ControlPlane:
    if shutil.which("openssl") is None:
        pytest.fail("the cluster tier needs `openssl` to create the cluster certificates")
    # A failed start (a component dies or misses its deadline on a loaded 2-core machine, a
    # port taken between choice and bind) is retried by `up` itself, each attempt with new
    # ports, certificates and etcd data, all within its timeout.
    try:
        cp, retried = harness.start_control_plane(
            base / name, name=name, attempts=UP_ATTEMPTS, timeout=UP_TIMEOUT, bin_dir=bin_dir
        )
    except harness.ClusterStartError as e:
        failure = str(e)
    else:
        if retried:  # visible in the run's warnings summary, so flakes do not go unseen
            warnings.warn(
                f"local-cluster up --dir {cp.dir} needed retries: " + "; ".join(retried),
                stacklevel=1,
            )
        return cp
    pytest.fail(failure)


def stop_control_plane(cp: ControlPlane) -> None:
    # Keep the component logs in pytest's (rotated) temp dir for post-mortems.
    warning = harness.stop_control_plane(cp, keep_logs=True)
    if warning:
        warnings.warn(warning, stacklevel=1)


def binaries_cached() -> bool:
    if os.environ.get("DILOCO_K8S_BIN_DIR"):
        return True
    check = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    return check.returncode == 0
