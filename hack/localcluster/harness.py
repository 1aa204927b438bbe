"""What the cluster tests (tests/cluster) and the operator benchmark (bench.operator_scale) share:
the one module they import (what it re-exports lives in polling.py and operator_process.py).

- `poll_until` / `holds_for`: polling with a deadline;
- readiness of pods and jobs (`pod_ready`, `ready_pods`, `condition_status`, `ready_patch`);
- `ControlPlane`: a cluster started by hack/local-cluster (`start_control_plane`,
  `stop_control_plane`) with kubectl and API-client helpers;
- `start_kueue`: Kueue (built from its pinned module) installed into such a cluster, its manager
  one more process of the cluster (kueue.py);
- `OperatorProcess`: `diloco operator` as a local process in its own process group, its log in
  a file, up once its liveness endpoint answers.

Torch-free, but not stdlib-only like the rest of this package (operator_process.py starts
the operator with diloco_trainer.local.launch; `api_client()` needs the kubernetes package);
hack/local-cluster never imports it, nor operator_process.py. Import it as
`hack.localcluster.harness` from the repository root.

Failures raise AssertionError subclasses (a failed check, in pytest's words) and timeouts
WaitTimeout, a TimeoutError: both read well in a test report and in a benchmark's traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .kueue import KueueManager, resolve_kueue_dir, start_kueue
from .objects import condition_status, pod_ready
from .operator_process import (
    DILOCO,
    OperatorProcess,
    ProcessExited,
    standalone_operator_args,
    with_ports,
)
from .polling import StoppedHolding, WaitTimeout, holds_for, poll_until
from .ports import pick_ports
from .settings import ENTRY_POINT, HACK_DIR

__all__ = [
    "CRD_FILE",
    "DILOCO",
    "LOCAL_CLUSTER",
    "TINY_TRAINING",
    "ClusterStartError",
    "ControlPlane",
    "KubectlError",
    "KueueManager",
    "OperatorProcess",
    "ProcessExited",
    "StoppedHolding",
    "WaitTimeout",
    "condition_status",
    "holds_for",
    "islands_ready",
    "pick_ports",
    "pod_ready",
    "poll_until",
    "ready_patch",
    "ready_pods",
    "resolve_kueue_dir",
    "run_local_cluster",
    "standalone_operator_args",
    "start_control_plane",
    "start_kueue",
    "stop_control_plane",
    "with_ports",
]

REPO_ROOT = HACK_DIR.parent
LOCAL_CLUSTER = ENTRY_POINT
CRD_FILE = REPO_ROOT / "crds" / "dilocojob.yaml"
KUBECTL_TIMEOUT = 120.0
# The training sections of a job a loopback syncer serves in seconds on one core (gpt-tiny,
# short sequences): the cluster tests' jobs and the operator benchmark's.
TINY_TRAINING: dict[str, Any] = {
    "model": {"preset": "gpt-tiny", "seed": 0},
    "data": {"evalTokens": 2048},
    "inner": {"steps": 4, "batchSize": 2, "seqLen": 32, "lr": 1e-3},
    "sync": {"quorum": 1, "graceSeconds": "0.2", "heartbeatTimeoutSeconds": 60},
}

PodT = TypeVar("PodT", bound=Mapping[str, Any])


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A job document: base with overrides applied recursively (dicts merge, the rest replaces)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class ClusterStartError(AssertionError):
    """hack/local-cluster up failed; the message quotes its summary."""


class KubectlError(AssertionError):
    """kubectl exited non-zero; the message carries its command line and stderr."""

    def __init__(self, args: list[str], result: subprocess.CompletedProcess[str]):
        self.result = result
        super().__init__(
            f"kubectl {' '.join(args)} exited {result.returncode}\n"
            f"stderr: {result.stderr.strip()}\nstdout: {result.stdout.strip()[:2000]}"
        )


# ----------------------------------------------------------------------------------- readiness


def ready_pods(pods: Iterable[PodT]) -> list[PodT]:
    """The pods whose Ready condition is True."""
    return [p for p in pods if pod_ready(p)]


def ready_patch(ready: bool) -> dict[str, Any]:
    """A status-subresource patch setting a pod's Ready and ContainersReady conditions (kwok
    never writes a pod's status again after it first runs it, so the patch stays)."""
    value = "True" if ready else "False"
    return {
        "status": {
            "conditions": [
                {"type": "Ready", "status": value},
                {"type": "ContainersReady", "status": value},
            ]
        }
    }


def islands_ready(job: Mapping[str, Any]) -> int | None:
    """status.islands.ready of a DiLoCoJob (None before the operator wrote it)."""
    return ((job.get("status") or {}).get("islands") or {}).get("ready")


# ----------------------------------------------------------------------------------- cluster


def cluster_env(kubeconfig: Path, bin_dir: Path) -> dict[str, str]:
    """os.environ with KUBECONFIG set and the cluster's binaries first on PATH."""
    path = os.environ.get("PATH", "")
    return {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "PATH": f"{bin_dir}{os.pathsep}{path}" if path else str(bin_dir),
    }


