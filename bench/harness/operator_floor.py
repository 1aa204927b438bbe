"""The floor of the many-job load: the same burst, with no operator, created by a plain client.

What the API server (and the controller-manager making pods behind it) costs for a burst of N jobs
on this machine, measured in the same run as the operator's load (bench/harness/operator_load.py):
the jobs are created one after another exactly as in the load, and each job's objects (the exact
ones the operator would write for it, from its own pure builders) are created directly by this
process with the operator's concurrency: FIRST_RECONCILE_SLOTS jobs at a time in arrival order, each
job's objects at once over API_THREADS threads. No operator runs while it does; the namespace is one
the operator never watches. Each job's latency is timed the same way as the load's (its create
answered -> the first watch event of its last expected child).

The operator's figures are then reported as ratios to this floor: a ratio near 1 means the
operator adds little to what the API server needs anyway for that burst.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from diloco_operator.kube import API_THREADS, TimedDynamicClient
from diloco_operator.reconcile_slots import FIRST_RECONCILE_SLOTS
from kubernetes import client

from bench.harness.common import Table, fmt_ratio, ratio
from bench.harness.kube_cluster import Api
from bench.harness.operator_load import ChildWatch, pct

Objects = Callable[[dict[str, Any]], list[dict[str, Any]]]


def _as_dict(_client: Any, data: Any) -> Any:
    return data  # the decoded JSON as it is (the operator's own client does the same)


class FloorCreator:
    """Creates each queued job's objects: `slots` jobs at a time, their objects at once."""

    def __init__(self, api_client: client.ApiClient, slots: int, threads: int) -> None:
        # The operator's client: discovery from this server, not a cache file another run left.
        self._dyn = TimedDynamicClient(api_client)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="floor-api")
        self._jobs: queue.Queue[tuple[str, list[dict[str, Any]]] | None] = queue.Queue()
        self.done: dict[str, float] = {}  # job -> when its last create was answered
        self.objects = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._workers = [threading.Thread(target=self._work, daemon=True) for _ in range(slots)]
        for w in self._workers:
            w.start()

    def _create(self, obj: dict[str, Any]) -> None:
        resource = self._dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        try:
            self._dyn.create(
                resource, body=obj, namespace=obj["metadata"]["namespace"], serializer=_as_dict
            )
        except Exception as err:  # counted and reported: the floor must have none
            with self._lock:
                self.errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {err}")
            return
        with self._lock:
            self.objects += 1

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            name, objs = item
            wait([self._pool.submit(self._create, o) for o in objs])
            with self._lock:
                self.done[name] = time.perf_counter()

    def submit(self, name: str, objs: list[dict[str, Any]]) -> None:
        self._jobs.put((name, objs))

    def close(self) -> None:
        for _ in self._workers:
            self._jobs.put(None)
        for w in self._workers:
            w.join(timeout=60)
        self._pool.shutdown(wait=True)


def _pod_count(k: Api, ns: str) -> int:
    # resourceVersion "0": served from the API server's cache, a cheap poll.
    pods = k.core.list_namespaced_pod(ns, resource_version="0", _preload_content=False)
    return len(json.loads(pods.data).get("items") or [])


def settle(k: Api, ns: str, pods: int, timeout: float) -> tuple[float, int]:
    """Wait until the namespace holds `pods` pods (the controller-manager's work for the burst
    is done) or `timeout`; the seconds waited and the pods seen."""
    t0 = time.perf_counter()
    seen = _pod_count(k, ns)
    while seen < pods and time.perf_counter() - t0 < timeout:
        time.sleep(2)  # a poll interval, not a synchronisation: the count is re-read
        seen = _pod_count(k, ns)
    return time.perf_counter() - t0, seen


