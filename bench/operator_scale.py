"""Operator: apply-to-children time, pod-NotReady-to-syncer-drop time, and a 100 x 8 load on kwok.

Runs against the local control plane (hack/local-cluster: real etcd, apiserver, controller-manager,
scheduler; kwok fake nodes) with the operator as a real process, both started through
hack/localcluster/harness.py like the cluster tests do. Run it from the repository root:
`python -m bench.operator_scale`.

1. Apply -> all children: time from creating a DiLoCoJob to the last of its children (ConfigMap,
   token Secret, syncer Deployment + Service, per island a StatefulSet + headless Service) being
   present. Baseline in the same run: creating the very same objects directly through the API
   (in a namespace the operator does not watch), i.e. what the API server itself costs.
2. Pod NotReady -> syncer drop: a real `diloco syncer` on loopback serves a job (spec.syncer.
   endpoint); one learner pod's Ready condition is set False through the status subresource and
   we time until the syncer reports the island dropped. Baseline: how long a plain watch in this
   process takes to see the pod change, plus one direct admin call to the syncer.
3. Load: N jobs x M islands (default 100 x 8) created one after another as fast as the API server
   takes them (bench/harness/operator_load.py). Reported: time until every job has all its children,
   latency percentiles per job (its create -> its last child seen by watches running from the
   first create on), the operator's own reconcile-time percentiles (timed from each reconcile's
   start of work) beside its first reconciles' wait for a slot (both its Prometheus histograms),
   errors, and its memory (RSS) before and at peak.
0. Floor of the load (bench/harness/operator_floor.py), run first, before the operator starts: the
   same burst of jobs, each job's objects (built by the operator's own builders) created by a plain
   client with the operator's concurrency. The load's latencies are reported as ratios to it
   beside the absolute targets; a floor above a target says the target is beyond this API
   server for that burst.

    python -m bench.operator_scale                    # 5 repeats, 100 jobs x 8 islands
    python -m bench.operator_scale --load-jobs 20 --load-islands 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco_operator import api as op_api
from diloco_operator.api import parse_job_spec
from diloco_operator.credential_secrets import new_root
from diloco_operator.options import network_options
from diloco_operator.resources import (
    JOB_LABEL,
    ROTATE_CREDENTIALS,
    JobRef,
    NetworkOptions,
    build_children,
    build_island_tokens_secret,
    build_token_secret,
)
from diloco_trainer.api.credentials import Issuer
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.local import free_port, start_syncer, wait_ready, write_job_files

from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_ratio,
    install_signal_cleanup,
    poll_until,
    publish,
    ratio,
    track,
    verdict,
    workdir,
)
from bench.harness.kube_cluster import (
    Api,
    PodWatch,
    operator_process,
    set_ready,
    start_cluster,
    stop_cluster,
)
from bench.harness.operator_floor import floor_rows, floor_targets, measure_floor, settle
from bench.harness.operator_load import load_table, measure_load, pct
from hack.localcluster.harness import (
    TINY_TRAINING,
    OperatorProcess,
    WaitTimeout,
    condition_status,
    islands_ready,
)


def manifest(name: str, islands: int, replicas: int, **extra: Any) -> dict[str, Any]:
    spec = {
        "image": "diloco-trainer:bench",
        **TINY_TRAINING,
        "islands": {"count": islands, "replicas": replicas},
        **extra,
    }
    return {
        "apiVersion": op_api.API_VERSION,
        "kind": op_api.KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


def expected_children(body: dict[str, Any]) -> set[tuple[str, str]]:
    """(kind, name) of every child the operator must create for this job object."""
    ref = JobRef.from_body(body)
    spec = parse_job_spec(body["spec"])
    kids = build_children(ref, spec, islands_running=True)
    if not spec.syncer.token_secret_name:
        kids.append(build_token_secret(ref, "x"))
    return {(k["kind"], k["metadata"]["name"]) for k in kids}


def operator_objects(body: dict[str, Any], network: NetworkOptions) -> list[dict[str, Any]]:
    """Every object the operator writes for a new job (sync.py and credential_secrets.py), built
    with its own pure builders: the token Secret, the island credentials Secret, the children."""
    ref = JobRef.from_body(body)
    spec = parse_job_spec(body["spec"])
    token = new_root()
    issuer = Issuer.of(token)
    secret = build_token_secret(ref, token)
    secret["metadata"]["annotations"][ROTATE_CREDENTIALS] = ""  # as credential_secrets.py writes it
    return [
        secret,
        build_island_tokens_secret(ref, spec, issuer),
        *build_children(
            ref, spec, islands_running=True, credential=issuer.fingerprint(), network=network
        ),
    ]


def measure_apply(k: Api, ns: str, base_ns: str, repeats: int, islands: int) -> dict[str, Any]:
    """Operator apply -> children, and the same objects created directly (baseline)."""
    operator_s, direct_s = [], []
    for r in range(repeats):
        name = f"apply-{r}"
        t0 = time.perf_counter()
        body = k.create_job(ns, manifest(name, islands, 2))
        want = expected_children(body)
        poll_until(
            lambda w=want, n=name: w <= k.present(ns, f"{JOB_LABEL}={n}"),
            timeout=120,
            interval=0.02,
            what=f"children of {name}",
        )
        operator_s.append(time.perf_counter() - t0)

        # Baseline: the same objects, created by us in a namespace the operator ignores.
        base = k.create_job(base_ns, manifest(name, islands, 2))
        ref = JobRef.from_body(base)
        spec = parse_job_spec(base["spec"])
        objs = [*build_children(ref, spec, islands_running=True), build_token_secret(ref, "x")]
        t0 = time.perf_counter()
        for obj in objs:
            k.create(base_ns, obj)
        direct_s.append(time.perf_counter() - t0)
        print(
            f"  apply {r}: operator {operator_s[-1]:.3f}s, direct {direct_s[-1]:.3f}s", flush=True
        )
    return {"operator": operator_s, "direct": direct_s, "children": len(want)}


class SyncerForDrop:
    """A real syncer on loopback that a job in the cluster points at (spec.syncer.endpoint)."""

    def __init__(self, wd: Path, islands: int) -> None:
        spec = parse_spec({**TINY_TRAINING, "islands": {"count": islands}})
        self.files = write_job_files(spec, wd)
        self.port = free_port()
        self.proc = track(
            start_syncer(
                self.files,
                port=self.port,
                state_dir=wd / "state",
                job_name="drop",
                log_file=wd / "syncer.log",
                extra_env={"OMP_NUM_THREADS": "1"},
            )
        )
        self.url = f"http://127.0.0.1:{self.port}"
        wait_ready(self.url, self.files.token, 120, proc=self.proc)

    def _request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.files.token}",
                "Content-Type": "application/json",
            },
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def island_state(self, island: str) -> str | None:
        return (self._request("GET", "/v1/status")["islands"].get(island) or {}).get("state")

    def admin_seconds(self) -> float:
        """One direct membership call (what the operator has to do at minimum): island-0 is
        active already, so this changes nothing (a name that is no island of the job is
        refused with 403 since the syncer checks names)."""
        t0 = time.perf_counter()
        self._request("PUT", "/v1/islands/island-0", {"state": "active", "reason": "bench"})
        return time.perf_counter() - t0


def measure_drop(k: Api, ns: str, wd: Path, repeats: int) -> dict[str, Any]:
    syncer = SyncerForDrop(wd, islands=2)
    k.core.create_namespaced_secret(
        ns, {"metadata": {"name": "drop-token"}, "stringData": {"token": syncer.files.token}}
    )
    k.create_job(
        ns,
        manifest(
            "drop",
            2,
            1,
            syncer={"endpoint": syncer.url, "tokenSecretName": "drop-token"},
        ),
    )

    def ready_and_reachable() -> bool:
        job = k.get_job(ns, "drop")
        return islands_ready(job) == 2 and condition_status(job, "SyncerReachable") == "True"

    poll_until(ready_and_reachable, timeout=180, what="job 'drop' ready with its syncer reached")
    pod = "drop-island-1-0"
    watch = PodWatch(k, ns, pod)
    time.sleep(0.5)  # the watch's initial ADDED event is in
    drop_s, readd_s, watch_s, admin_s = [], [], [], []

    def flip(ready: bool, state: str) -> float:
        """Set the pod's readiness; the time it was set, once the syncer shows `state`."""
        t0 = time.perf_counter()
        set_ready(k, ns, pod, ready)
        poll_until(
            lambda: syncer.island_state("island-1") == state,
            timeout=60,
            interval=0.01,
            what=f"island-1 {state} at the syncer",
        )
        return t0

    try:
        for r in range(repeats):
            t0 = flip(False, "dropped")
            drop_s.append(time.perf_counter() - t0)
            seen = watch.first_after(t0, False)
            if seen is not None:
                watch_s.append(seen - t0)
            admin_s.append(syncer.admin_seconds())
            t0 = flip(True, "active")
            readd_s.append(time.perf_counter() - t0)
            print(f"  drop {r}: {drop_s[-1]:.3f}s, re-add {readd_s[-1]:.3f}s", flush=True)
    finally:
        watch.stop()
        syncer.proc.stop()
    return {"drop": drop_s, "readd": readd_s, "watch": watch_s, "admin": admin_s}