@dataclass
class ControlPlane:
    """One running local control plane."""

    name: str
    dir: Path
    kubeconfig: Path
    bin_dir: Path
    server: str
    env: dict[str, str] = field(repr=False)

    @classmethod
    def from_dir(cls, directory: Path, bin_dir: Path | None = None) -> ControlPlane:
        """The cluster `up` started in `directory` (read from its state.json)."""
        state = json.loads((directory / "state.json").read_text())
        bin_dir = bin_dir or Path(state["bin_dir"])
        kubeconfig = directory / "kubeconfig"
        return cls(
            name=state["name"],
            dir=directory,
            kubeconfig=kubeconfig,
            bin_dir=bin_dir,
            server=f"https://127.0.0.1:{state['ports']['apiserver']}",
            env=cluster_env(kubeconfig, bin_dir),
        )

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

    def install_crd(self, crd: Path = CRD_FILE, timeout: str = "180s") -> Path:
        """Apply the DiLoCoJob CRD (server-side) and wait until it is Established."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        crd_name = "crd/dilocojobs.diloco.dev"
        self.kubectl("wait", "--for=condition=Established", crd_name, f"--timeout={timeout}")
        return crd

    def kubeconfig_for_sa(self, namespace: str, serviceaccount: str, path: Path) -> Path:
        """Write a kubeconfig authenticating as namespace/serviceaccount (token) to path."""
        result = run_local_cluster(
            "kubeconfig-for-sa", "--dir", str(self.dir), namespace, serviceaccount, timeout=60
        )
        if result.returncode != 0:
            raise AssertionError(
                f"kubeconfig-for-sa {namespace}/{serviceaccount} failed:\n{result.stderr}"
            )
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
        poll_until(
            lambda: (
                self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
                == 0
            ),
            timeout=180,
            what=f"ServiceAccount default in namespace {name}",
            ignore=(Exception,),
        )
        return name

    def delete_namespace(self, name: str, wait: bool = False) -> None:
        self.kubectl(
            "delete", "namespace", name, "--ignore-not-found", f"--wait={str(wait).lower()}"
        )


def run_local_cluster(
    *args: str, env: Mapping[str, str] | None = None, timeout: float | None = 120.0
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


def tail_lines(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def failure_summary(stderr: str) -> str:
    """The part of `up`'s output that explains a failure: its closing summary (which attempt
    failed how, the failing component's log tail), or the last lines if there is none."""
    marker = stderr.rfind("ERROR: up failed after")
    if marker >= 0:
        return stderr[stderr.rfind("\n", 0, marker) + 1 :].strip()
    return tail_lines(stderr, 60)


def start_control_plane(
    directory: Path,
    *,
    name: str | None = None,
    nodes: int | None = None,
    attempts: int | None = None,
    timeout: float | None = None,
    bin_dir: Path | None = None,
    log: Path | None = None,
    extra_args: Iterable[str] = (),
) -> tuple[ControlPlane, list[str]]:
    """`hack/local-cluster up` in `directory` (options left out: its defaults), owned by this
    process (it stops itself when this process dies): the cluster, and one line per failed
    attempt that `up` retried. Raises ClusterStartError quoting `up`'s summary.

    `bin_dir`: use these binaries (DILOCO_K8S_BIN_DIR) rather than have `up` build them.
    `log`: a file that `up`'s progress lines (its stderr) are appended to.
    `extra_args`: more options of `up`, e.g. ("--real-node",).
    """
    env = {**os.environ, "DILOCO_K8S_BIN_DIR": str(bin_dir)} if bin_dir else None
    up = ["up", "--dir", str(directory), "--owner-pid", str(os.getpid())]
    for flag, value in (("--name", name), ("--nodes", nodes), ("--attempts", attempts)):
        if value:
            up += [flag, str(value)]
    if timeout:
        up += ["--timeout", str(timeout)]
    up += list(extra_args)
    limit = timeout + 90 if timeout else None
    try:
        result = run_local_cluster(*up, env=env, timeout=limit)
    except subprocess.TimeoutExpired:
        result = None
    if log is not None and result is not None:
        with log.open("a") as f:
            f.write(result.stderr)
    if result is None or result.returncode != 0:
        # Normally a no-op: `up` stops what it started; not so if it had to be killed.
        run_local_cluster("down", "--keep-logs", "--dir", str(directory))
        why = (
            f"did not finish within {limit or 0:.0f}s"  # only a limit makes it time out
            if result is None
            else f"failed (exit {result.returncode}):\n{failure_summary(result.stderr)}"
        )
        raise ClusterStartError(f"hack/local-cluster up --dir {directory} {why}")
    retried = [line for line in result.stderr.splitlines() if "ERROR:" in line]
    return ControlPlane.from_dir(directory, bin_dir), retried


DOWN_TIMEOUT = 300.0


def stop_control_plane(cp: ControlPlane, keep_logs: bool = True) -> str | None:
    """`hack/local-cluster down` (with --keep-logs its output goes to logs/down.log): a
    warning to show when it failed or warned, else None."""
    args = ["down", "--dir", str(cp.dir)] + (["--keep-logs"] if keep_logs else [])
    try:
        # A real node's `down` drains it first (up to nodeteardown.DRAIN_TIMEOUT), then stops
        # the kubelet, containerd and the control plane: run_local_cluster's 120 s was too short
        # for that on a loaded machine (the node tier's teardown failed after its tests passed).
        result = run_local_cluster(*args, timeout=DOWN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"hack/local-cluster down --dir {cp.dir} timed out"
    if cp.logs_dir.is_dir():
        (cp.logs_dir / "down.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0 or "WARNING" in result.stderr:
        return f"hack/local-cluster down --dir {cp.dir}: {tail_lines(result.stderr, 10)}"
    return None
