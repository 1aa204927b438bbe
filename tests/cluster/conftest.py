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

Importing this module needs nothing but pytest and the standard library; the cluster is only
started when a test asks for one of the fixtures. If Go is missing or the build fails, the
fixture fails (never skips) with a message saying what is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HACK_DIR = REPO_ROOT / "hack"
LOCAL_CLUSTER = HACK_DIR / "local-cluster"
BUILD_SCRIPT = HACK_DIR / "build-binaries.sh"

# First build of the binaries takes ~30 min on 2 cores; later runs reuse the cache.
BUILD_TIMEOUT = float(os.environ.get("DILOCO_K8S_BUILD_TIMEOUT", "3600"))
# All attempts of `local-cluster up` together (one normally takes 10-30 s); kept below the
# pytest timeout of the first cluster test, whose set-up it is.
UP_TIMEOUT = float(os.environ.get("DILOCO_K8S_UP_TIMEOUT", "600"))
UP_ATTEMPTS = 3
KUBECTL_TIMEOUT = 120.0

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
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # keep polling; reported if the deadline passes
            last_error = e
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {message}{detail}")
        time.sleep(interval)


def holds_for(
    predicate: Callable[[], bool],
    duration: float = 3.0,
    interval: float = 0.2,
    message: str = "condition",
) -> None:
    """Check predicate() repeatedly for `duration` seconds; fail the first time it is false."""
    deadline = time.monotonic() + duration
    checks = 0
    while True:
        if not predicate():
            pytest.fail(f"{message} stopped holding after {checks} checks")
        checks += 1
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)


class KubectlError(AssertionError):
    """kubectl exited non-zero; the message carries its command line and stderr."""

    def __init__(self, args: list[str], result: subprocess.CompletedProcess[str]):
        self.result = result
        super().__init__(
            f"kubectl {' '.join(args)} exited {result.returncode}\n"
            f"stderr: {result.stderr.strip()}\nstdout: {result.stdout.strip()[:2000]}"
        )


def pod_ready(pod: dict[str, Any]) -> bool:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


