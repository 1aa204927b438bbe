"""The job's NetworkPolicy enforced on the real node (issue 26).

The real node runs kube-network-policies beside the kubelet (hack/localcluster/netpolicy.py),
so the NetworkPolicy the operator keeps beside a job is enforced here, not merely stored. A
small job (1 island x 2 DDP ranks of gpt-tiny on CPU) trains in real pods under the chart's
operator, and busybox pods probe it with `nc`:

- a pod in another namespace and a pod in the job's namespace without the job's labels cannot
  open a connection to the syncer's port or the island's DDP port (each probe gives up after
  NC_TIMEOUT seconds), while the job's own learners keep pushing and the syncer merging;
- the operator's pod, as the chart installs it, still reaches the syncer;
- with `networkPolicy.enabled: false` on the job the operator deletes the policy, and the same
  outside pod connects: the refusals above are the policy's doing, not a probe that never works.

The tests run in file order and share one release and one job (module fixtures).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from diloco_trainer.api.contract import DEFAULT_MASTER_PORT

from hack.localcluster.harness import ControlPlane, poll_until
from hack.localcluster.netpolicy import NAME as ENFORCER
from hack.localcluster.netpolicy import NFQUEUE_ID, TABLE

from .job_fixtures import (
    NODE_SELECTOR,
    SYNCER_PORT,
    TOLERATION,
    Release,
    chart_release,
    job_status,
    syncer_pod,
    syncer_status,
    tiny_job,
)

JOB = "guarded"
OUTER_STEPS = 10_000  # never reached: the module deletes the job when it is done
WAIT = float(os.environ.get("DILOCO_NODE_JOB_WAIT", "300"))  # seconds; waits end once they hold
NC_TIMEOUT = 3  # seconds nc waits for a connection; a dropped SYN fails after this
# A refused probe must fail fast: nc's own timeout plus `kubectl exec`'s round trip.
QUICKLY = 15.0


@dataclass
class Probe:
    """One busybox pod that tries TCP connections from where it runs."""

    cp: ControlPlane
    ns: str
    name: str

    def connect(self, ip: str, port: int) -> tuple[bool, float, str]:
        """(connected, seconds, nc's message): `nc -w NC_TIMEOUT ip port` inside the pod,
        stdin empty, so a connection that opens closes at once with exit 0."""
        start = time.monotonic()
        result = self.cp.kubectl(
            "exec", "-n", self.ns, self.name, "--",
            "nc", "-w", str(NC_TIMEOUT), ip, str(port), check=False,
        )  # fmt: skip
        return result.returncode == 0, time.monotonic() - start, result.stderr.strip()


@dataclass
class JobRun:
    cp: ControlPlane
    ns: str
    name: str

    def outer_step(self) -> int:
        return int(job_status(self.cp, self.ns, self.name).get("outerStep") or 0)

    def targets(self) -> dict[str, tuple[str, int]] | None:
        """What an outsider must not reach: the syncer's port on its pod and its Service, and
        the DDP port (torch's rendezvous store) on the island's rank-0 pod; None until the
        syncer pod is Ready and the rank-0 pod runs."""
        syncer = syncer_pod(self.cp, self.ns, self.name)
        rank0 = self.cp.kubectl(
            "get", "pod", f"{self.name}-island-0-0", "-n", self.ns, "-o", "json", check=False
        )
        if syncer is None or rank0.returncode != 0:
            return None
        rank0_status = json.loads(rank0.stdout)["status"]
        if rank0_status.get("phase") != "Running" or not rank0_status.get("podIP"):
            return None
        service = self.cp.kubectl_json("get", "svc", f"{self.name}-syncer", "-n", self.ns)
        return {
            "syncer pod": (syncer["status"]["podIP"], SYNCER_PORT),
            "syncer Service": (service["spec"]["clusterIP"], SYNCER_PORT),
            "island DDP port": (rank0_status["podIP"], DEFAULT_MASTER_PORT),
        }

    def wait_targets(self) -> dict[str, tuple[str, int]]:
        return poll_until(self.targets, timeout=WAIT, what="the job's syncer and rank-0 pods")

    def wait_steps(self, steps: int, what: str) -> int:
        """Wait until the job's status (the operator's read of the syncer) is `steps` outer
        steps further; the step reached. On a timeout, fail with the pods, the job's status,
        rank 0's log and the enforcer's drops (what the policy refused)."""
        start = self.outer_step()
        try:
            return poll_until(
                lambda: (s := self.outer_step()) >= start + steps and s,
                timeout=WAIT,
                what=f"{steps} more outer steps {what} (from {start})",
            )
        except TimeoutError as e:
            cp, pod = self.cp, f"{self.name}-island-0-0"
            pods = cp.kubectl("get", "pods", "-n", self.ns, "-o", "wide", check=False).stdout
            log = cp.kubectl("logs", pod, "-n", self.ns, "--tail=15", check=False).stdout
            enforcer = (cp.logs_dir / f"{ENFORCER}.log").read_text(errors="replace")
            drops = [line for line in enforcer.splitlines() if "not allowed" in line][-5:]
            status = job_status(cp, self.ns, self.name)
            raise AssertionError(
                f"{e}\n{pods}\nstatus: {status}\n{pod} log:\n{log}\nenforcer drops:\n"
                + "\n".join(drops)
            ) from e


def probe_pod(name: str, image: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A busybox pod on the real node that sleeps until the test execs nc in it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": "prober"}},
        "spec": {
            "nodeSelector": NODE_SELECTOR,
            "tolerations": [TOLERATION],
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "100000"],
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                }
            ],
        },
    }


def small_job(image: str) -> dict[str, Any]:
    """The node tier's tiny job, cut to one island of two DDP ranks (a DDP port to probe, and
    the least CPU that has one) and checkpoints in an emptyDir (no volume to provide)."""
    job = tiny_job(JOB, image, claim="unused", outer_steps=OUTER_STEPS)
    spec = job["spec"]
    spec["islands"]["count"] = 1
    spec["sync"]["quorum"] = 1
    spec["syncer"].pop("checkpoint")
    return job


@pytest.fixture(scope="module")
def release(
    node_cluster: ControlPlane,
    node_images: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Release]:
    """The chart's operator (networkPolicy.enabled: true, the chart's default) as a pod."""
    operator = node_images["operator"]
    with chart_release(node_cluster, operator, tmp_path_factory, "netpol-operator") as rel:
        yield rel


@pytest.fixture(scope="module")
def job(
    node_cluster: ControlPlane, node_images: dict[str, str], release: Release
) -> Iterator[JobRun]:
    ns = node_cluster.create_namespace("netpol-job")
    node_cluster.apply(small_job(node_images["trainer"]), ns)
    yield JobRun(node_cluster, ns, JOB)
    node_cluster.delete_namespace(ns)


@pytest.fixture(scope="module")
def outsiders(
    node_cluster: ControlPlane, busybox_image: str, job: JobRun
) -> Iterator[dict[str, Probe]]:
    """A prober in a namespace of its own, and a stranger in the job's namespace (labels that
    are not the job's)."""
    other = node_cluster.create_namespace("netpol-outside")
    probes = {
        "pod in another namespace": Probe(node_cluster, other, "prober"),
        "pod in the job's namespace": Probe(node_cluster, job.ns, "stranger"),
    }
    for probe in probes.values():
        node_cluster.apply(probe_pod(probe.name, busybox_image), probe.ns)
    for probe in probes.values():
        node_cluster.kubectl(
            "wait", "--for=condition=Ready", f"pod/{probe.name}", "-n", probe.ns, "--timeout=180s"
        )
    yield probes
    node_cluster.delete_namespace(other)


