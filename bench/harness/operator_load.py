"""The many-job load of bench/operator_scale.py: N jobs x M islands created one after another.

Each job's latency runs from its own creation (the create call answered) to the moment the last
of its children appeared, as seen by watches on every child kind that run in this process for
the whole load, creation included. (An earlier version listed the namespace only after every job
was created, so an early job's latency held the whole creation time; the operator's histograms
are read as before.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from diloco_operator.resources import JOB_LABEL
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from bench.harness.common import Table, fmt_bytes, fmt_ratio, ratio, verdict
from bench.harness.kube_cluster import Api, histogram_buckets, histogram_quantile, metric_value
from hack.localcluster.harness import OperatorProcess

RECONCILE = "diloco_operator_reconcile_seconds"
QUEUE = "diloco_operator_reconcile_queue_seconds"


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of values, nearest-rank."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


class ChildWatch:
    """When each labelled child of a namespace was first seen, from one watch per kind."""

    def __init__(self, k: Api, ns: str) -> None:
        self.seen: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        lists: dict[str, Callable[..., Any]] = {
            "ConfigMap": k.core.list_namespaced_config_map,
            "Secret": k.core.list_namespaced_secret,
            "Service": k.core.list_namespaced_service,
            "Deployment": k.apps.list_namespaced_deployment,
            "StatefulSet": k.apps.list_namespaced_stateful_set,
        }
        self._threads = [
            threading.Thread(target=self._run, args=(kind, fn, ns), daemon=True)
            for kind, fn in lists.items()
        ]
        for t in self._threads:
            t.start()

    def _run(self, kind: str, fn: Callable[..., Any], ns: str) -> None:
        version: str | None = None
        while not self._stop.is_set():
            w = watch.Watch(return_type="object")  # plain dicts: no model deserialization
            try:
                for event in w.stream(
                    fn, ns, label_selector=JOB_LABEL, timeout_seconds=5, resource_version=version
                ):
                    now = time.perf_counter()
                    meta = event["object"].get("metadata") or {}
                    version = meta.get("resourceVersion", version)
                    with self._lock:
                        self.seen.setdefault((kind, meta.get("name", "")), now)
            except ApiException as err:
                if err.status != 410:
                    raise
                version = None  # expired: list again (first-seen times are kept)

    def first_seen(self) -> dict[tuple[str, str], float]:
        with self._lock:
            return dict(self.seen)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)


def _quantiles(metrics: str, before: str, name: str) -> dict[str, float]:
    return {
        f"p{round(q * 100)}": histogram_quantile(metrics, name, q, before)
        for q in (0.5, 0.95, 0.99)
    }


def measure_load(
    k: Api, op: OperatorProcess, ns: str, jobs: int, islands: int, deadline_s: float,
    manifest: Callable[..., dict[str, Any]], expected: Callable[[dict[str, Any]], set[Any]],
) -> dict[str, Any]:  # fmt: skip
    rss: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss.append(op.rss_bytes())
            stop.wait(0.5)

    idle_rss = op.rss_bytes()
    metrics_before = op.metrics()
    log_start = len(op.proc.log_text()) if op.proc else 0
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    children = ChildWatch(k, ns)
    created: dict[str, float] = {}
    want: dict[str, set[tuple[str, str]]] = {}
    t_start = time.perf_counter()
    for j in range(jobs):
        name = f"load-{j}"
        body = k.create_job(ns, manifest(name, islands, 1))
        created[name] = time.perf_counter()
        want[name] = expected(body)
    t_created = time.perf_counter()
    done: dict[str, float] = {}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        seen = children.first_seen()
        for name, w in want.items():
            if name not in done and w <= seen.keys():
                done[name] = max(seen[c] for c in w)
        if len(done) == jobs:
            break
        time.sleep(0.5)
    t_all = max(done.values(), default=time.perf_counter())
    children.stop()
    time.sleep(15)  # let periodic reconciles and status updates run under the full load
    stop.set()
    sampler.join()
    metrics = op.metrics()
    log = op.proc.log_text()[log_start:] if op.proc else ""  # only what the load produced

    def delta(name: str, labels: str = "") -> float:
        return metric_value(metrics, name, labels) - metric_value(metrics_before, name, labels)

    finite = [b for b in histogram_buckets(metrics, RECONCILE) if b < float("inf")]
    return {
        "jobs": jobs,
        "done": len(done),
        "create_seconds": t_created - t_start,
        "all_children_seconds": t_all - t_start,
        "latencies": [done[n] - created[n] for n in done],
        "reconcile": _quantiles(metrics, metrics_before, RECONCILE),
        "queue": _quantiles(metrics, metrics_before, QUEUE),
        "reconcile_top": max(finite, default=float("nan")),
        "reconciles": delta("diloco_operator_reconciles_total"),
        "first_reconciles": delta(f"{QUEUE}_count"),
        "reconcile_errors": delta("diloco_operator_reconciles_total", 'result="error"'),
        "errors_total": delta("diloco_operator_errors_total"),
        "syncer_unreachable": delta("diloco_operator_syncer_unreachable_total"),
        "log_errors": sum(1 for line in log.splitlines() if "ERROR" in line),
        "log_tracebacks": log.count("Traceback"),
        "idle_rss": idle_rss,
        "peak_rss": max(rss) if rss else idle_rss,
        "final_rss": rss[-1] if rss else idle_rss,
    }


def _seconds(v: float, top: float) -> str:
    return f"{v:.3f}s" if v != float("inf") else f"> {top:g}s (top bucket)"


def load_table(
    loaded: dict[str, Any], islands: int, unloaded: float, nodes: int, targets: Table
) -> Table:
    lat = loaded["latencies"]
    t = Table(
        f"Load: {loaded['jobs']} jobs x {islands} islands on kwok ({nodes} nodes)",
        ["figure", "value"],
    )
    t.add("jobs with all children", f"{loaded['done']} / {loaded['jobs']}")
    rate = loaded["jobs"] / loaded["create_seconds"]
    t.add(
        "time to create the jobs (the bench's API calls, one at a time)",
        f"{loaded['create_seconds']:.1f}s ({rate:.1f} jobs/s)",
    )
    t.add("time until every job had all children", f"{loaded['all_children_seconds']:.1f}s")
    for q in (0.5, 0.95, 0.99):
        v = pct(lat, q)
        t.add(
            f"create -> children (watched from creation on), p{round(q * 100)}",
            f"{v:.2f}s ({fmt_ratio(ratio(v, unloaded), 1)} the unloaded median)",
        )
    top = loaded["reconcile_top"]
    for q, v in loaded["reconcile"].items():
        t.add(
            f"operator reconcile time {q}, from its start of work (its histogram)", _seconds(v, top)
        )
    for q, v in loaded["queue"].items():
        t.add(f"first reconcile's wait before its work {q} (its histogram)", _seconds(v, top))
    t.add("reconciles during the load (first reconciles)",
          f"{loaded['reconciles']:.0f} ({loaded['first_reconciles']:.0f})")  # fmt: skip
    t.add("reconciles that failed (during the load)", f"{loaded['reconcile_errors']:.0f}")
    t.add("operator errors_total (during the load)", f"{loaded['errors_total']:.0f}")
    t.add(
        "ERROR lines / tracebacks in the operator log during the load",
        f"{loaded['log_errors']} / {loaded['log_tracebacks']}",
    )
    t.add(
        "syncer unreachable (no syncer runs on kwok: expected)",
        f"{loaded['syncer_unreachable']:.0f}",
    )
    t.add(
        "operator RSS: idle -> peak",
        f"{fmt_bytes(loaded['idle_rss'])} -> {fmt_bytes(loaded['peak_rss'])} "
        f"({fmt_ratio(ratio(loaded['peak_rss'], loaded['idle_rss']), 2)})",
    )
    ok = loaded["done"] == loaded["jobs"] and loaded["reconcile_errors"] == 0
    targets.add(
        f"{loaded['jobs']} jobs x {islands} islands reconciled without errors",
        f"{loaded['done']}/{loaded['jobs']} complete, {loaded['reconcile_errors']:.0f} failed "
        "reconciles",
        verdict(ok),
    )
    p95 = loaded["reconcile"]["p95"]
    targets.add(
        "reconcile p95 < 1 s (from its start of work)", _seconds(p95, top), verdict(p95 < 1)
    )
    wait = loaded["queue"]["p95"]
    targets.add("(reported beside it) first reconcile's wait p95", _seconds(wait, top), "—")
    lat95 = pct(lat, 0.95)
    targets.add("create -> children p95 < 5 s", f"{lat95:.2f}s", verdict(lat95 < 5))
    return t
