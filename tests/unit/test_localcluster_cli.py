"""hack/local-cluster's entry point: stdlib only, and the commands that need no cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hack.localcluster.settings import ENTRY_POINT, HACK_DIR

# Every module the command line imports (all but the test/bench harness).
CLI_MODULES = [
    p.stem
    for p in sorted((HACK_DIR / "localcluster").glob("*.py"))
    if p.stem not in ("__init__", "harness", "operator_process")
]


def _local_cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ENTRY_POINT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_command_line_needs_only_the_standard_library() -> None:
    # -I -S: no site-packages, no PYTHONPATH, no user site: only the stdlib and hack/.
    imports = "; ".join(f"import localcluster.{m}" for m in CLI_MODULES)
    code = f"import sys; sys.path.insert(0, {str(HACK_DIR)!r}); {imports}"
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert {"cli", "up", "components", "ports", "pki"} <= set(CLI_MODULES)


def test_help_lists_every_command() -> None:
    result = _local_cluster("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: local-cluster [-h]")
    assert "{up,down,status,load-image,kubeconfig-for-sa,_watchdog}" in result.stdout
    up = _local_cluster("up", "--help").stdout
    for flag in ("--dir", "--name", "--nodes", "--apiserver-port", "--etcd-port", "--attempts",
                 "--timeout", "--owner-pid", "--real-node"):  # fmt: skip
        assert flag in up, flag


def test_status_and_down_without_a_cluster(tmp_path: Path) -> None:
    missing = tmp_path / "none"
    status = _local_cluster("status", "--dir", str(missing))
    assert (status.returncode, status.stdout) == (1, f"no cluster in {missing}\n")
    down = _local_cluster("down", "--dir", str(missing))
    assert down.returncode == 0
    assert down.stderr == f"[local-cluster] nothing to do: {missing} does not exist\n"
    # A directory without local-cluster state is left alone.
    (tmp_path / "keep.txt").write_text("x")
    down = _local_cluster("down", "--dir", str(tmp_path))
    assert down.returncode == 0 and "holds no local-cluster state; leaving it alone" in down.stderr
    assert (tmp_path / "keep.txt").exists()


def test_invalid_counts_are_usage_errors() -> None:
    for args, message in (
        (["up", "--nodes", "0"], "--nodes must be at least 1"),
        (["up", "--attempts", "0"], "--attempts must be at least 1"),
    ):
        result = _local_cluster(*args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
