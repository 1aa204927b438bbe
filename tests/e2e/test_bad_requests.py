"""Bad requests against a real syncer process: each gets the right 4xx with a clear message, and
the syncer's state (weights + momentum digest, versions, pending rounds, islands) is unchanged."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.api.documents import JoinInfo
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.learner import syncer_client
from diloco_trainer.local import launch

from .conftest import (
    TINY_SPEC,
    SyncerHandle,
    TLSFiles,
    deep_merge,
    http_request,
    wait_until,
)

pytestmark = pytest.mark.e2e

# The heartbeat timeout outlasts the module: island-0 never heartbeats after the set-up, and with
# TINY_SPEC's 10 s the syncer would time it out part-way through (a loaded machine takes that
# long), changing `islands` under some test's `unchanged` and its pushes' answers.
SAFE_HEARTBEAT = {"heartbeatTimeoutSeconds": 3600}
SPEC = deep_merge(
    TINY_SPEC,
    {
        "sync": {
            "fragments": 2,
            "maxStaleness": 1,
            "quorum": 1,
            "graceSeconds": 0.1,
            **SAFE_HEARTBEAT,
        },
        "stopAfter": {"outerSteps": 1000},
    },
)


def push_body(tensors: dict[str, torch.Tensor], **meta: Any) -> bytes:
    base = {
        "island": "island-0",
        "baseVersion": 2,
        "tokens": 128,
        "steps": 4,
        "loss": 5.0,
        "stepTime": 0.01,
        "codec": "none",
    }
    return payloads.encode_body(tensors, {**base, **meta})


async def _advance(url: str, token: str) -> dict[int, dict[str, torch.Tensor]]:
    """Join island-0 and merge two rounds of each fragment: versions [2, 2]."""
    shapes: dict[int, dict[str, torch.Tensor]] = {}
    async with syncer_client.SyncerClient(url, token) as client:
        info = await client.join("island-0", 1)
        for f in range(len(info.fragments)):
            version = -1
            for _ in range(2):
                pulled = await client.pull_fragment(f, after=version, wait=60)
                assert pulled is not None
                version = pulled.version
                delta = {n: torch.full_like(t, 1e-3) for n, t in pulled.tensors.items()}
                meta = protocol.PushMeta("island-0", version, 128, 4, 5.0, 0.01, "none")
                answer = await client.push_pseudo_gradient(f, encode_tensors(delta, "none"), meta)
                assert answer.accepted, answer
            pulled = await client.pull_fragment(f, after=version, wait=60)
            assert pulled is not None and pulled.version == 2
            shapes[f] = pulled.tensors
        await client.join("island-1", 1)
        await client.set_membership("island-1", "dropped", "pods not ready")
    return shapes


@pytest.fixture(scope="module")
def syncer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SyncerHandle]:
    """One syncer for the module: bad requests change nothing, so the cases can share it."""
    workdir: Path = tmp_path_factory.mktemp("bad-requests")
    files = launch.write_job_files(parse_spec(SPEC), workdir)
    port = launch.free_port()
    log_file = workdir / "syncer.log"
    proc = launch.start_syncer(
        files,
        port=port,
        state_dir=workdir / "state",
        job_name="bad-requests",
        log_file=log_file,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        launch.wait_ready(url, files.token, timeout=90, proc=proc)
        handle = SyncerHandle(proc, url, files.token, port, files, workdir / "state", log_file)
        handle.fragments = asyncio.run(_advance(url, files.token))  # type: ignore[attr-defined]
        # Control: a body built exactly like the refused ones below, but valid, is accepted.
        code, doc = push(handle, push_body(good_delta(handle, 1)), fragment=1)
        assert code == 200 and doc["accepted"] is True, doc
        wait_until(lambda: handle.status()["versions"] == [2, 3], timeout=120, what="merge")
        yield handle
    finally:
        proc.stop(timeout=5)


def fingerprint(syncer: SyncerHandle) -> dict[str, Any]:
    doc = syncer.status(digest=True)
    return {k: doc[k] for k in ("digest", "versions", "pending", "islands", "bytesIn", "tokens")}


@pytest.fixture
def unchanged(syncer: SyncerHandle) -> Iterator[None]:
    """Asserts that the test left the syncer's state exactly as it found it."""
    before = fingerprint(syncer)
    yield
    assert fingerprint(syncer) == before


