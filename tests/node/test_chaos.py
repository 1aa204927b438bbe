"""Chaos on the real node (issue 22): one tiny job (2 islands x 1 rank of gpt-tiny, K = M = 2,
checkpoints every outer step on a small tmpfs volume) trains while faults are injected one at a
time, each only once the job has recovered from the one before: the syncer pod deleted and
SIGKILLed right after a merge, a learner pod's network cut for 60 s, the API server stopped for
60 s, the kubelet restarted, the node made NotReady (the kubelet stopped until the node
controller says so), the checkpoint volume filled for 60 s. Then the job is told to stop a few
outer steps on and must succeed on its own; a calm run of the same job to the same outer step is
the baseline its eval loss is compared with at equal merged tokens.

Per fault: merges lost (versions merged again after a restart), their tokens, pushes refused
while it lasted, seconds from the fault's end until a merge holds both islands' pushes again,
container restarts. Each row is written as it is measured to $DILOCO_CHAOS_RESULTS (JSON) when
set: bench/chaos.py runs this file under the real-node lock and renders its section in bench/log/.

The tests run in file order and share one job (module fixtures), like test_job_on_node.py.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from diloco_operator.resources.pods import RUN_AS_USER

from hack.localcluster import chaos
from hack.localcluster.chaos_measure import (
    all_contribute_at,
    loss_at_tokens,
    losses_at_equal_tokens,
    lost_merges,
    read_merges,
    refusal_delta,
)
from hack.localcluster.harness import ControlPlane, poll_until
from hack.localcluster.settings import NODE_NAME

from .job_fixtures import (
    Release,
    chart_release,
    checkpoint_volume,
    job_status,
    syncer_pod,
    syncer_status,
    tiny_job,
)

# A benchmark more than a test tier (20 minutes of faults): `python -m bench.chaos` runs it
# (`-m chaos`); pyproject's addopts leave it out of `make test`.
pytestmark = pytest.mark.chaos

ISLANDS = {"island-0", "island-1"}
FAULT_SECONDS = 60.0
MORE_STEPS = 3
WAIT = float(os.environ.get("DILOCO_NODE_JOB_WAIT", "300"))
RESULTS = os.environ.get("DILOCO_CHAOS_RESULTS")
VOLUME_MB = 48
TRAJECTORY_TOKENS = 100_000  # the two runs' losses compared every this many merged tokens


def hold(seconds: float) -> None:
    """Keep a fault in place for `seconds`: the fault's length, not a wait for anything."""
    threading.Event().wait(seconds)


def chaos_job(name: str, image: str, claim: str) -> dict[str, Any]:
    """tiny_job with one rank per island (a learner pod is an island) and no end in sight."""
    job = copy.deepcopy(tiny_job(name, image, claim, 10_000))
    job["spec"]["islands"]["replicas"] = 1
    return job


