"""Pod health -> syncer membership, and syncer progress -> job status, with a real syncer; pushes
the syncer refuses -> Events on the job, and an island the syncer dropped for them stays out.

kwok pods have no containers, so a real `diloco syncer` (and, for progress, a real learner)
runs on loopback and the job points at it with spec.syncer.endpoint.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from diloco_trainer.api import credentials, protocol
from diloco_trainer.api.protocol import PushMeta, SyncerError
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.learner.syncer_client import SyncerClient

from .operator_helpers import Cluster, LocalSyncer, OperatorProcess, job_manifest
from .waits import WAIT, elapsed_until, holds_for, wait_until

pytestmark = pytest.mark.cluster

# How fast a drop reaches the syncer is measured by bench/operator_scale.py; WAIT only bounds it.


def _remote_job(name: str, make_local_syncer: Any, **spec: Any) -> tuple[dict, LocalSyncer]:
    manifest = job_manifest(name, **spec)
    syncer = make_local_syncer(manifest)
    manifest["spec"]["syncer"] = {"endpoint": syncer.url, "tokenSecretName": syncer.secret_name}
    return manifest, syncer


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def test_operator_drops_unready_island_and_readds_it(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest, syncer = _remote_job("mem", make_local_syncer, islands={"count": 2, "replicas": 2})
    cluster.apply(manifest)
    # One status document for the wait and the assertions on it (read twice, its fields could
    # come from different reconciles).
    status = wait_until(
        lambda: (
            (st := cluster.status("mem")).get("islands", {}).get("ready") == 2
            and _condition(st, "SyncerReachable").get("status") == "True"
            and st
        ),
        WAIT,
        message="both islands ready and the syncer reached",
    )
    assert status["phase"] == "Running"
    assert cluster.get("deployment", "mem-syncer") is None  # remote syncer: none here

    cluster.set_pod_ready("mem-island-1-1", False)
    took = elapsed_until(
        lambda: syncer.island_state("island-1") == "dropped", WAIT, "island-1 dropped at the syncer"
    )
    print(f"pod NotReady -> island dropped at the syncer: {took:.2f}s")
    assert syncer.island_state("island-0") != "dropped"
    (event,) = wait_until(lambda: cluster.events("IslandDropped"), WAIT, message="drop Event")
    assert "island-1" in event["message"] and "mem-island-1-1" in event["message"]
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "mem"
    status = wait_until(
        lambda: (st := cluster.status("mem")).get("phase") == "Degraded" and st,
        WAIT,
        message="Degraded",
    )
    entry = next(i for i in status["islandStatuses"] if i["name"] == "island-1")
    assert entry["healthy"] is False and entry["readyPods"] == 1

    cluster.set_pod_ready("mem-island-1-1", True)
    took = elapsed_until(
        lambda: syncer.island_state("island-1") == "active", WAIT, "island-1 active again"
    )
    print(f"pod Ready -> island re-added at the syncer: {took:.2f}s")
    wait_until(lambda: cluster.events("IslandReadded"), WAIT, message="re-add Event")
    wait_until(lambda: cluster.status("mem").get("phase") == "Running", WAIT, message="Running")
    metrics = operator.metrics()
    assert "diloco_operator_islands_dropped_total 1.0" in metrics
    assert "diloco_operator_islands_readded_total 1.0" in metrics


def test_operator_status_follows_syncer_to_success(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest, syncer = _remote_job(
        "prog",
        make_local_syncer,
        islands={"count": 1, "replicas": 1},
        stopAfter={"outerSteps": 2},
        # Long enough for the checks below to see the finished job before it is deleted (with
        # 3 s, a loaded machine's kubectl polls could miss the Succeeded status altogether).
        ttlSecondsAfterFinished=20,
    )
    cluster.apply(manifest)
    wait_until(lambda: cluster.status("prog").get("phase") == "Running", WAIT, message="Running")
    learner = syncer.start_learner("island-0", 0)

    def outer_step_in_status() -> dict[str, Any] | None:
        status = cluster.status("prog")
        return status if (status.get("outerStep") or 0) >= 1 else None

    status = wait_until(outer_step_in_status, 300, message="status.outerStep >= 1")
    assert status["outerStep"] <= syncer.status()["outerStep"]
    assert status.get("lastSyncTime") and status.get("tokens", 0) > 0

    done = wait_until(
        lambda: (st := cluster.status("prog")).get("phase") == "Succeeded" and st,
        300,
        message="Succeeded",
    )
    assert done["outerStep"] == syncer.status()["outerStep"] >= 2
    assert _condition(done, "Succeeded")["status"] == "True" and done.get("finishedTime")
    # Finished: islands scaled to zero, then the job deleted after its TTL (children by GC).
    wait_until(
        lambda: all(s["spec"]["replicas"] == 0 for s in cluster.items("statefulsets")),
        WAIT,
        message="islands scaled to zero",
    )
    wait_until(lambda: not cluster.items("dilocojobs"), WAIT, message="job deleted after TTL")
    wait_until(lambda: not cluster.items("statefulsets"), WAIT, message="children collected")
    learner.wait(timeout=120)
    assert learner.returncode == 0, learner.log_text()[-3000:]


def test_operator_survives_unreachable_syncer(cluster: Cluster, operator: OperatorProcess) -> None:
    cluster.cp.kubectl(
        "create", "secret", "generic", "tok", "-n", cluster.ns, "--from-literal=token=t"
    )
    dead = "http://127.0.0.1:9"  # discard port: nothing answers
    cluster.apply(
        job_manifest(
            "lost", islands={"count": 1}, syncer={"endpoint": dead, "tokenSecretName": "tok"}
        )
    )
    condition = wait_until(
        lambda: (
            (c := _condition(cluster.status("lost"), "SyncerReachable")).get("status") == "False"
            and "127.0.0.1:9" in c.get("message", "")
            and c
        ),
        WAIT,
        message="SyncerReachable=False naming the endpoint",
    )
    assert condition["reason"] == "NotYetReached"
    status = wait_until(
        lambda: (st := cluster.status("lost")).get("islandsSummary") == "1/1" and st,
        WAIT,
        message="island ready",
    )
    assert status["phase"] == "Pending"
    assert operator.alive
    assert "diloco_operator_syncer_unreachable_total" in operator.metrics()


def test_operator_reaches_tls_syncer_with_ca_secret(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest = job_manifest("tls", islands={"count": 1})
    syncer = make_local_syncer(manifest, tls=True)
    assert syncer.url.startswith("https://") and syncer.cert is not None
    cluster.cp.kubectl(
        "create", "secret", "generic", "syncer-ca", "-n", cluster.ns,
        f"--from-file=ca.crt={syncer.cert}",
    )  # fmt: skip
    manifest["spec"]["syncer"] = {
        "endpoint": syncer.url,
        "tokenSecretName": syncer.secret_name,
        "tls": {"caSecretName": "syncer-ca"},
    }
    cluster.apply(manifest)
    wait_until(
        lambda: _condition(cluster.status("tls"), "SyncerReachable").get("status") == "True",
        WAIT,
        message="the HTTPS syncer reached with the CA from the Secret",
    )
    sts = wait_until(
        lambda: cluster.get("statefulset", "tls-island-0"), WAIT, message="island-0's StatefulSet"
    )
    env = {
        e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["DILOCO_SYNCER_URL"] == syncer.url and env["DILOCO_CA_FILE"].endswith("ca.crt")
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["ca"]["secret"]["secretName"] == "syncer-ca"


def test_operator_reaches_tls_syncer_when_ca_secret_comes_after_the_job(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest = job_manifest("late-ca", islands={"count": 1})
    syncer = make_local_syncer(manifest, tls=True)
    manifest["spec"]["syncer"] = {
        "endpoint": syncer.url,
        "tokenSecretName": syncer.secret_name,
        "tls": {"caSecretName": "late-ca"},
    }
    cluster.apply(manifest)
    wait_until(
        lambda: _condition(cluster.status("late-ca"), "SyncerReachable").get("status") == "False",
        WAIT,
        message="the HTTPS syncer unreachable while the CA Secret is missing",
    )
    cluster.cp.kubectl(
        "create", "secret", "generic", "late-ca", "-n", cluster.ns,
        f"--from-file=ca.crt={syncer.cert}",
    )  # fmt: skip
    wait_until(
        lambda: _condition(cluster.status("late-ca"), "SyncerReachable").get("status") == "True",
        WAIT,
        message="the syncer reached once the CA Secret exists (the operator re-reads it)",
    )


async def _refused_pushes(syncer: LocalSyncer, island: str, count: int) -> list[tuple[int, str]]:
    """`count` pushes of `island` (with its own credential) claiming more inner steps than a
    round holds: each a well-formed body the syncer's guards refuse."""
    token = credentials.island_token(syncer.token, island)
    answers = []
    async with SyncerClient(syncer.url, token, retry_deadline=5) as client:
        codec = (await client.join(island, 1)).codec
        pulled = await client.pull_fragment(0, after=-1)
        assert pulled is not None
        body = encode_tensors({n: 1e-3 * t for n, t in pulled.tensors.items()}, codec)
        for _ in range(count):
            meta = PushMeta(island, pulled.version, 1, 10**6, 5.0, 0.01, codec)
            try:
                await client.push_pseudo_gradient(0, body, meta)
                answers.append((200, ""))
            except SyncerError as err:
                answers.append((err.status, err.code))
    return answers


