"""The syncer's HTTP handlers one at a time (http.SyncerRoutes), on mocked requests against a real
Syncer, with no server: each answers the documented status, and a refused request leaves the
syncer's state exactly as it was."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import pytest
from aiohttp import payload, streams, web
from aiohttp.test_utils import make_mocked_request
from diloco_trainer.api import credentials, protocol
from diloco_trainer.api.credentials import Principal
from diloco_trainer.api.documents import FragmentMerges
from diloco_trainer.syncer.edge import limits
from diloco_trainer.syncer.edge.access import PRINCIPAL
from diloco_trainer.syncer.edge.http import SyncerRoutes, errors
from diloco_trainer.syncer.merging import merge_log
from diloco_trainer.syncer.service.service import Syncer

from .test_syncer import FakeClock, body, delta, make_spec, started

T = TypeVar("T")
TOKEN = "tok"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def request(
    method: str,
    path: str,
    data: bytes = b"",
    *,
    match_info: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> web.Request:
    """A request with `data` as its body (call inside a running loop)."""
    payload = streams.StreamReader(
        mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop()
    )
    payload.feed_data(data)
    payload.feed_eof()
    return make_mocked_request(
        method,
        path,
        headers={"Content-Length": str(len(data)), **(headers or {})},
        match_info=match_info or {},
        payload=payload,
    )


def json_request(path: str, doc: Any, **kw: Any) -> web.Request:
    return request("POST", path, json.dumps(doc).encode(), **kw)


async def answer(handler: Handler, req: web.Request) -> tuple[int, Any]:
    """The handler's status and decoded body, with refusals mapped as the app maps them."""
    resp = await errors(req, handler)
    assert isinstance(resp, web.Response)
    raw: Any = resp.body
    if isinstance(raw, payload.Payload):  # a pull body: memory torch wrote (a memoryview)
        raw = bytes(await raw.as_bytes())
    assert raw is None or isinstance(raw, bytes)
    if resp.content_type == "application/json":
        return resp.status, json.loads(raw or b"null")
    return resp.status, raw


async def state_of(syncer: Syncer) -> dict[str, Any]:
    """Everything a request could change: the status document (but its clock) and the digest."""
    doc = await syncer.status(digest=True)
    doc.pop("time")
    return doc


def with_syncer(
    tmp_path: Path, scenario: Callable[[Syncer, SyncerRoutes], Coroutine[Any, Any, T]]
) -> T:
    async def run() -> T:
        syncer = await started(make_spec(), tmp_path, FakeClock())
        try:
            return await scenario(syncer, SyncerRoutes(syncer, TOKEN))
        finally:
            await syncer.stop()

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("doc", "status", "field"),
    [
        ({"island": "-bad-"}, 400, "join.island"),
        ({"island": "island-0", "replicas": -1}, 400, "join.replicas"),
        ({"island": "island-0", "replicas": True}, 400, "join.replicas"),
        (["island-0"], 400, "JSON object"),
    ],
)
def test_syncer_http_join_refuses_bad_bodies_and_registers_nobody(
    tmp_path: Path, doc: Any, status: int, field: str
) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> None:
        before = await state_of(syncer)
        code, answered = await answer(routes.join, json_request(protocol.ROUTE_JOIN, doc))
        assert (code, field in answered["error"]) == (status, True), answered
        assert await state_of(syncer) == before
        assert syncer.state.membership.islands == {}

    with_syncer(tmp_path, scenario)


def test_syncer_http_join_answers_the_layout(tmp_path: Path) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> tuple[int, Any]:
        req = json_request(protocol.ROUTE_JOIN, {"island": "island-0", "replicas": 2})
        return await answer(routes.join, req)

    code, doc = with_syncer(tmp_path, scenario)
    assert code == 200
    assert doc["versions"] == [0] and doc["state"] == protocol.STATE_ACTIVE and doc["fragments"]