def good_delta(syncer: SyncerHandle, fragment: int = 0) -> dict[str, torch.Tensor]:
    tensors = syncer.fragments[fragment]  # type: ignore[attr-defined]
    return {n: torch.full_like(t, 1e-3) for n, t in tensors.items()}


def push(syncer: SyncerHandle, body: bytes, fragment: int = 0, **kw: Any) -> tuple[int, Any]:
    return syncer.request("POST", f"/v1/fragments/{fragment}/push", body=body, **kw)


def test_bad_requests_missing_token_is_401(syncer: SyncerHandle, unchanged: None) -> None:
    for method, path in [("GET", "/v1/status"), ("GET", "/metrics"), ("POST", "/v1/join")]:
        code, doc = syncer.request(method, path, token=None, json_body={"island": "x"})
        assert code == 401, (path, code, doc)
        assert "bearer token" in doc["error"]
    code, doc = push(syncer, push_body(good_delta(syncer)), token=None)
    assert code == 401


def test_bad_requests_wrong_token_is_403(syncer: SyncerHandle, unchanged: None) -> None:
    code, doc = push(syncer, push_body(good_delta(syncer)), token="not-the-token")
    assert code == 403 and doc["error"] == "invalid bearer token"
    code, doc = syncer.request(
        "PUT", "/v1/islands/island-0", json_body={"state": "dropped"}, token="nope"
    )
    assert code == 403


def test_bad_requests_probes_need_no_token(syncer: SyncerHandle) -> None:
    assert http_request("GET", syncer.url + "/healthz", token=None)[0] == 200
    assert http_request("GET", syncer.url + "/readyz", token=None)[0] == 200


