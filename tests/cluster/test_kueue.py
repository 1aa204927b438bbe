"""Kueue built from its pinned module, running against the local control plane, admits each
island on its own (docs/kueue.md): a smoke test of Kueue itself, then the operator's jobs in a
queue.

kwok's nodes give Kueue capacity and run the admitted pods (no containers); learners and the
syncer run on loopback, as in the other operator tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .kueue_helpers import (
    QUEUE_LABEL,
    admitted,
    condition,
    contributed,
    cpu_in_use,
    dump,
    gated,
    island_index,
    island_pods_gated,
    island_pods_running,
    make_queues,
    pods_of,
    priority_class,
    queued_manifest,
    remote_syncer_for,
    statefulset,
    syncer_status,
    waiting_for_quota,
    workloads,
)
from .operator_helpers import Cluster, OperatorProcess
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster


def _pod(cluster: Cluster, sts: str) -> dict | None:
    pods = pods_of(cluster, f"app={sts}")
    return pods[0] if pods else None


def _running(cluster: Cluster, sts: str) -> bool:
    pod = _pod(cluster, sts)
    if pod is None or gated(pod):
        return False
    return (pod.get("status") or {}).get("phase") == "Running"


def _workload_of(cluster: Cluster, sts: str) -> dict | None:
    owned = [
        w
        for w in workloads(cluster)
        if any(r.get("name") == sts for r in w["metadata"].get("ownerReferences") or [])
    ]
    return owned[0] if owned else None


def test_kueue_gates_a_labelled_statefulset_until_quota_admits_it(
    kueue_cluster: Cluster,
) -> None:
    """One CPU of quota: the first StatefulSet is admitted and runs, the second's pod is held
    by Kueue's admission gate while its Workload waits, and runs once the first is gone."""
    cluster = kueue_cluster
    queue = make_queues(cluster, cpu="1")
    cluster.apply(statefulset("first", queue))
    wait_until(lambda: _running(cluster, "first"), WAIT, message="first admitted and Running")
    first = _workload_of(cluster, "first")
    assert first is not None and admitted(first), dump(first)

    cluster.apply(statefulset("second", queue))
    # Evaluated and found not to fit: a Workload of its own, pending, its pod gated.
    waiting = wait_until(
        lambda: (
            (w := _workload_of(cluster, "second")) is not None
            and any(
                c["type"] == "QuotaReserved" and c["status"] == "False"
                for c in (w.get("status") or {}).get("conditions") or []
            )
            and w
        ),
        WAIT,
        message="second's Workload pending without quota",
    )
    assert not admitted(waiting)
    pod = _pod(cluster, "second")
    assert pod is not None and gated(pod), dump(pod)
    assert pod["metadata"]["labels"][QUEUE_LABEL] == queue
    assert (pod.get("status") or {}).get("phase") == "Pending"
    wait_until(lambda: cpu_in_use(cluster.cp, f"cq-{cluster.ns}") == 1.0, WAIT, message="usage 1.0")

    cluster.cp.kubectl("delete", "statefulset", "first", "-n", cluster.ns)
    wait_until(lambda: _running(cluster, "second"), WAIT, message="second admitted once freed")
    second = _workload_of(cluster, "second")
    assert second is not None and admitted(second), dump(second)


# ------------------------------------------------------------------------------ the operator


