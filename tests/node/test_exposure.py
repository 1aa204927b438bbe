"""A syncer exposed as a NodePort behind TLS, reached as documented (issue 26).

examples/multi-region/README.md exposes region A's syncer with `syncer.service.type`
LoadBalancer (NodePort is the same rule: both need `syncer.tls.secretName`), a self-signed
certificate that names every address clients dial (the address other regions use and the
in-cluster Service name) in a `kubernetes.io/tls` Secret that also holds `ca.crt`, and checks
it from outside with `curl --cacert tls.crt -H "Authorization: Bearer $TOKEN" .../v1/status`.
The README's Security section says the job's NetworkPolicy then lets anyone reach the syncer
port (TLS and the credentials are the protection) and nothing else.

Here the same job (1 island x 2 DDP ranks of gpt-tiny on CPU, under the chart's operator) gets
a NodePort and a certificate for the real node's IP and the Service name, and:

- from this host, outside the pod network as an off-cluster learner is, HTTPS to the node's
  IP and the NodePort with the job's CA and token is served (/v1/status), without a token is
  refused with 401, and plain HTTP or another CA gets no answer at all; meanwhile the job's
  own learners push through the Service over TLS and the operator reads the syncer;
- a busybox pod of another namespace (no label of the job) connects to the NodePort and the
  syncer's pod port, as the policy's open rule allows, but not to the island's DDP port.

The tests run in file order and share one release and one job (module fixtures).
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hack.localcluster.harness import ControlPlane
from hack.localcluster.settings import NODE_NAME

from .job_fixtures import SYNCER_PORT, Release, chart_release
from .probes import QUICKLY, GuardedJob, Probe, one_island_job, start_probe

JOB = "exposed"
TLS_SECRET = f"{JOB}-tls"


@dataclass
class Exposed:
    """The exposed job and what an off-cluster client of it holds."""

    job: GuardedJob
    node_ip: str
    ca: Path  # the job's certificate, its own CA (ca.crt of the Secret)
    other_ca: Path  # a certificate for the same names that the syncer does not hold
    token: str

    def node_port(self) -> int:
        service = self.job.cp.kubectl_json("get", "svc", f"{JOB}-syncer", "-n", self.job.ns)
        assert service["spec"]["type"] == "NodePort", service["spec"]
        (port,) = [p["nodePort"] for p in service["spec"]["ports"] if p["port"] == SYNCER_PORT]
        return int(port)

    def url(self, scheme: str) -> str:
        return f"{scheme}://{self.node_ip}:{self.node_port()}/v1/status"

    def get(self, url: str, ca: Path | None, token: str | None) -> tuple[int, bytes]:
        """(HTTP status, body) of GET url; urllib's errors other than HTTPError propagate."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        context = ssl.create_default_context(cafile=str(ca)) if ca else None
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


def node_ip(cp: ControlPlane) -> str:
    node = cp.kubectl_json("get", "node", NODE_NAME)
    (ip,) = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
    return str(ip)