def test_syncer_http_push_refusals_change_nothing_and_are_counted(tmp_path: Path) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> list[int]:
        await syncer.islands.join("island-0", 1)
        good = body(syncer, 0, "island-0", delta(syncer, 0, 1))
        path = "/v1/fragments/0/push"
        before = await state_of(syncer)
        codes = []
        for fragment, data in [
            ("0", good + b"\0" * syncer.push_limit(0)),  # larger than any push of fragment 0
            ("7", good),  # no such fragment
            ("x", good),  # not a number
            ("0", b"not safetensors"),
            ("0", body(syncer, 0, "island-9", delta(syncer, 0, 1))),  # never joined
        ]:
            req = request("POST", path, data, match_info={"fragment": fragment})
            codes.append((await answer(routes.handle_push, req))[0])
        assert await state_of(syncer) == before
        assert syncer.state.rounds[0].pending == {} and syncer.bytes_in == 0
        req = request("POST", path, good, match_info={"fragment": "0"})
        code, accepted = await answer(routes.handle_push, req)
        assert (code, accepted["accepted"], accepted["pending"]) == (200, True, 1)
        metrics = syncer.metrics.render().decode()
        for result, count in (("too_large", 1), ("unknown", 2), ("malformed", 1)):
            line = f'diloco_syncer_pushes_total{{result="{result}"}} {float(count)}'
            assert line in metrics, (line, metrics)
        assert 'diloco_syncer_pushes_total{result="accepted"} 1.0' in metrics
        return codes

    assert with_syncer(tmp_path, scenario) == [413, 404, 404, 400, 404]


def test_syncer_http_pull_checks_its_query_and_long_polls(tmp_path: Path) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> list[int]:
        codes = []
        for query in ("wait=-1", "wait=nan", "after=x", "after=0&wait=0", "after=-1"):
            req = request("GET", f"/v1/fragments/0?{query}", match_info={"fragment": "0"})
            code, raw = await answer(routes.pull, req)
            codes.append(code)
            if code == 200:
                meta = protocol.read_metadata(raw)
                assert meta[protocol.META_KIND] == protocol.KIND_FULL
        assert syncer.publisher.pulls == {protocol.KIND_FULL: 1, protocol.KIND_UPDATES: 0}
        return codes

    assert with_syncer(tmp_path, scenario) == [400, 400, 400, 304, 200]


def test_syncer_http_heartbeat_and_membership_refusals_keep_the_island(tmp_path: Path) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> list[int]:
        await syncer.islands.join("island-0", 1)
        before = await state_of(syncer)
        island = {"island": "island-0"}
        codes = [
            (await answer(routes.heartbeat, json_request("/", {**island, "step": -1})))[0],
            (await answer(routes.heartbeat, json_request("/", {**island, "loss": "x"})))[0],
            (await answer(routes.heartbeat, json_request("/", {"island": "island-9"})))[0],
        ]
        for name, doc in (("island-0", {"state": "paused"}), ("-x-", {"state": "dropped"})):
            req = request("PUT", "/", json.dumps(doc).encode(), match_info={"island": name})
            codes.append((await answer(routes.membership, req))[0])
        assert await state_of(syncer) == before
        req = request(
            "PUT", "/", b'{"state": "dropped", "reason": "r"}', match_info={"island": "island-0"}
        )
        code, doc = await answer(routes.membership, req)
        assert (code, doc["state"]) == (200, protocol.STATE_DROPPED)
        code, doc = await answer(routes.heartbeat, json_request("/", {**island, "step": 3}))
        assert (code, doc["state"]) == (200, protocol.STATE_DROPPED)
        return codes

    assert with_syncer(tmp_path, scenario) == [400, 400, 404, 400, 400]


