"""The local control plane and the operator process for bench.operator_scale, and Prometheus
text parsing.

Both come from hack/localcluster/harness.py, which the cluster tests use too: the control plane
is the one of that tier (etcd, kube-apiserver, controller-manager, scheduler and kwok fake nodes on
loopback, built from pinned sources: hack/README.md), and the operator runs as a real process
(`diloco operator --standalone`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from bench.common import track
from hack.localcluster.harness import (
    ControlPlane,
    OperatorProcess,
    standalone_operator_args,
    start_control_plane,
    stop_control_plane,
)


def start_cluster(directory: Path, nodes: int, log: Path) -> ControlPlane:
    """`hack/local-cluster up` with `nodes` kwok nodes (it stops itself if this process dies);
    its progress lines go to `log`."""
    cp, _ = start_control_plane(directory, nodes=nodes, log=log)
    return cp


def stop_cluster(cp: ControlPlane) -> None:
    """`hack/local-cluster down`: stops the processes and removes the directory."""
    stop_control_plane(cp, keep_logs=False)


def operator_process(
    cp: ControlPlane, namespaces: Sequence[str], log_file: Path
) -> OperatorProcess:
    """`diloco operator` watching these namespaces, killed when the benchmark exits (track)."""
    return OperatorProcess(
        env=cp.env,
        log_file=log_file,
        args=standalone_operator_args(namespaces),
        on_spawn=track,
    )


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
