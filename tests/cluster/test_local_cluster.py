"""hack/local-cluster itself: a component that dies during `up` is named with its exit signal,
and `up` retries with new ports and data; `down` stops only what the cluster started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hack.localcluster.harness import LOCAL_CLUSTER

from .waits import wait_until

pytestmark = pytest.mark.cluster

UP_TIMEOUT = 600.0


def _start_up(directory: Path, bin_dir: Path, attempts: int) -> subprocess.Popen[str]:
    env = {**os.environ, "DILOCO_K8S_BIN_DIR": str(bin_dir)}
    argv = [sys.executable, str(LOCAL_CLUSTER), "up", "--dir", str(directory), "--nodes", "1"]
    argv += ["--attempts", str(attempts), "--owner-pid", str(os.getpid())]
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _start_ticks(pid: int) -> int | None:
    """When the live process `pid` started (clock ticks since boot); None once it has exited
    (a zombie counts as exited: whoever inherited it reaps it in its own time)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _kill_etcd_once_apiserver_starts(directory: Path) -> dict[str, tuple[int, int | None]]:
    """SIGKILL the etcd of the first attempt once it is healthy (kube-apiserver is being
    started); returns {component: (pid, start time)} of both."""
    pids = directory / "pids"
    wait_until(
        lambda: (pids / "kube-apiserver.pid").exists(),
        timeout=UP_TIMEOUT,
        interval=0.05,
        message="up to start kube-apiserver",
    )
    started = {}
    for name in ("etcd", "kube-apiserver"):
        pid = int((pids / f"{name}.pid").read_text())
        started[name] = (pid, _start_ticks(pid))
    pid = started["etcd"][0]
    # Only ever the etcd this test's `up` started: its command line names our directory.
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    assert f"--data-dir={directory.resolve()}/etcd" in cmdline, cmdline
    os.kill(pid, signal.SIGKILL)
    return started


def _down(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(LOCAL_CLUSTER), "down", "--keep-logs", "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_local_cluster_up_retries_after_a_component_is_killed(
    k8s_bin_dir: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "retry"
    proc = _start_up(directory, k8s_bin_dir, attempts=2)
    try:
        first = _kill_etcd_once_apiserver_starts(directory)
        _, stderr = proc.communicate(timeout=UP_TIMEOUT)
        state = json.loads((directory / "state.json").read_text())
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
        down = _down(directory)
    err = stderr.decode(errors="replace")
    assert proc.returncode == 0, err
    assert "ERROR: etcd died" in err and "killed by signal 9 (SIGKILL)" in err, err
    assert "attempt 2 of 2" in err, err
    assert state["attempts"] == 2
    assert (directory / "logs" / "attempt-1" / "etcd.log").exists()
    # The first attempt's kube-apiserver was stopped before the second attempt began.
    assert _start_ticks(first["kube-apiserver"][0]) != first["kube-apiserver"][1]
    assert down.returncode == 0, down.stderr
    # Every process of the second attempt is gone after `down`.
    for name, record in state["processes"].items():
        assert _start_ticks(record["pid"]) != record["start"], name


def test_local_cluster_up_failure_names_the_dead_component(
    k8s_bin_dir: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "fail"
    proc = _start_up(directory, k8s_bin_dir, attempts=1)
    try:
        first = _kill_etcd_once_apiserver_starts(directory)
        _, stderr = proc.communicate(timeout=UP_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
        _down(directory)
    err = stderr.decode(errors="replace")
    assert proc.returncode == 1, err
    summary = err[err.index("ERROR: up failed after 1 attempt(s)") :]
    assert "attempt 1: etcd died" in summary and "(SIGKILL)" in summary, summary
    # The tail of the dead component's log, kept under logs/attempt-1.
    assert f"last lines of {directory.resolve()}/logs/attempt-1/etcd.log" in summary, summary
    assert "starting: " in summary and "/etcd --name=local" in summary, summary
    assert (directory / "logs" / "attempt-1" / "kube-apiserver.log").exists()
    assert not (directory / "state.json").exists()
    # The kube-apiserver it had started is stopped before `up` returns.
    assert _start_ticks(first["kube-apiserver"][0]) != first["kube-apiserver"][1]