def measure_floor(
    k: Api, api_client: client.ApiClient, ns: str, jobs: int, islands: int, deadline_s: float,
    manifest: Callable[..., dict[str, Any]], expected: Callable[[dict[str, Any]], set[Any]],
    objects: Objects,
) -> dict[str, Any]:  # fmt: skip
    """The burst of `jobs` jobs with their objects created by FloorCreator (no operator)."""
    creator = FloorCreator(api_client, FIRST_RECONCILE_SLOTS, API_THREADS)
    children = ChildWatch(k, ns)
    created: dict[str, float] = {}
    want: dict[str, set[tuple[str, str]]] = {}
    total = 0
    t_start = time.perf_counter()
    for j in range(jobs):
        name = f"load-{j}"
        body = k.create_job(ns, manifest(name, islands, 1))
        created[name] = time.perf_counter()
        objs = objects(body)
        total += len(objs)
        creator.submit(name, objs)
        want[name] = expected(body)
    t_created = time.perf_counter()
    done: dict[str, float] = {}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and len(done) < jobs:
        seen = children.first_seen()
        for name, w in want.items():
            if name not in done and w <= seen.keys():
                done[name] = max(seen[c] for c in w)
        if len(done) < jobs:
            time.sleep(0.5)  # the watches fill `seen`; this only paces the check
    creator.close()
    children.stop()
    t_all = max(done.values(), default=time.perf_counter())
    t_written = max(creator.done.values(), default=t_all)
    return {
        "jobs": jobs,
        "done": len(done),
        "objects": total,
        "created_objects": creator.objects,
        "errors": creator.errors,
        "create_seconds": t_created - t_start,
        "all_children_seconds": t_all - t_start,
        "objects_per_s": creator.objects / max(t_written - t_start, 1e-9),
        "latencies": [done[n] - created[n] for n in done],
        "slots": FIRST_RECONCILE_SLOTS,
        "threads": API_THREADS,
    }


def floor_rows(t: Table, floor: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Rows of the load table: the floor's figures and the operator's over them."""
    t.add(
        f"FLOOR (no operator; {floor['slots']} jobs at a time over {floor['threads']} threads, "
        "plain creates): jobs with all children",
        f"{floor['done']} / {floor['jobs']} ({len(floor['errors'])} failed creates)",
    )
    t.add(
        "FLOOR: objects created, objects/s (first job create -> last create answered)",
        f"{floor['created_objects']} / {floor['objects']}, {floor['objects_per_s']:.1f}/s",
    )
    rate = floor["jobs"] / floor["create_seconds"]
    t.add("FLOOR: time to create the jobs", f"{floor['create_seconds']:.1f}s ({rate:.1f} jobs/s)")
    t.add("FLOOR: time until every job had all children", f"{floor['all_children_seconds']:.1f}s")
    t.add(
        "operator / FLOOR: time until every job had all children",
        fmt_ratio(ratio(loaded["all_children_seconds"], floor["all_children_seconds"]), 2),
    )
    for q in (0.5, 0.95):
        f, o = pct(floor["latencies"], q), pct(loaded["latencies"], q)
        t.add(
            f"FLOOR create -> children p{round(q * 100)}; operator / FLOOR",
            f"{f:.2f}s; {fmt_ratio(ratio(o, f), 2)}",
        )


def floor_targets(targets: Table, floor: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """Rows beside the absolute targets (which keep their verdicts): the operator over the
    floor; notes saying what the floor shows."""
    f95, o95 = pct(floor["latencies"], 0.95), pct(loaded["latencies"], 0.95)
    targets.add(
        "(beside it) create -> children p95, operator / FLOOR (no operator, same burst)",
        f"{o95:.2f}s / {f95:.2f}s = {fmt_ratio(ratio(o95, f95), 2)}",
        "—",
    )
    notes = [
        "FLOOR: the same burst of jobs with each job's objects (the exact ones the operator "
        "writes, from its own builders) created by a plain client with the operator's "
        f"concurrency ({floor['slots']} jobs at a time over {floor['threads']} threads), before "
        "the operator started, in a namespace it never watches; timed like the load. Then the "
        f"run waited {floor['settle_seconds']:.0f}s for the controller-manager's pods of the "
        f"floor ({floor['settle_pods']} / {floor['settle_want']}) before the operator started.",
    ]
    if f95 >= 5:
        notes.append(
            f"The FLOOR's own create -> children p95 is {f95:.1f}s, above the 5 s target: for a "
            f"burst of {floor['jobs']} jobs the target is beyond this machine's API server even "
            "with no operator at all, so the MISSED verdict on it is not a verdict on the "
            "operator; the operator / FLOOR ratio is."
        )
    if floor["errors"]:
        notes.append(f"FLOOR create errors (first 3): {floor['errors'][:3]}")
    return notes