def measure_floor_phase(args: argparse.Namespace, cluster: Any, k: Api, ns: str) -> dict[str, Any]:
    """The load's floor (bench/harness/operator_floor.py) before any operator runs, then a wait till
    the controller-manager made its pods, so that the operator's load starts on a quiet API."""
    print(f"0. floor: {args.load_jobs} jobs x {args.load_islands} islands, no operator", flush=True)
    network = network_options(cluster.env)  # the operator process gets the same environment
    floor = measure_floor(
        k, floor_api_client(cluster), ns, args.load_jobs, args.load_islands, args.load_deadline,
        manifest=manifest, expected=expected_children,
        objects=lambda body: operator_objects(body, network),
    )  # fmt: skip
    print(
        f"  floor: {floor['done']}/{floor['jobs']} jobs in {floor['all_children_seconds']:.0f}s, "
        f"p95 {pct(floor['latencies'], 0.95):.1f}s; waiting for its pods",
        flush=True,
    )
    pods = args.load_jobs * (args.load_islands + 1)  # one learner per island, one syncer
    floor["settle_seconds"], floor["settle_pods"] = settle(k, ns, pods, args.settle_timeout)
    floor["settle_want"] = pods
    return floor


def floor_api_client(cluster: Any) -> Any:
    """An API client with as many pooled connections as the operator's API threads."""
    from diloco_operator.kube import API_THREADS
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = API_THREADS
    return client.ApiClient(configuration)