def self_signed(directory: Path, names: list[str]) -> tuple[Path, Path]:
    """(certificate, key): a self-signed certificate for `names` (subjectAltName entries), made
    as the multi-region walk-through makes it."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-keyout", str(key), "-out", str(cert),
            "-subj", "/CN=diloco-syncer", "-addext", "subjectAltName=" + ",".join(names),
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def exposed_job(name: str, image: str) -> dict[str, Any]:
    job = one_island_job(name, image)
    job["spec"]["syncer"]["service"] = {"type": "NodePort"}
    job["spec"]["syncer"]["tls"] = {"secretName": TLS_SECRET}
    return job


@pytest.fixture(scope="module")
def release(
    node_cluster: ControlPlane,
    node_images: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Release]:
    operator = node_images["operator"]
    with chart_release(node_cluster, operator, tmp_path_factory, "exposure-operator") as rel:
        yield rel


@pytest.fixture(scope="module")
def exposed(
    node_cluster: ControlPlane,
    node_images: dict[str, str],
    release: Release,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Exposed]:
    """The job with its TLS Secret (created first, as the walk-through says: the operator reads
    the CA when it first contacts the syncer)."""
    cp = node_cluster
    ns = cp.create_namespace("exposure-job")
    ip = node_ip(cp)
    names = [f"IP:{ip}", f"DNS:{JOB}-syncer.{ns}.svc"]
    work = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(work / "job", names)
    other, _ = self_signed(work / "other", names)
    cp.kubectl(
        "create", "secret", "generic", TLS_SECRET, "-n", ns, "--type=kubernetes.io/tls",
        f"--from-file=tls.crt={cert}", f"--from-file=tls.key={key}", f"--from-file=ca.crt={cert}",
    )  # fmt: skip
    cp.apply(exposed_job(JOB, node_images["trainer"]), ns)
    job = GuardedJob(cp, ns, JOB)
    job.wait_targets()
    secret = cp.kubectl_json("get", "secret", f"{JOB}-token", "-n", ns)
    token = base64.b64decode(secret["data"]["token"]).decode().strip()
    yield Exposed(job, ip, cert, other, token)
    cp.delete_namespace(ns)


def test_exposure_nodeport_serves_https_with_the_jobs_ca_to_an_off_cluster_client(
    exposed: Exposed,
) -> None:
    # The job's own learners push to https://exposed-syncer.NS.svc with the CA from the Secret,
    # and the operator reads the syncer the same way: its status moves.
    step = exposed.job.wait_steps(1, "over TLS")
    code, body = exposed.get(exposed.url("https"), exposed.ca, exposed.token)
    assert code == 200, body[:300]
    status = json.loads(body)
    assert status["outerStep"] >= step and "island-0" in status["islands"], status
    code, body = exposed.get(exposed.url("https"), exposed.ca, None)
    assert code == 401, (code, body[:300])


def test_exposure_plain_http_and_another_ca_get_no_answer(exposed: Exposed) -> None:
    # The TLS port sees a plain request as a failed handshake and closes the connection: no
    # status line at all (get() returns any answer, an HTTP error included).
    with pytest.raises((http.client.HTTPException, OSError)):
        exposed.get(exposed.url("http"), None, exposed.token)
    with pytest.raises(urllib.error.URLError) as other:
        exposed.get(exposed.url("https"), exposed.other_ca, exposed.token)
    assert isinstance(other.value.reason, ssl.SSLCertVerificationError), other.value


def test_exposure_outsider_pod_reaches_the_syncer_port_and_not_the_ddp_port(
    exposed: Exposed, busybox_image: str
) -> None:
    job = exposed.job
    cp = job.cp
    policy = cp.kubectl_json("get", "networkpolicy", f"{JOB}-network", "-n", job.ns)
    open_rules = [r for r in policy["spec"]["ingress"] if "from" not in r]
    assert open_rules == [{"ports": [{"protocol": "TCP", "port": SYNCER_PORT}]}], policy["spec"]
    other = cp.create_namespace("exposure-outside")
    try:
        probe: Probe = start_probe(cp, other, "prober", busybox_image)
        targets = job.wait_targets()
        reachable = {
            "the NodePort": (exposed.node_ip, exposed.node_port()),
            "the syncer pod's port": targets["syncer pod"],
        }
        for what, (ip, port) in reachable.items():
            connected, _, message = probe.connect(ip, port)
            assert connected, f"a pod of another namespace did not reach {what}: {message}"
        ip, port = targets["island DDP port"]
        connected, seconds, message = probe.connect(ip, port)
        assert not connected, f"a pod of another namespace reached the DDP port {ip}:{port}"
        assert seconds < QUICKLY, f"the DDP probe took {seconds:.1f}s"
        # Dropped by the enforcer (not refused: rank 0's store listens on that port).
        assert "timed out" in message, message
    finally:
        cp.delete_namespace(other)
