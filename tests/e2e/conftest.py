"""Shared fixtures for the process-level tests: tiny job specs, real syncer processes, HTTP helpers.

Everything is real: `diloco syncer` runs as its own process (via launch.py) on loopback, and the
helpers speak plain HTTP to it. Every process a fixture starts is killed (whole process group) in
teardown.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.learner import syncer_client
from diloco_trainer.local import launch

from bench.healthz_flood import make_certificate
from hack.localcluster.harness import deep_merge
from hack.localcluster.ports import pick_ports

# A job that trains in seconds on one CPU core: gpt-tiny, short sequences, few inner steps.
TINY_SPEC: dict[str, Any] = {
    "model": {"preset": "gpt-tiny", "seed": 0},
    "data": {"evalTokens": 2048},
    "islands": {"count": 2},
    "inner": {"steps": 4, "batchSize": 2, "seqLen": 32, "lr": 1e-3},
    "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    # fp32 on the wire ("none", not the int8 default): several tests push hand-made fp32 bodies;
    # tests of the codecs and of the job's defaults set their own.
    "sync": {
        "quorum": 1,
        "graceSeconds": 0.2,
        "heartbeatTimeoutSeconds": 10,
        "compression": "none",
    },
    "stopAfter": {"outerSteps": 3},
    "syncer": {"checkpoint": {"everyOuterSteps": 1, "keep": 2}},
}


def restart_safe_port() -> int:
    """A free loopback port outside the kernel's ephemeral range, for a server a test stops and
    starts again on the same port (hack/localcluster/ports.py). A port the kernel handed out
    (bind to 0) is in that range, where any outgoing connection may take it while the server is
    down: on a loaded machine one did, between a syncer's stop and its restart."""
    return pick_ports(1, set())[0]


@pytest.fixture
def make_spec() -> Callable[..., JobSpec]:
    """make_spec(sync={"quorum": 2}, stopAfter={"outerSteps": 5}, ...) -> a tiny JobSpec.

    Keyword arguments are spec sections in manifest (camelCase) form, merged into TINY_SPEC.
    """

    def make(**overrides: Any) -> JobSpec:
        return parse_spec(deep_merge(TINY_SPEC, overrides))

    return make


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A fresh directory for one test's files, logs and state."""
    return tmp_path


@dataclass
class SyncerHandle:
    """A running `diloco syncer` process and how to reach it."""

    proc: launch.Proc
    url: str
    token: str
    port: int
    files: launch.JobFiles
    state_dir: Path
    log_file: Path
    ca_file: Path | None = None

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        body: bytes | None = None,
        token: str | None = "",
        timeout: float = 30.0,
    ) -> tuple[int, Any]:
        """Plain HTTP to the syncer; token "" means the right one, None means none at all."""
        return http_request(
            method,
            self.url + path,
            token=self.token if token == "" else token,
            json_body=json_body,
            body=body,
            timeout=timeout,
            ca_file=self.ca_file,
        )

    def status(self, digest: bool = False) -> dict[str, Any]:
        code, doc = self.request("GET", "/v1/status" + ("?digest=1" if digest else ""))
        assert code == 200, (code, doc)
        return doc

    def client(self, **kwargs: Any) -> syncer_client.SyncerClient:
        """A SyncerClient for this syncer; create, use and close it inside one event loop:
        ``async with handle.client() as c: ...``."""
        return syncer_client.SyncerClient(self.url, self.token, ca_file=self.ca_file, **kwargs)

    def log_text(self) -> str:
        return self.proc.log_text()

    def merge_records(self, timeout: float = 30) -> list[dict[str, Any]]:
        """Every merge in state_dir/merges.jsonl, once it holds as many as the status counts:
        the syncer closes a round (version + 1) under its lock and writes the entry after it,
        off the loop, so a status read can see a version whose line is not written yet (CI read
        the previous merge's line as the last)."""
        path = self.state_dir / "merges.jsonl"

        def written() -> list[dict[str, Any]] | None:
            count = self.status()["mergeCount"]
            lines = path.read_text().splitlines() if path.exists() else []
            return [json.loads(x) for x in lines] if len(lines) >= count else None

        records: list[dict[str, Any]] = wait_until(
            written, timeout=timeout, what="merges.jsonl to hold every merge counted"
        )
        return records