def test_quota_for_two_of_three_islands_then_the_third_joins(
    kueue_cluster: Cluster, kueue_operator: OperatorProcess, tmp_path: Path
) -> None:
    """Quota for 3 CPUs, one held by another workload: two islands train and merge at the
    job's quorum (2), the third waits for quota (condition, dropped at the syncer, not Failed);
    deleting the other workload admits it, it rejoins and contributes to a merge."""
    cluster = kueue_cluster
    queue = make_queues(cluster, cpu="3")
    cluster.apply(statefulset("other", queue))
    wait_until(lambda: _running(cluster, "other"), WAIT, message="the other workload admitted")
    manifest = queued_manifest("q3", queue, islands=3, quorum=2)
    with remote_syncer_for(cluster, manifest, tmp_path / "syncer") as syncer:
        cluster.apply(manifest)
        islands = ("island-0", "island-1", "island-2")

        def two_run_one_waits() -> tuple[list[str], str] | None:
            running = [i for i in islands if island_pods_running(cluster, "q3", i)]
            gated_now = [i for i in islands if island_pods_gated(cluster, "q3", i)]
            return (running, gated_now[0]) if len(running) == 2 and len(gated_now) == 1 else None

        admitted_islands, waiting = wait_until(
            two_run_one_waits, WAIT, message="two islands admitted, one gated"
        )
        wait_until(
            lambda: waiting_for_quota(cluster, "q3") == [waiting],
            WAIT,
            message=f"the job's status says {waiting} waits for quota",
        )
        wait_until(
            lambda: syncer.island_state(waiting) == "dropped", WAIT, message=f"{waiting} dropped"
        )
        info = syncer_status(syncer)["islands"][waiting]
        assert info["reason"].startswith("waiting for quota"), info
        status = cluster.status("q3")
        assert status["phase"] != "Failed"
        entry = next(i for i in status["islandStatuses"] if i["name"] == waiting)
        assert entry["healthy"] is False and entry["readyPods"] == 0
        # Its own entry says why: waiting for quota (the status patch may trail the drop).
        wait_until(
            lambda: any(
                i["name"] == waiting and i.get("waitingForQuota") is True
                for i in cluster.status("q3").get("islandStatuses", [])
            ),
            WAIT,
            message=f"{waiting} waitingForQuota",
        )

        for island in admitted_islands:
            syncer.start_learner(island, island_index(island))
        merged = wait_until(
            lambda: (st := syncer_status(syncer)).get("outerStep", 0) >= 1 and st,
            300,
            message="a merge at the quorum of the two admitted islands",
        )
        assert not contributed(merged, waiting)
        assert merged["islands"][waiting]["state"] == "dropped"

        cluster.cp.kubectl("delete", "statefulset", "other", "-n", cluster.ns)
        wait_until(
            lambda: island_pods_running(cluster, "q3", waiting), WAIT, message=f"{waiting} admitted"
        )
        wait_until(
            lambda: syncer.island_state(waiting) == "active", WAIT, message=f"{waiting} re-added"
        )
        wait_until(
            lambda: condition(cluster.status("q3"), "WaitingForQuota").get("status") == "False",
            WAIT,
            message="WaitingForQuota False",
        )
        syncer.start_learner(waiting, island_index(waiting))
        wait_until(
            lambda: contributed(syncer_status(syncer), waiting),
            300,
            message=f"{waiting} contributes to a merge",
        )
        wait_until(
            lambda: cpu_in_use(cluster.cp, f"cq-{cluster.ns}") == 3.0, WAIT, message="usage 3.0"
        )


def test_a_preempted_island_is_dropped_and_back_when_readmitted(
    kueue_cluster: Cluster, kueue_operator: OperatorProcess, tmp_path: Path
) -> None:
    """Two admitted islands; a workload of a higher priority takes one island's quota: that
    island is dropped (waiting for quota), the job goes on with the other, never Failed; the
    preemptor gone, the island is admitted again and re-added (membership only: no learners)."""
    cluster = kueue_cluster
    queue = make_queues(cluster, cpu="2")
    cluster.cp.apply(priority_class(f"high-{cluster.ns}", 1000))
    manifest = queued_manifest("pre", queue, islands=2, quorum=1)
    with remote_syncer_for(cluster, manifest, tmp_path / "syncer") as syncer:
        cluster.apply(manifest)
        wait_until(lambda: cluster.status("pre").get("phase") == "Running", WAIT, message="Running")

        cluster.apply(statefulset("urgent", queue, priority=f"high-{cluster.ns}"))
        wait_until(lambda: _running(cluster, "urgent"), WAIT, message="the urgent workload runs")
        (victim,) = wait_until(
            lambda: waiting_for_quota(cluster, "pre"), WAIT, message="one island preempted"
        )
        survivor = "island-1" if victim == "island-0" else "island-0"
        wait_until(
            lambda: syncer.island_state(victim) == "dropped", WAIT, message=f"{victim} dropped"
        )
        assert island_pods_gated(cluster, "pre", victim)
        assert island_pods_running(cluster, "pre", survivor)
        assert syncer.island_state(survivor) != "dropped"
        assert cluster.status("pre")["phase"] != "Failed"
        wait_until(
            lambda: cpu_in_use(cluster.cp, f"cq-{cluster.ns}") == 2.0, WAIT, message="usage 2.0"
        )

        cluster.cp.kubectl("delete", "statefulset", "urgent", "-n", cluster.ns)
        wait_until(lambda: syncer.island_state(victim) == "active", WAIT, message=f"{victim} back")
        wait_until(lambda: cluster.status("pre").get("phase") == "Running", WAIT, message="Running")
        assert waiting_for_quota(cluster, "pre") == []