def test_network_policy_enforcer_runs_beside_the_node(node_cluster: ControlPlane) -> None:
    """`up --real-node` started kube-network-policies: its table queues to its nfqueue, its
    log sits beside the node's."""
    try:
        listing = subprocess.run(
            ["nft", "list", "table", *TABLE], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        pytest.fail("the node tier needs `nft`: `make node` installs it (Debian's nftables)")
    assert listing.returncode == 0, listing.stderr
    assert f"queue num {NFQUEUE_ID}" in listing.stdout, listing.stdout
    log = node_cluster.logs_dir / f"{ENFORCER}.log"
    assert log.is_file() and "Syncing nftables rules" in log.read_text(errors="replace")


def test_network_policy_outsiders_cannot_connect_while_the_job_trains(
    job: JobRun, outsiders: dict[str, Probe]
) -> None:
    cp = job.cp
    targets = job.wait_targets()
    policy = cp.kubectl_json("get", "networkpolicy", f"{JOB}-network", "-n", job.ns)
    assert policy["spec"]["podSelector"]["matchLabels"] == {"diloco.dev/job": JOB}
    for who, probe in outsiders.items():
        for what, (ip, port) in targets.items():
            connected, seconds, message = probe.connect(ip, port)
            assert not connected, f"the {who} reached the {what} ({ip}:{port})"
            assert seconds < QUICKLY, f"the {who}'s probe of the {what} took {seconds:.1f}s"
            assert "timed out" in message or "refused" in message, message
    # Meanwhile the job's own pods talk through the same rules: the island's two ranks train
    # (DDP: the rendezvous port and gloo's pair connections on ports of its choosing) and push,
    # the syncer merges, the operator reads its status.
    job.wait_steps(2, "while outsiders are refused")
    status = syncer_status(cp, job.ns, job.name)
    assert status is not None and status["islands"]["island-0"]["replicas"] == 2


def test_network_policy_lets_the_chart_operator_reach_the_syncer(
    job: JobRun, release: Release
) -> None:
    """From the operator's own pod (the chart's labels, its namespace) to the syncer's pod."""
    cp = job.cp
    (pod,) = cp.kubectl_json("get", "pods", "-n", release.namespace, "-l", release.selector)[
        "items"
    ]
    ip, port = job.wait_targets()["syncer pod"]
    code = (
        "import socket, sys; "
        f"socket.create_connection(({ip!r}, {port}), timeout={NC_TIMEOUT}).close()"
    )
    result = cp.kubectl(
        "exec", "-n", release.namespace, pod["metadata"]["name"], "--", "python", "-c", code,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    job.wait_steps(1, "read by the operator through the policy")


def test_network_policy_disabled_on_the_job_lets_the_same_outsider_connect(
    job: JobRun, outsiders: dict[str, Probe]
) -> None:
    cp = job.cp
    cp.kubectl(
        "patch", "dj", JOB, "-n", job.ns, "--type=merge",
        "-p", '{"spec": {"networkPolicy": {"enabled": false}}}',
    )  # fmt: skip
    poll_until(
        lambda: (
            cp.kubectl(
                "get", "networkpolicy", f"{JOB}-network", "-n", job.ns, check=False
            ).returncode
            != 0
        ),
        timeout=WAIT,
        what="the operator deleting the job's NetworkPolicy",
    )
    probe = outsiders["pod in another namespace"]

    def reaches(what: str) -> bool:
        ip, port = job.wait_targets()[what]
        return probe.connect(ip, port)[0]

    for what in ("syncer pod", "island DDP port"):
        poll_until(
            functools.partial(reaches, what),
            timeout=60,
            what=f"the outsider reaching the {what}",
        )