def measure(args: argparse.Namespace, wd: Path, nodes: int) -> dict[str, Any]:
    """Start the control plane and the operator, take the measurements not skipped, stop both."""
    print(f"starting the local control plane ({nodes} kwok nodes)", flush=True)
    t0 = time.perf_counter()
    cluster = start_cluster(wd / "cluster", nodes, wd / "local-cluster.log")
    out: dict[str, Any] = {"up_s": time.perf_counter() - t0}
    op: OperatorProcess | None = None
    try:
        cluster.install_crd(timeout="60s")
        k = Api(cluster)
        for ns in ("bench-apply", "bench-base", "bench-drop", "bench-load", "bench-floor"):
            k.namespace(ns)
        if "load" not in args.skip and "floor" not in args.skip:
            out["floor"] = measure_floor_phase(args, cluster, k, "bench-floor")
        op = operator_process(
            cluster, ["bench-apply", "bench-drop", "bench-load"], wd / "operator.log"
        )
        op.start(timeout=120)
        if "apply" not in args.skip:
            print("1. apply -> children", flush=True)
            out["apply"] = measure_apply(
                k, "bench-apply", "bench-base", args.repeats, args.apply_islands
            )
        if "drop" not in args.skip:
            print("2. pod NotReady -> syncer drop", flush=True)
            try:
                out["drop"] = measure_drop(k, "bench-drop", wd / "drop", args.repeats)
            except WaitTimeout as err:  # reported as not measured; the load still runs
                out["drop_error"] = str(err)
                print(f"  drop not measured: {err}", flush=True)
        if "load" not in args.skip:
            print(f"3. load: {args.load_jobs} jobs x {args.load_islands} islands", flush=True)
            out["load"] = measure_load(
                k, op, "bench-load", args.load_jobs, args.load_islands, args.load_deadline,
                manifest=manifest, expected=expected_children,
            )  # fmt: skip
    finally:
        if op is not None:
            op.stop()
        stop_cluster(cluster)
    return out


def apply_table(args: argparse.Namespace, apply: dict[str, Any], targets: Table) -> Table:
    t = Table(
        f"Apply -> all children ({args.apply_islands} islands x 2 replicas: "
        f"{apply['children']} children), {args.repeats} jobs",
        ["path", "median", "p95", "max", "median vs direct"],
    )
    med_direct = statistics.median(apply["direct"])
    for label, xs in (("operator (create job -> children)", apply["operator"]),
                      ("direct API creates (baseline)", apply["direct"])):  # fmt: skip
        t.add(
            label,
            f"{statistics.median(xs):.3f}s",
            f"{pct(xs, 0.95):.3f}s",
            f"{max(xs):.3f}s",
            fmt_ratio(ratio(statistics.median(xs), med_direct), 2),
        )
    worst = max(apply["operator"])
    targets.add(
        "job applied -> all children created < 2 s", f"max {worst:.2f}s", verdict(worst < 2)
    )
    return t