@dataclass
class ControlPlane:
    """One running local control plane."""

    name: str
    dir: Path
    kubeconfig: Path
    bin_dir: Path
    server: str
    env: dict[str, str] = field(repr=False)

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = KUBECTL_TIMEOUT,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this cluster; raise KubectlError on failure."""
        argv = [str(self.bin_dir / "kubectl"), *args]
        result = subprocess.run(
            argv,
            env=self.env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise KubectlError(list(args), result)
        return result

    def kubectl_json(self, *args: str) -> Any:
        """kubectl ARGS -o json, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(
        self, manifest: str | dict[str, Any] | list[dict[str, Any]], namespace: str = ""
    ) -> str:
        """kubectl apply a YAML/JSON string, an object or a list of objects."""
        if not isinstance(manifest, str):
            items = manifest if isinstance(manifest, list) else [manifest]
            manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=manifest).stdout

    def kubeconfig_for_sa(self, namespace: str, serviceaccount: str, path: Path) -> Path:
        """Write a kubeconfig authenticating as namespace/serviceaccount (token) to path."""
        result = _local_cluster(
            "kubeconfig-for-sa", "--dir", str(self.dir), namespace, serviceaccount, timeout=60
        )
        if result.returncode != 0:
            pytest.fail(f"kubeconfig-for-sa {namespace}/{serviceaccount} failed:\n{result.stderr}")
        path.write_text(result.stdout)
        path.chmod(0o600)
        return path

    def env_with_kubeconfig(self, kubeconfig: Path) -> dict[str, str]:
        """self.env, but authenticating with another kubeconfig (e.g. a ServiceAccount's)."""
        return {**self.env, "KUBECONFIG": str(kubeconfig)}

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient for this cluster (needs the `kubernetes` package)."""
        from kubernetes import config as k8s_config

        return k8s_config.new_client_from_config(config_file=str(self.kubeconfig))

    def create_namespace(self, prefix: str = "t") -> str:
        """Create a namespace with a unique name and wait for its default ServiceAccount."""
        slug = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-")[:40].strip("-") or "t"
        name = f"{slug}-{uuid.uuid4().hex[:6]}"
        self.kubectl("create", "namespace", name)
        # Pods are rejected until the service-account controller has created "default".
        wait_until(
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
                == 0
            ),
            timeout=180,
            message=f"ServiceAccount default in namespace {name}",
        )
        return name

    def delete_namespace(self, name: str, wait: bool = False) -> None:
        self.kubectl(
            "delete", "namespace", name, "--ignore-not-found", f"--wait={str(wait).lower()}"
        )


# ----------------------------------------------------------------------------------- startup


def _find_go() -> str | None:
    return (
        os.environ.get("GO")
        or shutil.which("go")
        or ("/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None)
    )


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


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
            + _tail("\n".join(lines))
        )
    return Path(lines[-1])


def _local_cluster(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run hack/local-cluster with this Python (no dependency on a `python3` on PATH).

    Past `timeout` it gets SIGTERM (it then stops what it started) and 60 s later SIGKILL;
    subprocess.TimeoutExpired is raised either way.
    """
    with subprocess.Popen(
        [sys.executable, str(LOCAL_CLUSTER), *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _failure_summary(stderr: str) -> str:
    """The part of `up`'s output that explains a failure: its closing summary (which attempt
    failed how, the failing component's log tail), or the last lines if there is none."""
    marker = stderr.rfind("ERROR: up failed after")
    if marker >= 0:
        return stderr[stderr.rfind("\n", 0, marker) + 1 :].strip()
    return _tail(stderr, 60)


def _start_control_plane(name: str, base: Path, bin_dir: Path) -> ControlPlane:
    if shutil.which("openssl") is None:
        pytest.fail("the cluster tier needs `openssl` to create the cluster certificates")
    directory = base / name
    env = {**os.environ, "DILOCO_K8S_BIN_DIR": str(bin_dir)}
    # A failed start (a component dies or misses its deadline on a loaded 2-core machine, a
    # port taken between choice and bind) is retried by `up` itself, each attempt with new
    # ports, certificates and etcd data, all within --timeout.
    up = ["up", "--dir", str(directory), "--name", name, "--owner-pid", str(os.getpid())]
    up += ["--attempts", str(UP_ATTEMPTS), "--timeout", str(UP_TIMEOUT)]
    try:
        result = _local_cluster(*up, env=env, timeout=UP_TIMEOUT + 90)
    except subprocess.TimeoutExpired:
        result = None
    if result is None or result.returncode != 0:
        # Normally a no-op: `up` stops what it started; not so if it had to be killed.
        _local_cluster("down", "--keep-logs", "--dir", str(directory))
        why = (
            f"did not finish within {UP_TIMEOUT + 90:.0f}s"
            if result is None
            else f"failed (exit {result.returncode}):\n{_failure_summary(result.stderr)}"
        )
        pytest.fail(f"hack/local-cluster up --dir {directory} {why}")
    failed_attempts = [line for line in result.stderr.splitlines() if "ERROR:" in line]
    if failed_attempts:  # visible in the run's warnings summary, so flakes do not go unseen
        warnings.warn(
            f"local-cluster up --dir {directory} needed retries: " + "; ".join(failed_attempts),
            stacklevel=1,
        )
    state = json.loads((directory / "state.json").read_text())
    kubeconfig = directory / "kubeconfig"
    path = os.environ.get("PATH", "")
    cluster_env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PATH": f"{bin_dir}{os.pathsep}{path}" if path else str(bin_dir),
    }
    return ControlPlane(
        name=name,
        dir=directory,
        kubeconfig=kubeconfig,
        bin_dir=bin_dir,
        server=f"https://127.0.0.1:{state['ports']['apiserver']}",
        env=cluster_env,
    )


def _stop_control_plane(cp: ControlPlane) -> None:
    # Keep the component logs in pytest's (rotated) temp dir for post-mortems.
    try:
        result = _local_cluster("down", "--keep-logs", "--dir", str(cp.dir))
    except subprocess.TimeoutExpired:
        warnings.warn(f"hack/local-cluster down --dir {cp.dir} timed out", stacklevel=1)
        return
    if cp.logs_dir.is_dir():
        (cp.logs_dir / "down.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0 or "WARNING" in result.stderr:
        warnings.warn(
            f"hack/local-cluster down --dir {cp.dir}: {_tail(result.stderr, 10)}", stacklevel=1
        )


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
