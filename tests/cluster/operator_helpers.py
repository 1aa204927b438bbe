"""What the operator's cluster tests build on (their fixtures live in conftest.py).

The operator runs as a real process, `diloco operator --standalone --namespace NS`, against the
local control plane; a real `diloco syncer` runs on loopback when a test needs one (kwok pods
have no containers, so the job points at it with spec.syncer.endpoint). Every process started
here is killed, with its whole process group, by its owner (a fixture's teardown).
"""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_trainer.api.spec import parse_spec
from diloco_trainer.local import (
    JobFiles,
    Proc,
    free_port,
    start_learner,
    start_syncer,
    wait_ready,
    write_job_files,
)

from hack.localcluster import harness
from hack.localcluster.harness import TINY_TRAINING, ControlPlane, deep_merge


def job_manifest(name: str, **spec: Any) -> dict[str, Any]:
    """A DiLoCoJob manifest: image + tiny training settings, with `spec` sections merged in."""
    body = deep_merge({"image": "diloco-trainer:test", **TINY_TRAINING}, spec)
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": name},
        "spec": body,
    }


# ------------------------------------------------------------------------------ queries


class Cluster:
    """Small query helpers over kubectl for one namespace."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        self.cp = cp
        self.ns = namespace

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        result = self.cp.kubectl("get", kind, name, "-n", self.ns, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        return json.loads(result.stdout)

    def items(self, kind: str, selector: str = "") -> list[dict[str, Any]]:
        args = ["get", kind, "-n", self.ns, "-o", "json"]
        if selector:
            args += ["-l", selector]
        return json.loads(self.cp.kubectl(*args).stdout)["items"]

    def names(self, kind: str, selector: str = "") -> set[str]:
        return {o["metadata"]["name"] for o in self.items(kind, selector)}

    def job(self, name: str) -> dict[str, Any]:
        job = self.get("dilocojob", name)
        assert job is not None, f"DiLoCoJob {name} is gone"
        return job

    def status(self, name: str) -> dict[str, Any]:
        return self.job(name).get("status") or {}

    def apply(self, manifest: dict[str, Any]) -> str:
        return self.cp.apply(manifest, namespace=self.ns)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.cp.kubectl(
            "patch", "dilocojob", name, "-n", self.ns, "--type=merge", "-p",
            json.dumps({"spec": spec}),
        )  # fmt: skip

    def set_pod_ready(self, pod: str, ready: bool) -> None:
        """Flip a pod's Ready condition through the status subresource (kwok leaves it)."""
        patch = json.dumps(harness.ready_patch(ready))
        self.cp.kubectl("patch", "pod", pod, "-n", self.ns, "--subresource=status", "-p", patch)

    def pods_ready(self, selector: str, count: int) -> list[dict[str, Any]] | None:
        """The Ready pods matching selector if there are exactly `count` of them, else None."""
        pods = harness.ready_pods(self.items("pods", selector))
        return pods if len(pods) == count else None

    def pod_uids(self, selector: str = "diloco.dev/job") -> dict[str, str]:
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in self.items("pods", selector)}

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.items("events") if e.get("reason") == reason]


# ------------------------------------------------------------------------------ operator process


@dataclass
class OperatorProcess(harness.OperatorProcess):
    """`diloco operator --standalone --namespace NAMESPACE` (unless `args` says otherwise) as a
    subprocess in its own process group; start() fails the test if it exits or never serves
    its liveness endpoint."""

    namespace: str = ""

    def __post_init__(self) -> None:
        if not self.args:
            self.args = harness.standalone_operator_args([self.namespace])


# ------------------------------------------------------------------------------ local syncer


@dataclass
class LocalSyncer:
    """A real `diloco syncer` on loopback, its token stored in a Secret of the namespace."""

    proc: Proc
    url: str
    token: str
    secret_name: str
    files: JobFiles
    workdir: Path
    job_name: str
    cert: Path | None = None
    learners: list[Proc] = field(default_factory=list)

    def start_learner(self, island: str, island_index: int) -> Proc:
        """A real `diloco learner` (one rank) of `island`, pushing to this syncer."""
        proc = start_learner(
            self.files,
            syncer_url=self.url,
            island=island,
            island_index=island_index,
            log_file=self.workdir / f"{island}.log",
            master_port=free_port(),
            job_name=self.job_name,
            extra_env={"OMP_NUM_THREADS": "1"},
        )
        self.learners.append(proc)
        return proc

    def stop(self) -> None:
        for proc in [*self.learners, self.proc]:
            proc.stop()

    def status(self) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + "/v1/status", headers={"Authorization": f"Bearer {self.token}"}
        )
        ctx = ssl.create_default_context(cafile=str(self.cert)) if self.cert else None
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return json.loads(resp.read())

    def island_state(self, island: str) -> str | None:
        return ((self.status().get("islands") or {}).get(island) or {}).get("state")


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is its own CA): (cert, key) paths."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "tls.crt", directory / "tls.key"
    argv = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=127.0.0.1",
    ]
    argv += ["-keyout", str(key), "-out", str(cert), "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(argv, check=True, capture_output=True)
    return cert, key


def start_local_syncer(manifest: dict[str, Any], workdir: Path, tls: bool = False) -> LocalSyncer:
    """A real `diloco syncer` on loopback serving `manifest`'s spec (a random token); with
    tls=True over HTTPS with a self-signed certificate (`cert`). The job points at it with
    `syncer: {endpoint: .url, tokenSecretName: .secret_name}` once `.token` is stored under
    that name; the caller stops it."""
    spec = parse_spec({k: v for k, v in manifest["spec"].items() if k != "syncer"})
    name = manifest["metadata"]["name"]
    files = write_job_files(spec, workdir)
    cert = key = None
    if tls:
        cert, key = self_signed_certificate(workdir)
    port = free_port()
    proc = start_syncer(
        files,
        port=port,
        state_dir=workdir / "state",
        job_name=name,
        log_file=workdir / "syncer.log",
        tls_cert_file=cert,
        tls_key_file=key,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        wait_ready(url, files.token, timeout=120, proc=proc, ca_file=cert)
    except BaseException:
        proc.stop()
        raise
    return LocalSyncer(
        proc=proc,
        url=url,
        token=files.token,
        secret_name=f"{name}-shared-token",
        files=files,
        workdir=workdir,
        job_name=name,
        cert=cert,
    )


def create_token_secret(cp: ControlPlane, namespace: str, name: str, token: str) -> None:
    """`kubectl create secret generic NAME --from-literal=token=...` (key contract.TOKEN_KEY)."""
    cp.kubectl(
        "create", "secret", "generic", name, "-n", namespace, f"--from-literal=token={token}"
    )