def test_syncer_http_probes_report_a_failed_syncer(tmp_path: Path) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> list[tuple[int, Any]]:
        probes = [routes.healthz, routes.readyz]
        ok = [await answer(p, request("GET", "/healthz")) for p in probes]
        syncer.control.failure = "merge failed: boom"
        failed = [await answer(p, request("GET", "/healthz")) for p in probes]
        code, doc = await answer(routes.join, json_request("/", {"island": "island-0"}))
        assert code == 503 and "boom" in doc["error"]
        return ok + failed

    ok_health, ok_ready, bad_health, bad_ready = with_syncer(tmp_path, scenario)
    assert ok_health == (200, {"ok": True})
    assert ok_ready == (200, {"ready": True, "outerStep": 0})
    assert bad_health == (503, {"ok": False, "error": "merge failed: boom"})
    assert bad_ready == (503, {"ready": False, "error": "merge failed: boom"})


@pytest.mark.parametrize(
    ("path", "header", "status"),
    [
        (protocol.ROUTE_STATUS, None, 401),
        (protocol.ROUTE_STATUS, "Basic abc", 401),
        (protocol.ROUTE_STATUS, "Bearer wrong", 403),
        (protocol.ROUTE_STATUS, f"Bearer {TOKEN}", 200),
        (protocol.ROUTE_HEALTHZ, None, 200),
    ],
)
def test_syncer_http_auth_guards_every_route_but_the_probes(
    tmp_path: Path, path: str, header: str | None, status: int
) -> None:
    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> tuple[int, Any]:
        headers = {"Authorization": header} if header else {}
        req = request("GET", path, headers=headers)

        async def guarded(r: web.Request) -> web.StreamResponse:
            return await routes.auth(r, routes.status)

        return await answer(guarded, req)

    code, doc = with_syncer(tmp_path, scenario)
    assert code == status
    if status == 200:
        assert doc["jobName"] == "unit" and doc["versions"] == [0]


def test_syncer_http_push_slots_per_credential_checked_before_a_slot(tmp_path: Path) -> None:
    """Finding 5 of issue 22: the admin credential (which may not push) and one island trickling
    bodies could hold every push slot; the permission was checked after a slot was taken."""

    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> list[tuple[int, str]]:
        await syncer.islands.join("island-0", 1)
        await syncer.islands.join("island-1", 1)
        path, fragment = "/v1/fragments/0/push", {"fragment": "0"}
        island_1 = Principal(credentials.ISLAND, "island-1")
        size = routes.push_slots.size
        assert size == 2 * 3 + 2  # 'auto': 2 x the job's islands + 2
        got = []
        with contextlib.ExitStack() as held:
            for _ in range(limits.PUSHES_PER_ISLAND):  # island-1 trickles two bodies
                held.enter_context(routes.push_slots.take(island_1, limits.PUSHES_PER_ISLAND))
            for who, island in (
                (island_1, "island-1"),  # a third of its own: busy
                (Principal(credentials.ADMIN), "island-0"),  # may not push: 403, no slot
                (Principal(credentials.ISLAND, "island-0"), "island-0"),  # room for the others
            ):
                req = request("POST", path, body(syncer, 0, island, delta(syncer, 0, 1)))
                req.match_info.update(fragment)
                req[PRINCIPAL] = who
                code, doc = await answer(routes.handle_push, req)
                got.append((code, doc.get("code", "")))
            assert routes.push_slots.used == limits.PUSHES_PER_ISLAND  # none left taken
        assert routes.push_slots.used == 0 and routes.push_slots.owners == {}
        return got

    assert with_syncer(tmp_path, scenario) == [(503, protocol.ERROR_BUSY), (403, ""), (200, "")]