def test_operator_reports_refused_pushes_and_keeps_the_dropped_island_out(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    """A hostile island-1 (healthy pods, its own credential) pushes work the syncer refuses: the
    job gets a ContributionRefused Event naming island, reason code and counts (never the
    syncer's text); after maxRefusals (5) in a row the syncer drops it, the job gets an
    IslandDroppedBySyncer Event, and the operator does not re-add it although its pods are
    Ready (before, it did so on the very pass that saw the drop)."""
    manifest, syncer = _remote_job("bad", make_local_syncer, islands={"count": 2, "replicas": 1})
    cluster.apply(manifest)
    wait_until(
        lambda: (
            (st := cluster.status("bad")).get("islands", {}).get("ready") == 2
            and _condition(st, "SyncerReachable").get("status") == "True"
        ),
        WAIT,
        message="both islands ready and the syncer reached",
    )
    steps = protocol.ERROR_STEPS_RANGE
    assert asyncio.run(_refused_pushes(syncer, "island-1", 1)) == [(422, steps)]
    (event,) = wait_until(lambda: cluster.events("ContributionRefused"), WAIT, message="Event")
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "bad"
    assert event["message"] == (
        "island-1: 1 push refused (steps_out_of_range); 1 since the syncer started"
    )
    assert syncer.status()["refusals"] == {"island-1": {steps: 1}}

    answers = asyncio.run(_refused_pushes(syncer, "island-1", 5))
    assert answers == [(422, steps)] * 4 + [(403, protocol.ERROR_DROPPED)]  # 5 in a row: dropped
    info = syncer.status()["islands"]["island-1"]
    assert info["state"] == "dropped" and info["reason"].startswith("refused_pushes: 5 pushes")
    # Without the fix the operator re-added island-1 on the pass that saw the drop.
    seen = wait_until(
        lambda: cluster.events("IslandDroppedBySyncer") + cluster.events("IslandReadded"),
        WAIT,
        message="IslandDroppedBySyncer",
    )
    assert [e["reason"] for e in seen] == ["IslandDroppedBySyncer"], seen
    assert seen[0]["message"].startswith("island-1: dropped by the syncer")
    # The operator has seen the drop (the Event comes after that pass's membership decision):
    # island-1 is still out, and stays out over the next passes, with its pods Ready.
    assert syncer.island_state("island-1") == "dropped"
    holds_for(lambda: syncer.island_state("island-1") == "dropped", 12.0, message="still out")
    assert not cluster.events("IslandReadded")
    assert cluster.status("bad")["islands"]["ready"] == 2
    # The later refusals: one Event, or several if a poll fell between the pushes; together
    # they count all 5, never quoting the syncer's message.
    events = wait_until(
        lambda: (e := _refusal_counts(cluster)) and e[-1][1] == 5 and e,
        WAIT,
        message="Events of all 5 refusals",
    )
    assert sum(new for new, _ in events) == 5, events
    assert all(
        "one push may carry" not in e["message"] for e in cluster.events("ContributionRefused")
    )
    assert 'diloco_operator_refused_contributions_total{reason="steps_out_of_range"} 5.0' in (
        operator.metrics()
    )


REFUSAL_EVENT = re.compile(
    r"^island-1: (\d+) push(?:es)? refused \(steps_out_of_range\); (\d+) since the syncer started$"
)


def _refusal_counts(cluster: Cluster) -> list[tuple[int, int]]:
    """(new, total) of each ContributionRefused Event, by total; fails on any other message."""
    found = []
    for event in cluster.events("ContributionRefused"):
        match = REFUSAL_EVENT.match(event["message"])
        assert match, event["message"]
        found.append((int(match[1]), int(match[2])))
    return sorted(found, key=lambda c: c[1])


SYNCER_PODS = "diloco.dev/job=cfg,app.kubernetes.io/component=syncer"
CONFIG_HASH = "diloco.dev/config-hash"


def _syncer_pod(cluster: Cluster) -> tuple[str, str] | None:
    """(uid, config hash) of the job's one Ready syncer pod, None while there is not exactly one."""
    pods = cluster.pods_ready(SYNCER_PODS, 1)
    if not pods or len(cluster.items("pods", SYNCER_PODS)) != 1:
        return None
    meta = pods[0]["metadata"]
    return meta["uid"], meta["annotations"][CONFIG_HASH]


def test_operator_restarts_the_syncer_for_a_syncer_side_field_only(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """A changed syncer-side field (sync.graceSeconds) gives the syncer Deployment's pod template
    a new config hash: the syncer pod is replaced, old one first (Recreate: its SIGTERM writes
    the checkpoint the new one resumes from, tests/e2e/test_syncer_restart.py::
    test_syncer_restart_for_a_syncer_side_field_change_loses_no_merge). An island-only change
    (islands.count, re-read by the running syncer) leaves the syncer pod alone."""
    cluster.apply(job_manifest("cfg", islands={"count": 1, "replicas": 1}))
    uid, old_hash = wait_until(lambda: _syncer_pod(cluster), WAIT, message="the syncer pod")
    deployment = cluster.get("deployment", "cfg-syncer")
    assert deployment is not None and deployment["spec"]["strategy"] == {"type": "Recreate"}

    cluster.patch_spec("cfg", {"sync": {"graceSeconds": "0.5"}})
    new_uid, new_hash = wait_until(
        lambda: (pod := _syncer_pod(cluster)) and pod[0] != uid and pod,
        WAIT,
        message="a new syncer pod for the new spec",
    )
    assert new_hash != old_hash
    template = cluster.get("deployment", "cfg-syncer")["spec"]["template"]  # type: ignore[index]
    assert template["metadata"]["annotations"][CONFIG_HASH] == new_hash

    cluster.patch_spec("cfg", {"islands": {"count": 2}})
    wait_until(lambda: cluster.get("statefulset", "cfg-island-1"), WAIT, message="island-1")
    holds_for(lambda: _syncer_pod(cluster) == (new_uid, new_hash), 8.0, message="same syncer")
