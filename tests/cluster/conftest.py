"""Fixtures for the cluster tier: a real control plane started by hack/local-cluster.

etcd, kube-apiserver (RBAC), kube-controller-manager, kube-scheduler and kwok (fake nodes
whose pods become Running and Ready without containers) run as local processes on loopback.
The binaries are built once from pinned sources by hack/build-binaries.sh and cached.

Fixtures:
  k8s_bin_dir         session-scoped: the directory of the built binaries
  control_plane       session-scoped ControlPlane: .kubeconfig, .env, .bin_dir, .kubectl(...)
  make_control_plane  session-scoped factory: make_control_plane("region-b") starts (or
                      returns the already started) extra cluster with that name
  kubectl             the kubectl(*args) helper of control_plane
  namespace           a fresh namespace per test (deleted afterwards)

ControlPlane, kubectl and polling come from hack/localcluster/harness.py, which the operator
benchmark shares; `wait_until`/`holds_for` here are its pytest-flavoured wrappers (a timeout
fails the test). The cluster is only started when a test asks for one of the fixtures. If Go is
missing or the build fails, the fixture fails (never skips) with a message saying what is
missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from hack.localcluster import harness
from hack.localcluster.harness import ControlPlane, StoppedHolding, WaitTimeout

REPO_ROOT = Path(__file__).resolve().parents[2]
HACK_DIR = REPO_ROOT / "hack"
LOCAL_CLUSTER = harness.LOCAL_CLUSTER
BUILD_SCRIPT = HACK_DIR / "build-binaries.sh"

# First build of the binaries takes ~30 min on 2 cores; later runs reuse the cache.
BUILD_TIMEOUT = float(os.environ.get("DILOCO_K8S_BUILD_TIMEOUT", "3600"))
# All attempts of `local-cluster up` together (one normally takes 10-30 s); kept below the
# pytest timeout of the first cluster test, whose set-up it is.
UP_TIMEOUT = float(os.environ.get("DILOCO_K8S_UP_TIMEOUT", "600"))
UP_ATTEMPTS = 3

T = TypeVar("T")


# ----------------------------------------------------------------------------------- helpers


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 60.0,
    interval: float = 0.2,
    message: str = "condition",
) -> T:
    """Poll predicate() until it returns a truthy value and return that value.

    Fails the test after `timeout` seconds, quoting the last exception raised by predicate.
    """
    try:
        return harness.poll_until(
            predicate, timeout=timeout, interval=interval, what=message, ignore=(Exception,)
        )
    except WaitTimeout as e:
        error = str(e)  # failed outside the handler: the report shows one message, no chain
    pytest.fail(error)


def holds_for(
    predicate: Callable[[], bool],
    duration: float = 3.0,
    interval: float = 0.2,
    message: str = "condition",
) -> None:
    """Check predicate() repeatedly for `duration` seconds; fail the first time it is false."""
    try:
        harness.holds_for(predicate, duration=duration, interval=interval, what=message)
        return
    except StoppedHolding as e:
        error = str(e)
    pytest.fail(error)


# ----------------------------------------------------------------------------------- startup


def _find_go() -> str | None:
    return (
        os.environ.get("GO")
        or shutil.which("go")
        or ("/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None)
    )


def _ensure_binaries(config: pytest.Config, log_path: Path) -> Path:
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
    if _find_go() is None:
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


def _start_control_plane(name: str, base: Path, bin_dir: Path) -> ControlPlane:
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


def _stop_control_plane(cp: ControlPlane) -> None:
    # Keep the component logs in pytest's (rotated) temp dir for post-mortems.
    warning = harness.stop_control_plane(cp, keep_logs=True)
    if warning:
        warnings.warn(warning, stacklevel=1)


# ----------------------------------------------------------------------------------- fixtures


def _binaries_cached() -> bool:
    if os.environ.get("DILOCO_K8S_BIN_DIR"):
        return True
    check = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    return check.returncode == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of this directory `cluster`; give them time for a first build."""
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.path)).parents]
    if not mine:
        return
    cached = _binaries_cached()
    for item in mine:
        item.add_marker(pytest.mark.cluster)
        if not cached:
            # The session fixture's set-up (the build) counts against the first test's timeout.
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT + UP_TIMEOUT + 300))


@pytest.fixture(scope="session")
def k8s_bin_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of the control-plane binaries (built on the first run only)."""
    return _ensure_binaries(request.config, tmp_path_factory.mktemp("build") / "build.log")


@pytest.fixture(scope="session")
def make_control_plane(
    k8s_bin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], ControlPlane]]:
    """Factory: make_control_plane(name) starts a control plane (once per name per session)."""
    base = tmp_path_factory.mktemp("clusters", numbered=True)
    started: dict[str, ControlPlane] = {}

    def make(name: str) -> ControlPlane:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?", name):
            raise ValueError(f"cluster name must be a short DNS label, got {name!r}")
        if name in started:
            return started[name]
        cp = _start_control_plane(name, base, k8s_bin_dir)
        started[name] = cp
        return cp

    yield make
    for cp in reversed(list(started.values())):
        _stop_control_plane(cp)


@pytest.fixture(scope="session")
def control_plane(make_control_plane: Callable[[str], ControlPlane]) -> ControlPlane:
    """The main local control plane of the test session."""
    return make_control_plane("main")


@pytest.fixture(scope="session")
def kubectl(control_plane: ControlPlane) -> Callable[..., subprocess.CompletedProcess[str]]:
    """kubectl(*args, check=True, input=None) against control_plane."""
    return control_plane.kubectl


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    name = control_plane.create_namespace(request.node.name)
    yield name
    control_plane.delete_namespace(name)
