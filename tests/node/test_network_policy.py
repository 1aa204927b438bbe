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
import re
import subprocess
from collections.abc import Iterator

import pytest

from hack.localcluster import harness
from hack.localcluster.harness import ControlPlane, poll_until
from hack.localcluster.netpolicy import NAME as ENFORCER
from hack.localcluster.netpolicy import NFQUEUE_ID, TABLE

from .job_fixtures import Release, chart_release, syncer_status
from .probes import (
    NC_TIMEOUT,
    QUICKLY,
    WAIT,
    GuardedJob,
    Probe,
    one_island_job,
    probe_pod,
)

JOB = "guarded"


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
) -> Iterator[GuardedJob]:
    ns = node_cluster.create_namespace("netpol-job")
    node_cluster.apply(one_island_job(JOB, node_images["trainer"]), ns)
    yield GuardedJob(node_cluster, ns, JOB)
    node_cluster.delete_namespace(ns)


@pytest.fixture(scope="module")
def outsiders(
    node_cluster: ControlPlane, busybox_image: str, job: GuardedJob
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
    log sits beside the node's, `local-cluster status` lists it."""
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
    # One of the node's components (settings.NODE_COMPONENTS): `status` lists it as running.
    status = harness.run_local_cluster("status", "--dir", str(node_cluster.dir))
    assert re.search(rf"^\s*{ENFORCER}\s+pid \d+\s+running$", status.stdout, re.M), status.stdout


def test_network_policy_outsiders_cannot_connect_while_the_job_trains(
    job: GuardedJob, outsiders: dict[str, Probe]
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
    job: GuardedJob, release: Release
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
    job: GuardedJob, outsiders: dict[str, Probe]
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