def test_suspend_frees_all_quota_and_resume_loses_no_merge(
    kueue_cluster: Cluster, kueue_operator: OperatorProcess, tmp_path: Path
) -> None:
    """suspend: true gives every CPU back (the ClusterQueue's usage is zero); suspend: false
    brings the islands back through Kueue at the same outer step and weights digest."""
    cluster = kueue_cluster
    queue = make_queues(cluster, cpu="2")
    cq = f"cq-{cluster.ns}"
    manifest = queued_manifest("sus", queue, islands=2, quorum=2)
    with remote_syncer_for(cluster, manifest, tmp_path / "syncer") as syncer:
        cluster.apply(manifest)
        wait_until(lambda: cluster.status("sus").get("phase") == "Running", WAIT, message="Running")
        learners = [syncer.start_learner(i, island_index(i)) for i in ("island-0", "island-1")]
        wait_until(lambda: syncer_status(syncer).get("outerStep", 0) >= 1, 300, message="a merge")
        for learner in learners:
            learner.stop()
        before = syncer_status(syncer, digest=True)
        wait_until(lambda: cpu_in_use(cluster.cp, cq) == 2.0, WAIT, message="usage of 2 CPUs")

        cluster.patch_spec("sus", {"suspend": True})
        wait_until(lambda: cpu_in_use(cluster.cp, cq) == 0.0, WAIT, message="usage back to zero")
        wait_until(
            lambda: cluster.status("sus").get("phase") == "Suspended", WAIT, message="Suspended"
        )
        assert not cluster.items("pods", "diloco.dev/job=sus")
        # Deleted, not scaled to zero (queueing.queued_children says why).
        assert cluster.get("statefulset", "sus-island-0") is None
        assert syncer_status(syncer, digest=True)["digest"] == before["digest"]

        cluster.patch_spec("sus", {"suspend": False})
        wait_until(lambda: cluster.status("sus").get("phase") == "Running", WAIT, message="resumed")
        # Kueue writes the ClusterQueue's usage after it admits: the islands may be Ready (and
        # the job Running) a moment before the usage shows them.
        wait_until(lambda: cpu_in_use(cluster.cp, cq) == 2.0, WAIT, message="usage back to 2")
        after = syncer_status(syncer, digest=True)
        assert after["outerStep"] == before["outerStep"] and after["digest"] == before["digest"]


def test_the_syncer_of_a_queued_job_is_outside_the_queue(
    kueue_cluster: Cluster, kueue_operator: OperatorProcess
) -> None:
    """No quota at all: the islands wait, the syncer's pod (the job's own) runs ungated and
    carries no queue label."""
    cluster = kueue_cluster
    queue = make_queues(cluster, cpu="0")
    manifest = queued_manifest("own", queue, islands=1, quorum=1)
    cluster.apply(manifest)
    wait_until(lambda: island_pods_gated(cluster, "own", "island-0"), WAIT, message="island gated")
    (pod,) = wait_until(
        lambda: [
            p
            for p in cluster.items("pods", "diloco.dev/job=own,app.kubernetes.io/component=syncer")
            if (p.get("status") or {}).get("phase") == "Running"
        ],
        WAIT,
        message="the syncer pod running",
    )
    assert not gated(pod) and QUEUE_LABEL not in pod["metadata"]["labels"]
    sts = cluster.get("statefulset", "own-island-0")
    assert sts is not None and sts["metadata"]["labels"][QUEUE_LABEL] == queue
    wait_until(
        lambda: waiting_for_quota(cluster, "own") == ["island-0"],
        WAIT,
        message="the job's status says island-0 waits for quota",
    )