@dataclass
class Run:
    cp: ControlPlane
    ns: str
    name: str
    volume: Path
    rows: list[dict[str, Any]] = field(default_factory=list)

    def status(self) -> dict[str, Any]:
        return job_status(self.cp, self.ns, self.name)

    def syncer(self) -> dict[str, Any]:
        return poll_until(
            lambda: syncer_status(self.cp, self.ns, self.name) or {},
            timeout=WAIT,
            what="the syncer answering /v1/status",
            ignore=(OSError,),
        )

    def merges(self) -> list[dict[str, Any]]:
        return read_merges(self.volume / "merges.jsonl")

    def restarts(self) -> int:
        pods = self.cp.kubectl_json("get", "pods", "-n", self.ns)["items"]
        return sum(
            c.get("restartCount", 0)
            for p in pods
            for c in p.get("status", {}).get("containerStatuses", [])
        )

    def pod_uid(self, name: str) -> str:
        return str(self.cp.kubectl_json("get", "pod", name, "-n", self.ns)["metadata"]["uid"])

    def record(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if RESULTS:
            Path(RESULTS).write_text(json.dumps(self.rows, indent=2) + "\n")


def start_run(cp: ControlPlane, image: str, volume: Path, prefix: str, stop: int | None) -> Run:
    ns = cp.create_namespace(prefix)
    chaos.mount_small_fs(volume, size_mb=VOLUME_MB, uid=RUN_AS_USER)
    claim = f"{ns}-ckpt"
    cp.apply(checkpoint_volume(claim, ns, volume))
    job = chaos_job(prefix, image, claim)
    if stop is not None:
        job["spec"]["stopAfter"]["outerSteps"] = stop
    cp.apply(job, ns)
    return Run(cp, ns, prefix, volume)


def end_run(run: Run) -> None:
    if RESULTS and (run.volume / "merges.jsonl").is_file():
        # The merge log beside the rows: what each run merged, for reading the comparison after.
        shutil.copy(
            run.volume / "merges.jsonl", Path(RESULTS).with_name(f"{run.name}-merges.jsonl")
        )
    run.cp.delete_namespace(run.ns, wait=True)
    run.cp.kubectl("delete", "pv", f"{run.ns}-ckpt", "--ignore-not-found", "--wait=false")
    chaos.unmount(run.volume)


@pytest.fixture(scope="module")
def release(
    node_cluster: ControlPlane,
    node_images: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Release]:
    with chart_release(node_cluster, node_images["operator"], tmp_path_factory, "chaos-op") as rel:
        yield rel


@pytest.fixture(scope="module")
def run(
    node_cluster: ControlPlane,
    node_images: dict[str, str],
    release: Release,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Run]:
    volume = tmp_path_factory.mktemp("chaos-volume")
    run = start_run(node_cluster, node_images["trainer"], volume, "chaos", None)
    yield run
    end_run(run)


def fault(
    run: Run,
    name: str,
    inject: Callable[[], Any],
    restore: Callable[[], Any] | None = None,
    *,
    restarts_syncer: bool = False,
    after_merge: bool = False,
) -> dict[str, Any]:
    """Inject one fault (right after a merge is logged when `after_merge`), keep it for
    FAULT_SECONDS when it has a `restore`, then measure until both islands merge again."""
    before = run.syncer()
    restarts = run.restarts()
    if after_merge:
        logged = len(run.merges())
        poll_until(lambda: len(run.merges()) > logged, timeout=WAIT, interval=0.05, what="a merge")
    began = time.time()
    note = inject()
    if restore is not None:
        hold(FAULT_SECONDS)
        note = restore() or note
    note = str(note or "")  # a row is JSON
    ended = time.time()
    back: float = poll_until(
        lambda: all_contribute_at(run.merges(), ended, ISLANDS) or 0.0,
        timeout=WAIT,
        interval=0.5,
        what=f"both islands merged again after {name}",
    )
    after = run.syncer()
    merges = run.merges()
    lost = lost_merges(merges, began - 1.0, back)
    # Merges without every island's push while it lasted: expected where an island cannot reach
    # the syncer (its heartbeat times out); elsewhere an island was left out that could push.
    partial = [
        r
        for r in merges
        if began <= r["time"] < back and ISLANDS - {c["island"] for c in r["contributors"]}
    ]
    row = {
        "fault": name,
        "seconds": round(ended - began, 1),
        "merges_lost": len(lost),
        "tokens_lost": sum(int(r.get("tokens", 0)) for r in lost),
        "partial_merges": len(partial),
        "refused": refusal_delta(
            before.get("refusals", {}), after.get("refusals", {}), restarted=restarts_syncer
        ),
        "recovery_s": round(back - ended, 1),
        "restarts": run.restarts() - restarts,
        "note": note,
    }
    run.record(row)
    return row


def test_chaos_job_trains(run: Run) -> None:
    poll_until(
        lambda: int(run.status().get("outerStep") or 0) >= 3, timeout=WAIT, what="outer step 3"
    )
    assert all_contribute_at(run.merges(), 0.0, ISLANDS) is not None


def test_learner_network_cut(run: Run) -> None:
    pid = chaos.pod_main_pid(run.pod_uid(f"{run.name}-island-0-0"), "learner")
    row = fault(
        run,
        "learner network cut 60 s",
        lambda: chaos.cut_pod_network(pid, cut=True),
        lambda: chaos.cut_pod_network(pid, cut=False),
    )
    assert row["merges_lost"] == 0, row
    assert "steps_out_of_range" not in row["refused"], row  # the learner held at the step cap


def test_syncer_pod_deleted_after_a_merge(run: Run) -> None:
    pod = syncer_pod(run.cp, run.ns, run.name)
    assert pod is not None
    row = fault(
        run,
        "syncer pod deleted",
        lambda: run.cp.kubectl(
            "delete", "pod", pod["metadata"]["name"], "-n", run.ns, "--wait=false"
        ).stdout.strip(),
        restarts_syncer=True,
        after_merge=True,
    )
    assert row["merges_lost"] == 0, row  # a graceful stop checkpoints what it merged


def test_syncer_sigkilled_after_a_merge(run: Run) -> None:
    pod = syncer_pod(run.cp, run.ns, run.name)
    assert pod is not None
    uid = pod["metadata"]["uid"]
    row = fault(
        run,
        "syncer SIGKILLed",
        lambda: f"pid {chaos.kill_pod_process(uid, 'syncer')}",
        restarts_syncer=True,
        after_merge=True,
    )
    assert row["merges_lost"] <= 1, row  # checkpoints every outer step: at most the last merge


def test_api_server_stopped(run: Run) -> None:
    stopped: list[chaos.Stopped] = []

    def restore() -> None:
        chaos.start_component(run.cp.dir, stopped[0])
        poll_until(
            lambda: run.cp.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
            timeout=WAIT,
            what="the API server ready again",
        )

    row = fault(
        run,
        "API server stopped 60 s",
        lambda: stopped.append(chaos.stop_component(run.cp.dir, "kube-apiserver")),
        restore,
    )
    assert row["merges_lost"] == 0, row


def node_ready(cp: ControlPlane) -> bool:
    node = cp.kubectl_json("get", "node", NODE_NAME)
    conditions = node.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_kubelet_restarted(run: Run) -> None:
    def restart() -> str:
        began = time.monotonic()
        chaos.start_component(run.cp.dir, chaos.stop_component(run.cp.dir, "kubelet"))
        poll_until(lambda: node_ready(run.cp), timeout=WAIT, what="the node Ready")
        return f"kubelet back and node Ready in {time.monotonic() - began:.0f} s"

    row = fault(run, "kubelet restarted", restart)
    assert row["merges_lost"] == 0, row


def islands_dropped(run: Run) -> int:
    """IslandDropped Events the operator posted in the job's namespace so far."""
    events = run.cp.kubectl_json(
        "get", "events", "-n", run.ns, "--field-selector", "reason=IslandDropped"
    )["items"]
    return sum(int(e.get("count") or 1) for e in events)


def test_node_not_ready(run: Run) -> None:
    stopped: list[chaos.Stopped] = []
    began: list[float] = []

    def inject() -> None:
        began.append(time.monotonic())
        stopped.append(chaos.stop_component(run.cp.dir, "kubelet"))

    def restore() -> str:
        # Held until the node controller marks the node NotReady (its grace period), then the
        # kubelet comes back.
        poll_until(lambda: not node_ready(run.cp), timeout=WAIT, interval=1.0, what="NotReady")
        not_ready = time.monotonic() - began[0]
        chaos.start_component(run.cp.dir, stopped[0])
        poll_until(lambda: node_ready(run.cp), timeout=WAIT, what="the node Ready again")
        return f"NotReady {not_ready:.0f} s after the kubelet stopped; Ready again after restart"

    dropped = islands_dropped(run)
    row = fault(run, "node NotReady (kubelet stopped)", inject, restore)
    assert row["merges_lost"] == 0, row
    # The pods kept running and heartbeating the syncer: the operator leaves them to its
    # heartbeat timeout instead of dropping them for the node controller's "not Ready"
    # (operator/diloco_operator/health.py).
    assert islands_dropped(run) == dropped, "the operator dropped an island for a node NotReady"
    assert row["partial_merges"] == 0, row


def conditions(run: Run) -> dict[str, str]:
    return {c["type"]: c.get("reason", "") for c in run.status().get("conditions", [])}


def test_checkpoint_volume_full(run: Run) -> None:
    filler: list[Path] = []
    seen: list[str] = []

    def inject() -> None:
        filler.append(chaos.fill(run.volume))

    def restore() -> str:
        seen.append(conditions(run).get("SyncerHealthy", ""))
        filler[0].unlink()
        return f"SyncerHealthy reason while full: {seen[0] or 'none'}"

    row = fault(run, "checkpoint volume full 60 s", inject, restore)
    assert row["merges_lost"] == 0, row
    # The checkpoints go on once there is room again.
    step = int(run.syncer()["checkpoint"]["outerStep"])
    poll_until(
        lambda: int(run.syncer()["checkpoint"]["outerStep"]) > step,
        timeout=WAIT,
        what="a new checkpoint after the volume was emptied",
        ignore=(OSError, TypeError),
    )


def finish(run: Run) -> dict[str, Any]:
    """Wait for the job to succeed; its final evaluation from the syncer's last status that
    answered (read while its pod still answers: the job's own status keeps no eval history)."""
    seen: list[dict[str, Any]] = []

    def done() -> bool:
        try:
            status = syncer_status(run.cp, run.ns, run.name)
        except OSError:
            status = None
        if status is not None and status.get("evalHistory"):
            seen.append(status)
        return run.status().get("phase") == "Succeeded" and bool(seen)

    poll_until(done, timeout=2 * WAIT, interval=1.0, what=f"{run.name} Succeeded")
    return final_eval(seen[-1])


def final_eval(status: dict[str, Any]) -> dict[str, Any]:
    """The last evaluation (its merged tokens and loss) and the eval history (tokens, loss)."""
    history = [(int(p["tokens"]), float(p["evalLoss"])) for p in status["evalHistory"]]
    tokens, loss = history[-1]
    return {"tokens": tokens, "eval_loss": loss, "history": history}


def stop_at(run: Run, stop: int) -> None:
    """Tell the job to stop at outer step `stop` (stopAfter.outerSteps patched)."""
    patch = {"spec": {"stopAfter": {"outerSteps": stop}}}
    run.cp.kubectl("patch", "dj", run.name, "-n", run.ns, "--type=merge", "-p", json.dumps(patch))


def test_chaos_job_succeeds_on_its_own(run: Run) -> None:
    patched_at = int(run.syncer()["outerStep"])
    stop = patched_at + MORE_STEPS
    stop_at(run, stop)
    ended = finish(run)
    run.record(
        {"fault": "(end)", "succeeded": True, "outer_step": stop, "patched_at": patched_at, **ended}
    )


def test_calm_run_baseline_at_equal_tokens(
    run: Run, node_images: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The calm run is the chaos run's job without the faults: the same spec (stopAfter
    included: with stopAfter.outerSteps set the inner learning rate is a cosine over it, and
    learners read it when they start, so a calm job started with the final outer step would
    anneal where the chaos job ran at its peak rate) and told to stop the same way, at the
    same outer step."""
    end = run.rows[-1]
    assert end["fault"] == "(end)", "the chaos job did not finish"
    volume = tmp_path_factory.mktemp("calm-volume")
    calm = start_run(run.cp, node_images["trainer"], volume, "calm", None)
    try:
        poll_until(
            lambda: int(calm.syncer()["outerStep"]) >= end["patched_at"],
            timeout=6 * WAIT,
            interval=0.5,
            what=f"the calm run at outer step {end['patched_at']}",
        )
        stop_at(calm, end["outer_step"])
        base = finish(calm)
    finally:
        end_run(calm)
    try:
        ratio: float | None = end["eval_loss"] / loss_at_tokens(base["history"], end["tokens"])
    except ValueError:  # the chaos run's tokens are outside the calm run's history
        ratio = None
    along = losses_at_equal_tokens(end["history"], base["history"], TRAJECTORY_TOKENS)
    run.record({"fault": "(calm)", **base, "chaos_loss_ratio": ratio, "along": along})
    assert ratio is not None and ratio <= 1.05, (end, base)