def drop_table(args: argparse.Namespace, drop: dict[str, Any], targets: Table) -> Table:
    t = Table(
        f"Pod NotReady -> island dropped at the syncer ({args.repeats} times)",
        ["what", "median", "max", "median vs baseline"],
    )
    base = statistics.median(drop["watch"] or [float("nan")]) + statistics.median(drop["admin"])
    for label, xs in (
        ("pod NotReady -> syncer drop", drop["drop"]),
        ("pod Ready -> syncer re-add", drop["readd"]),
        ("baseline: own watch sees the pod + one admin call", [base]),
    ):
        t.add(label, f"{statistics.median(xs):.3f}s", f"{max(xs):.3f}s",
              fmt_ratio(ratio(statistics.median(xs), base), 1))  # fmt: skip
    worst = max(drop["drop"])
    targets.add("island failure -> syncer drop < 5 s", f"max {worst:.2f}s", verdict(worst < 5))
    return t


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(__doc__ or "")
    p.add_argument("--repeats", type=int, default=5, help="apply and drop measurements")
    p.add_argument("--apply-islands", type=int, default=4, help="islands of the timed jobs")
    p.add_argument("--load-jobs", type=int, default=100)
    p.add_argument("--load-islands", type=int, default=8)
    p.add_argument("--load-deadline", type=float, default=600, help="seconds")
    p.add_argument("--nodes", type=int, default=0, help="kwok nodes (default: enough pods)")
    p.add_argument(
        "--settle-timeout", type=float, default=600, help="seconds to wait for the floor's pods"
    )
    p.add_argument("--skip", nargs="*", default=[], choices=["apply", "drop", "load", "floor"])
    args = p.parse_args(argv)
    install_signal_cleanup()
    load_pods = args.load_jobs * (args.load_islands + 1)
    floors = 0 if {"load", "floor"} & set(args.skip) else 1
    # The floor's pods stay: the load's must fit beside them, or they would wait unscheduled.
    pods = load_pods * (1 + floors) + 2 * args.repeats * args.apply_islands + 8
    nodes = args.nodes or max(4, -(-pods // 100))  # kwok nodes take 110 pods each
    with LoadMonitor() as load, workdir(args.workdir, "operator") as wd:
        got = measure(args, wd, nodes)
    apply, drop, loaded = got.get("apply"), got.get("drop"), got.get("load")
    floor = got.get("floor")

    tables = []
    targets = Table("Targets", ["target", "figure", "verdict"])
    if apply:
        tables.append(apply_table(args, apply, targets))
    if drop:
        tables.append(drop_table(args, drop, targets))
    elif got.get("drop_error"):
        targets.add("island failure -> syncer drop < 5 s", got["drop_error"], "NOT MEASURED")
    if loaded:
        unloaded = statistics.median(apply["operator"]) if apply else float("nan")
        load_t = load_table(loaded, args.load_islands, unloaded, nodes, targets)
        if floor:
            floor_rows(load_t, floor, loaded)
        tables.append(load_t)
    floor_notes = floor_targets(targets, floor, loaded) if floor and loaded else []
    tables.append(targets)
    notes = [
        f"Control plane: hack/local-cluster with {nodes} kwok nodes; `up` took {got['up_s']:.0f}s.",
        "Times are polled (20 ms for apply, 10 ms for the syncer state), so they carry up to one "
        "poll interval plus one API round trip of measurement error.",
        "The load test's jobs run their syncer in-cluster (kwok: no containers), so the operator's "
        "status polls of the syncers fail; those are counted apart from reconcile errors.",
        "Load: create -> children runs from each job's own create to the first watch event of its "
        "last child (watches from the first create on). Runs before 2026-11-24 04:00 listed the "
        "namespace only once every job was created, so their per-job latencies held the "
        "creation time; their reconcile time was timed from when a reconcile was queued.",
        *floor_notes,
    ]
    report = Report(
        "operator",
        "Operator latencies on a real control plane with kwok nodes: apply -> children, pod "
        "NotReady -> syncer drop, and a many-job load.",
        tables=tables,
        notes=notes,
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
