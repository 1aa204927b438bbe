"""The Kubernetes side of bench.operator_scale: the local control plane, the operator process,
a thin API client, a pod watch, and Prometheus text parsing.

Both come from hack/localcluster/harness.py, which the cluster tests use too: the control plane
is the one of that tier (etcd, kube-apiserver, controller-manager, scheduler and kwok fake nodes on
loopback, built from pinned sources: hack/README.md), and the operator runs as a real process
(`diloco operator --standalone`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco_operator import api as op_api

from bench.harness.common import track
from hack.localcluster.harness import (
    ControlPlane,
    OperatorProcess,
    pod_ready,
    ready_patch,
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


class Api:
    """Thin wrapper over the kubernetes client for what this benchmark does."""

    def __init__(self, cluster: ControlPlane) -> None:
        from diloco_operator.kube import TimedDynamicClient
        from kubernetes import client

        self.api_client = cluster.api_client()
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        # Discovery from this cluster, not a cache file a cluster once at this address left.
        self.dynamic = TimedDynamicClient(self.api_client)

    def namespace(self, name: str) -> None:
        self.core.create_namespace({"metadata": {"name": name}})

    def create_job(self, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object(
            op_api.GROUP, op_api.VERSION, ns, op_api.PLURAL, body
        )

    def get_job(self, ns: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            op_api.GROUP, op_api.VERSION, ns, op_api.PLURAL, name
        )

    def create(self, ns: str, obj: dict[str, Any]) -> None:
        res = self.dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        res.create(body=obj, namespace=ns)

    def present(self, ns: str, selector: str = "") -> set[tuple[str, str]]:
        """(kind, name) of every child-kind object in ns (optionally by label selector)."""
        out: set[tuple[str, str]] = set()
        lists = {
            "ConfigMap": self.core.list_namespaced_config_map,
            "Secret": self.core.list_namespaced_secret,
            "Service": self.core.list_namespaced_service,
            "Deployment": self.apps.list_namespaced_deployment,
            "StatefulSet": self.apps.list_namespaced_stateful_set,
        }
        for kind, fn in lists.items():
            for item in fn(ns, label_selector=selector).items:
                out.add((kind, item.metadata.name))
        return out


def set_ready(k: Api, ns: str, pod: str, ready: bool) -> None:
    k.core.patch_namespaced_pod_status(pod, ns, ready_patch(ready))


class PodWatch:
    """Records when this process's own watch sees a pod's Ready condition change."""

    def __init__(self, k: Api, ns: str, pod: str) -> None:
        from kubernetes import watch

        self.k, self.ns, self.pod = k, ns, pod
        self.events: list[tuple[float, bool]] = []
        self._watch = watch.Watch()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib3

        try:
            for ev in self._watch.stream(
                self.k.core.list_namespaced_pod,
                self.ns,
                field_selector=f"metadata.name={self.pod}",
                timeout_seconds=600,
            ):
                ready = pod_ready(self.k.api_client.sanitize_for_serialization(ev["object"]))
                self.events.append((time.perf_counter(), ready))
        except urllib3.exceptions.ProtocolError:
            if not self._stopped:
                raise
            # stop() closed the stream under the read: the end of the watch, not an error

    def first_after(self, t0: float, ready: bool) -> float | None:
        for t, r in self.events:
            if t >= t0 and r == ready:
                return t
        return None

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()


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