def test_syncer_http_heartbeat_waiting_is_a_share_refused_400_outside_0_to_1(
    tmp_path: Path,
) -> None:
    """A heartbeat's `waiting` (the share of its learner's wall time blocked on the syncer,
    learner/step_costs.WaitMeter) is a finite number in [0, 1]: anything else is refused 400
    naming heartbeat.waiting, with no state change; a share is the island's status entry's
    `waiting` until the next heartbeat, and a heartbeat without it (an older learner) leaves
    it unknown (absent)."""
    bad = [b"-0.01", b"1.5", b'"x"', b"true", b"NaN", b"Infinity", b"-Infinity", b"[0.5]"]

    async def scenario(syncer: Syncer, routes: SyncerRoutes) -> list[tuple[int, str]]:
        await syncer.islands.join("island-0", 1)
        before = await state_of(syncer)
        refused = []
        for raw in bad:
            body = b'{"island": "island-0", "step": 3, "waiting": ' + raw + b"}"
            code, doc = await answer(routes.heartbeat, request("POST", "/", body))
            refused.append((code, doc["error"].split(" ")[0]))
        assert await state_of(syncer) == before  # no step, no sign of life taken
        shares = []
        for doc in ({"waiting": 0.25}, {"waiting": 1}, {"waiting": 0}, {}):
            heartbeat = {"island": "island-0", "step": 3, **doc}
            code, _ = await answer(routes.heartbeat, json_request("/", heartbeat))
            assert code == 200
            shares.append((await syncer.status())["islands"]["island-0"].get("waiting"))
        assert shares == [0.25, 1.0, 0.0, None]
        return refused

    assert with_syncer(tmp_path, scenario) == [(400, "heartbeat.waiting")] * len(bad)


def test_syncer_http_fragment_merges_are_one_fragments_last_merges_from_a_version(
    tmp_path: Path,
) -> None:
    """GET /v1/fragments/{f}/merges (phase alignment's read): fragment f's merges of version
    `from` on, the last RECENT_OF_FRAGMENT of them, with the syncer's clock and the islands'
    step times; a bad query or fragment is refused and changes nothing."""
    clock = FakeClock()

    async def scenario() -> tuple[list[tuple[int, Any]], list[int]]:
        spec = make_spec(islands={"count": 2}, sync={"quorum": 1, "fragments": 2})
        syncer = await started(spec, tmp_path, clock)
        routes = SyncerRoutes(syncer, TOKEN)
        try:
            await syncer.islands.join("island-0", 1)
            await syncer.islands.join("island-1", 1)
            # Nine merges of fragment 0 (one more than it keeps), one of fragment 1.
            for f, seed in [(0, s) for s in range(9)] + [(1, 0)]:
                await syncer.receive_push(f, body(syncer, f, "island-0", delta(syncer, f, seed)))
                clock.now += 10.0  # past the grace window
                await syncer.tick()
            assert syncer.state.versions == [9, 1]
            before = await state_of(syncer)
            answers = []
            for fragment, query in (("0", ""), ("0", "from=7"), ("1", "from=0"), ("0", "from=10")):
                req = request("GET", f"/?{query}", match_info={"fragment": fragment})
                answers.append(await answer(routes.fragment_merges, req))
            refused = []
            for fragment, query in (("0", "from=x"), ("2", ""), ("x", "")):
                req = request("GET", f"/?{query}", match_info={"fragment": fragment})
                refused.append((await answer(routes.fragment_merges, req))[0])
            assert await state_of(syncer) == before
            return answers, refused
        finally:
            await syncer.stop()

    answers, refused = asyncio.run(scenario())
    assert refused == [400, 404, 404]
    assert all(code == 200 for code, _ in answers)
    docs = [FragmentMerges.from_json(doc) for _, doc in answers]
    assert [d.to_wire() for d in docs] == [doc for _, doc in answers]  # its model's wire form
    kept = list(range(10 - merge_log.RECENT_OF_FRAGMENT, 10))  # versions 2..9 of 1..9
    assert [[m.version for m in d.merges] for d in docs] == [kept, [7, 8, 9], [1], []]
    assert {m.fragment for d in docs for m in d.merges} == {0, 1}
    assert [d.fragment for d in docs] == [0, 0, 1, 0]
    assert all(d.time == clock.now for d in docs)
    assert docs[0].step_times == {"island-0": 0.01}  # island-1 never said its step time
    assert docs[0].merges[-1].contributors[0].island == "island-0"