def http_request(
    method: str,
    url: str,
    *,
    token: str | None,
    json_body: Any = None,
    body: bytes | None = None,
    timeout: float = 30.0,
    ca_file: Path | None = None,
) -> tuple[int, Any]:
    """(status, parsed JSON or raw bytes) for one HTTP request; never raises on 4xx/5xx."""
    headers = {}
    data = body
    if json_body is not None:
        data = json.dumps(json_body).encode()
        headers["Content-Type"] = "application/json"
    elif body is not None:
        headers["Content-Type"] = "application/octet-stream"
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            code, raw = resp.status, resp.read()
            ctype = resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        code, raw = err.code, err.read()
        ctype = err.headers.get("Content-Type", "") if err.headers else ""
    if "json" in ctype:
        return code, json.loads(raw)
    return code, raw


def run_to_end(proc: subprocess.Popen[bytes], timeout: float = 600) -> int:
    """A `diloco run` started in its own session (start_new_session): its exit code once it
    ends within `timeout`; on a timeout (or any error) its whole group is interrupted, as a
    user's Ctrl-C would, so no syncer or learner outlives the test."""
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=30)


def wait_until(
    condition: Callable[[], Any], *, timeout: float, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll `condition` until it returns something truthy (returned) or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


@dataclass(frozen=True)
class TLSFiles:
    """A self-signed certificate for 127.0.0.1 (it is its own CA) and its key."""

    cert: Path
    key: Path


@pytest.fixture
def tls_files(workdir: Path) -> TLSFiles:
    """A fresh self-signed certificate valid for IP 127.0.0.1 (made with the openssl CLI)."""
    cert, key = make_certificate(workdir)
    return TLSFiles(cert=cert, key=key)


@pytest.fixture
def syncer_proc(workdir: Path) -> Iterator[Callable[..., SyncerHandle]]:
    """Factory: start(spec, *, state_dir=None, token=None, port=None, job_name="test",
    ready_timeout=90, extra_env=None, tls=None) -> SyncerHandle, ready to serve. Every syncer
    started is stopped (SIGTERM, then SIGKILL of its process group) at teardown.

    Restarting on the same state_dir (after handle.proc.kill()) resumes from its checkpoints; pass
    token=handle.token (and port=handle.port to come back on the same address: the default port
    is a restart_safe_port, outside the ephemeral range, so it is still free then). With
    tls=TLSFiles the syncer serves HTTPS and handle.ca_file verifies it.
    """
    started: list[launch.Proc] = []
    count = 0

    def start(
        spec: JobSpec,
        *,
        state_dir: Path | None = None,
        token: str | None = None,
        port: int | None = None,
        job_name: str = "test",
        ready_timeout: float = 90.0,
        extra_env: dict[str, str] | None = None,
        tls: TLSFiles | None = None,
    ) -> SyncerHandle:
        nonlocal count
        count += 1
        files = launch.write_job_files(spec, workdir / f"job-{count}", token=token)
        port = port or restart_safe_port()
        state_dir = state_dir or workdir / "syncer-state"
        log_file = workdir / f"syncer-{count}.log"
        env = {"OMP_NUM_THREADS": "1", **(extra_env or {})}
        proc = launch.start_syncer(
            files,
            port=port,
            state_dir=state_dir,
            job_name=job_name,
            log_file=log_file,
            extra_env=env,
            tls_cert_file=tls.cert if tls else None,
            tls_key_file=tls.key if tls else None,
        )
        started.append(proc)
        ca_file = tls.cert if tls else None
        url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        launch.wait_ready(url, files.token, timeout=ready_timeout, proc=proc, ca_file=ca_file)
        return SyncerHandle(
            proc=proc,
            url=url,
            token=files.token,
            port=port,
            files=files,
            state_dir=state_dir,
            log_file=log_file,
            ca_file=ca_file,
        )

    yield start
    for proc in started:
        proc.stop(timeout=5)
