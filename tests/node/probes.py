"""What the node tier's NetworkPolicy and exposure tests share: busybox probe pods that try TCP
connections with `nc`, a job of one island of two DDP ranks, and what an outsider would aim at
in it (its syncer's pod and Service, its rank-0 pod's DDP port).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from diloco_trainer.api.contract import DEFAULT_MASTER_PORT

from hack.localcluster.harness import ControlPlane, poll_until
from hack.localcluster.netpolicy import NAME as ENFORCER

from .job_fixtures import NODE_SELECTOR, SYNCER_PORT, TOLERATION, job_status, syncer_pod, tiny_job

OUTER_STEPS = 10_000  # never reached: the tests delete the job when they are done
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


def start_probe(cp: ControlPlane, ns: str, name: str, image: str) -> Probe:
    """probe_pod `name` in `ns`, Ready."""
    cp.apply(probe_pod(name, image), ns)
    cp.kubectl("wait", "--for=condition=Ready", f"pod/{name}", "-n", ns, "--timeout=180s")
    return Probe(cp, ns, name)


def one_island_job(name: str, image: str) -> dict[str, Any]:
    """The node tier's tiny job, cut to one island of two DDP ranks (a DDP port to probe, and
    the least CPU that has one) and checkpoints in an emptyDir (no volume to provide)."""
    job = tiny_job(name, image, claim="unused", outer_steps=OUTER_STEPS)
    spec = job["spec"]
    spec["islands"]["count"] = 1
    spec["sync"]["quorum"] = 1
    spec["syncer"].pop("checkpoint")
    return job


@dataclass
class GuardedJob:
    """A running job of one_island_job's shape, as the policy tests see it."""

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