def test_bad_requests_malformed_body_is_400(syncer: SyncerHandle, unchanged: None) -> None:
    code, doc = push(syncer, b"this is not safetensors at all")
    assert code == 400 and "safetensors" in doc["error"], doc
    # A valid header that promises more data than the body holds.
    body = push_body(good_delta(syncer))
    code, doc = push(syncer, body[: len(body) // 2])
    assert code == 400 and "safetensors" in doc["error"], doc


def test_bad_requests_wrong_tensor_names_is_400(syncer: SyncerHandle, unchanged: None) -> None:
    delta = good_delta(syncer)
    name = sorted(delta)[0]
    delta["not.a.parameter"] = delta.pop(name)
    code, doc = push(syncer, push_body(delta))
    assert code == 400
    assert "not.a.parameter" in doc["error"] and name in doc["error"], doc


def test_bad_requests_wrong_shape_is_400(syncer: SyncerHandle, unchanged: None) -> None:
    delta = good_delta(syncer)
    name = sorted(delta)[0]
    delta[name] = torch.zeros(3, 3)
    code, doc = push(syncer, push_body(delta))
    assert code == 400 and name in doc["error"] and "shape" in doc["error"], doc


def test_bad_requests_wrong_dtype_is_400(syncer: SyncerHandle, unchanged: None) -> None:
    delta = good_delta(syncer)
    name = sorted(delta)[0]
    delta[name] = delta[name].half()
    code, doc = push(syncer, push_body(delta))
    assert code == 400 and name in doc["error"] and "dtype" in doc["error"], doc


def test_bad_requests_non_finite_values_are_400(syncer: SyncerHandle, unchanged: None) -> None:
    delta = good_delta(syncer)
    name = sorted(delta)[0]
    delta[name][0] = float("nan")
    code, doc = push(syncer, push_body(delta))
    assert code == 400 and "NaN" in doc["error"], doc


def test_bad_requests_bad_metadata_is_400_naming_the_field(
    syncer: SyncerHandle, unchanged: None
) -> None:
    delta = good_delta(syncer)
    cases = [
        ("metadata.tokens", {"tokens": "many"}),
        ("metadata.steps", {"steps": 0}),
        ("metadata.baseVersion", {"baseVersion": -1}),
        ("metadata.codec", {"codec": "int8"}),
        ("metadata.island", {"island": "bad name!"}),
        ("metadata.keptSteps", {"keptSteps": 5}),  # more than the push's 4 steps
        ("metadata.keptSteps", {"keptSteps": -1}),
    ]
    for field, meta in cases:
        code, doc = push(syncer, push_body(delta, **meta))
        assert code == 400 and field in doc["error"], (field, doc)


def test_bad_requests_oversized_body_is_413(syncer: SyncerHandle, unchanged: None) -> None:
    body = push_body(good_delta(syncer))
    code, doc = push(syncer, body + b"\0" * (len(body) // 2 + 200_000))
    assert code == 413 and "exceeds" in doc["error"], doc


def test_bad_requests_oversized_chunked_body_is_413(syncer: SyncerHandle, unchanged: None) -> None:
    # No Content-Length: the server's hard read limit must stop it.
    chunk = b"\0" * 65536

    async def send() -> tuple[int, dict[str, Any]]:
        async def chunks():
            for _ in range(64):  # 4 MiB, far above the fragment's limit
                yield chunk

        headers = {"Authorization": f"Bearer {syncer.token}"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                syncer.url + "/v1/fragments/0/push", data=chunks(), headers=headers
            ) as resp,
        ):
            return resp.status, json.loads(await resp.read())

    code, doc = asyncio.run(send())
    assert code == 413 and "exceeds" in doc["error"], doc


def test_bad_requests_stale_version_is_409(syncer: SyncerHandle, unchanged: None) -> None:
    code, doc = push(syncer, push_body(good_delta(syncer), baseVersion=0))
    assert code == 409
    assert "by 2" in doc["error"] and "maxStaleness=1" in doc["error"], doc
    assert doc["code"] == protocol.ERROR_STALE
    code, doc = push(syncer, push_body(good_delta(syncer), baseVersion=9))
    assert code == 409 and "newer" in doc["error"] and doc["code"] == protocol.ERROR_AHEAD, doc


def test_bad_requests_never_joined_island_is_404(syncer: SyncerHandle, unchanged: None) -> None:
    code, doc = push(syncer, push_body(good_delta(syncer), island="island-42"))
    assert code == 404 and "island-42" in doc["error"] and "join" in doc["error"], doc
    code, doc = syncer.request("POST", "/v1/heartbeat", json_body={"island": "island-42"})
    assert code == 404, doc


def test_bad_requests_unknown_fragment_is_404(syncer: SyncerHandle, unchanged: None) -> None:
    code, doc = push(syncer, push_body(good_delta(syncer)), fragment=5)
    assert code == 404 and "fragment 5" in doc["error"], doc
    code, doc = syncer.request("GET", "/v1/fragments/5")
    assert code == 404, doc


def test_bad_requests_dropped_island_is_403_with_reason(
    syncer: SyncerHandle, unchanged: None
) -> None:
    code, doc = push(syncer, push_body(good_delta(syncer), island="island-1"))
    assert code == 403
    assert "dropped" in doc["error"] and "pods not ready" in doc["error"], doc


def test_bad_requests_bad_join_json_is_400(syncer: SyncerHandle, unchanged: None) -> None:
    code, doc = syncer.request("POST", "/v1/join", body=b"{not json")
    assert code == 400 and "not valid JSON" in doc["error"], doc
    code, doc = syncer.request("POST", "/v1/join", json_body=["island-0"])
    assert code == 400 and "JSON object" in doc["error"], doc
    code, doc = syncer.request("POST", "/v1/join", json_body={"replicas": 1})
    assert code == 400 and "join.island" in doc["error"], doc
    code, doc = syncer.request(
        "POST", "/v1/join", json_body={"island": "island-0", "replicas": "2"}
    )
    assert code == 400 and "join.replicas" in doc["error"], doc


def test_bad_requests_bad_membership_json_is_400(syncer: SyncerHandle, unchanged: None) -> None:
    code, doc = syncer.request("PUT", "/v1/islands/island-0", json_body={"state": "paused"})
    assert code == 400 and "membership.state" in doc["error"], doc
    code, doc = syncer.request("PUT", "/v1/islands/island-0", json_body={"reason": "x"})
    assert code == 400 and "membership.state" in doc["error"], doc
    code, doc = syncer.request(
        "PUT", "/v1/islands/island-0", json_body={"state": "dropped", "reason": 7}
    )
    assert code == 400 and "membership.reason" in doc["error"], doc


def test_bad_requests_bad_heartbeat_and_pull_queries_are_400(
    syncer: SyncerHandle, unchanged: None
) -> None:
    code, doc = syncer.request(
        "POST", "/v1/heartbeat", json_body={"island": "island-0", "step": -3}
    )
    assert code == 400 and "heartbeat.step" in doc["error"], doc
    code, doc = syncer.request(
        "POST", "/v1/heartbeat", json_body={"island": "island-0", "holding": "yes"}
    )
    assert code == 400 and "heartbeat.holding" in doc["error"], doc
    code, doc = syncer.request(
        "POST", "/v1/heartbeat", json_body={"island": "island-0", "drained": 1}
    )
    assert code == 400 and "heartbeat.drained" in doc["error"], doc
    # `waiting` (issue 45): a share of wall time, a finite number in [0, 1].
    for share in (b"1.5", b"-0.25", b"NaN", b"Infinity", b'"half"'):
        raw = b'{"island": "island-0", "waiting": ' + share + b"}"
        code, doc = syncer.request("POST", "/v1/heartbeat", body=raw)
        assert code == 400 and "heartbeat.waiting" in doc["error"], (share, doc)
    code, doc = syncer.request("GET", "/v1/fragments/0?wait=soon")
    assert code == 400 and "wait" in doc["error"], doc
    code, doc = syncer.request("GET", "/v1/fragments/0?have=latest")
    assert code == 400 and "have" in doc["error"], doc


def test_bad_requests_refusals_are_counted_in_metrics(syncer: SyncerHandle) -> None:
    push(syncer, b"junk")
    code, text = syncer.request("GET", "/metrics")
    assert code == 200
    lines = text.decode().splitlines()
    malformed = [
        ln for ln in lines if ln.startswith('diloco_syncer_pushes_total{result="malformed"}')
    ]
    assert malformed and float(malformed[0].split()[-1]) >= 1


def test_bad_requests_tls_syncer_refuses_plain_http_and_unknown_ca(
    syncer_proc: Callable[..., SyncerHandle],
    make_spec: Callable[..., JobSpec],
    tls_files: TLSFiles,
) -> None:
    tls = syncer_proc(make_spec(sync={**SAFE_HEARTBEAT, "fragments": 1}), tls=tls_files)
    assert tls.url.startswith("https://")

    async def join() -> JoinInfo:
        async with syncer_client.SyncerClient(tls.url, tls.token, ca_file=tls.ca_file) as client:
            return await client.join("island-0", 1)

    assert asyncio.run(join()).versions == [0]
    before = tls.status(digest=True)
    # Plain HTTP to the HTTPS port gets no HTTP answer at all.
    plain = tls.url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        http_request("GET", plain + "/v1/status", token=tls.token, timeout=10)
    # A client that does not trust the certificate refuses to talk.
    with pytest.raises(urllib.error.URLError) as err:
        http_request("GET", tls.url + "/v1/status", token=tls.token, timeout=10)
    assert "CERTIFICATE_VERIFY_FAILED" in str(err.value)
    after = tls.status(digest=True)
    assert (after["digest"], after["versions"], after["islands"]) == (
        before["digest"],
        before["versions"],
        before["islands"],
    )
