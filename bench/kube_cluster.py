"""The local control plane (hack/local-cluster) and the operator process, for bench.operator.

The cluster is the one the cluster test tier uses: etcd, kube-apiserver, controller-manager,
scheduler and kwok fake nodes on loopback, built from pinned sources (hack/README.md). The operator
runs as a real process (`diloco operator --standalone`), as in tests/cluster.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_trainer.local.launch import Proc, free_port

from bench.common import REPO_ROOT, poll_until, track

LOCAL_CLUSTER = REPO_ROOT / "hack" / "local-cluster"
CRD_FILE = REPO_ROOT / "crds" / "dilocojob.yaml"


@dataclass
class LocalCluster:
    """A running control plane started by hack/local-cluster (stopped with stop())."""

    dir: Path
    kubeconfig: Path
    path_prefix: str

    @classmethod
    def start(cls, directory: Path, nodes: int, log: Path) -> LocalCluster:
        """`local-cluster up`; it stops itself if this process dies (--owner-pid)."""
        cmd = [sys.executable, str(LOCAL_CLUSTER), "up", "--dir", str(directory)]
        cmd += ["--nodes", str(nodes), "--owner-pid", str(os.getpid())]
        with log.open("ab") as err:
            out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, check=False)
        if out.returncode != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"hack/local-cluster up failed ({out.returncode}):\n{tail}")
        kube = re.search(r"^export KUBECONFIG=(.+)$", out.stdout, re.M)
        path = re.search(r'^export PATH="([^"]+?):\$PATH"$', out.stdout, re.M)
        if not kube:
            raise RuntimeError(f"no KUBECONFIG in local-cluster output:\n{out.stdout}")
        return cls(directory, Path(kube.group(1).strip()), path.group(1) if path else "")

    def stop(self) -> None:
        subprocess.run(
            [sys.executable, str(LOCAL_CLUSTER), "down", "--dir", str(self.dir)],
            capture_output=True,
            check=False,
        )

    def env(self) -> dict[str, str]:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        if self.path_prefix:
            env["PATH"] = f"{self.path_prefix}:{env.get('PATH', '')}"
        return env

    def kubectl(self, *args: str) -> str:
        out = subprocess.run(
            ["kubectl", *args], env=self.env(), capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def api(self) -> Any:
        """A kubernetes.client.ApiClient for this cluster."""
        from kubernetes import config

        return config.new_client_from_config(str(self.kubeconfig))

    def install_crd(self) -> None:
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        self.kubectl(
            "wait", "--for=condition=Established", "crd/dilocojobs.diloco.dev", "--timeout=60s"
        )


@dataclass
class OperatorProcess:
    """`diloco operator` watching some namespaces, with its health and metrics ports."""

    cluster: LocalCluster
    namespaces: list[str]
    log_file: Path
    health_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: Proc | None = None

    def start(self) -> None:
        argv = [str(Path(sys.executable).with_name("diloco")), "operator", "--standalone"]
        for ns in self.namespaces:
            argv += ["--namespace", ns]
        argv += ["--health-port", str(self.health_port), "--metrics-port", str(self.metrics_port)]
        with self.log_file.open("ab") as log:
            popen = subprocess.Popen(
                argv,
                env=self.cluster.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.proc = track(Proc("operator", popen, self.log_file))
        poll_until(self._healthy, timeout=120, what="the operator's /healthz")

    def _healthy(self) -> bool:
        assert self.proc is not None
        if not self.proc.alive:
            raise RuntimeError("operator exited:\n" + self.proc.log_text()[-3000:])
        try:
            url = f"http://127.0.0.1:{self.health_port}/healthz"
            with urllib.request.urlopen(url, timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode()

    def rss_bytes(self) -> int:
        """Resident memory of the operator process (and its children, if any)."""
        assert self.proc is not None
        total = 0
        pids = [self.proc.pid]
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        if children.exists():
            pids += [int(p) for p in children.read_text().split()]
        for pid in pids:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                continue
        return total

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout=20)


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Sum of a Prometheus sample's values (those whose labels contain `labels`)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric = head.split("{")[0]
        if metric == name and labels in head:
            total += float(value)
    return total


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a Prometheus histogram, by upper bound."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = re.search(r'le="([^"]+)"', line)
            if le:
                bound = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
                out[bound] = out.get(bound, 0.0) + float(line.rpartition(" ")[2])
    return out


def histogram_quantile(text: str, name: str, q: float, before: str = "") -> float:
    """A quantile of a Prometheus histogram (of what it observed since `before`, a previous
    scrape, when given), interpolated linearly within its bucket; inf when it lies above the
    top finite bucket."""
    now = histogram_buckets(text, name)
    then = histogram_buckets(before, name) if before else {}
    buckets = sorted((b, c - then.get(b, 0.0)) for b, c in now.items())
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    target = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= target and count > prev_count:
            if bound == float("inf"):
                return float("inf")  # above the top finite bucket: only a lower bound is known
            share = (target - prev_count) / max(count - prev_count, 1e-12)
            return prev_bound + share * (bound - prev_bound)
        prev_bound, prev_count = bound, count
    return prev_bound
