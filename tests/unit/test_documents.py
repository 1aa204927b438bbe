"""The typed syncer documents (api/documents.py): a real syncer's answers parse and give back
exactly what it sent; malformed documents are refused with the problem named."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.api.documents import (
    DocumentError,
    HeartbeatAnswer,
    IslandStatus,
    JoinInfo,
    MembershipAnswer,
    PushAnswer,
    SyncerStatus,
    parse_json_object,
)
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.records import Beat

SPEC: dict[str, Any] = {
    "model": {"preset": "gpt-tiny"},
    "data": {"evalTokens": 1024},
    "islands": {"count": 3},
    "inner": {"steps": 4, "batchSize": 2, "seqLen": 16},
    "sync": {"quorum": 2, "graceSeconds": 5, "fragments": 2, "maxStaleness": 2},
    "stopAfter": {"outerSteps": 100},
    "syncer": {"checkpoint": {"everyOuterSteps": 100}, "evalEveryOuterSteps": 1},
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _push_body(syncer: Syncer, join: dict[str, Any], fragment: int, island: str) -> bytes:
    """A small pseudo-gradient for `fragment`, shaped like the weights the syncer publishes
    (only the syncer's routes are used, not its internals)."""
    body = await syncer.pull(fragment, after=-1, wait=0)
    assert body is not None
    weights, meta = payloads.decode_body(body)
    delta = {n: torch.full_like(t, 1e-3) for n, t in weights.items()}
    push = protocol.PushMeta(
        island=island,
        base_version=int(meta["version"]),
        tokens=100,
        steps=4,
        loss=3.0,
        step_time=0.01,
        codec=join["codec"],
        push_id=f"{island}-{fragment}",
    )
    return payloads.encode_body(encode_tensors(delta, join["codec"]), push.to_metadata())


def _wire(doc: dict[str, Any]) -> dict[str, Any]:
    """The document as a client receives it: through JSON."""
    return json.loads(json.dumps(doc))


def _text(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True)


def _real_answers(tmp_path: Path) -> dict[str, Any]:
    """Every JSON answer of a syncer that merged a round, evaluated, and saw each kind of
    membership change."""

    async def scenario() -> dict[str, Any]:
        clock = FakeClock()
        syncer = Syncer(parse_spec(SPEC), job_name="docs", state_dir=tmp_path, clock=clock)
        await syncer.start()
        join = await syncer.islands.join("island-0", 2)
        out: dict[str, Any] = {"join": join}
        await syncer.islands.join("island-1", 1)
        await syncer.islands.join("island-2", 1)
        out["push"] = await syncer.receive_push(0, await _push_body(syncer, join, 0, "island-0"))
        retried = await _push_body(syncer, join, 0, "island-1")
        await syncer.receive_push(0, retried)
        out["duplicate"] = await syncer.receive_push(0, retried)
        out["heartbeat"] = await syncer.islands.heartbeat(
            "island-0", Beat(4, 400, loss=2.5, step_time=0.01)
        )
        clock.now += 5.0  # the grace window passes: the round of fragment 0 merges
        await syncer.tick()
        out["membership"] = await syncer.islands.set_membership(
            "island-2", "dropped", "pods not Ready"
        )
        out["leave"] = await syncer.islands.leave("island-1")
        out["status"] = await syncer.status()
        out["digest"] = await syncer.status(digest=True)
        return {k: _wire(v) for k, v in out.items()}

    return asyncio.run(scenario())


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _real_answers(tmp_path_factory.mktemp("documents"))


def test_documents_status_of_a_real_syncer_round_trips_exactly(answers: dict[str, Any]) -> None:
    doc = answers["status"]
    status = SyncerStatus.from_json(doc)
    # The same JSON text, not just equal values (an int field must not come back as 5.0).
    assert _text(status.to_json()) == _text(doc)
    # The scenario reached every nested model, so the round trip covered them too.
    assert status.versions == [1, 0] and status.merge_count == 1 and status.merges
    assert [c.island for c in status.merges[0].contributors] == ["island-0", "island-1"]
    assert status.eval_history and status.eval_history[0].eval_loss is not None
    assert status.island_states() == {
        "island-0": protocol.STATE_ACTIVE,
        "island-1": protocol.STATE_LEFT,
        "island-2": protocol.STATE_DROPPED,
    }
    assert status.islands["island-0"].replicas == 2 and status.islands["island-0"].step == 4
    assert status.digest is None and "digest" not in status.to_json()


def test_documents_status_with_digest_round_trips(answers: dict[str, Any]) -> None:
    status = SyncerStatus.from_json(answers["digest"])
    assert status.digest and len(status.digest) == 64
    assert _text(status.to_json()) == _text(answers["digest"])


@pytest.mark.parametrize(
    ("key", "model"),
    [
        ("join", JoinInfo),
        ("push", PushAnswer),
        ("duplicate", PushAnswer),
        ("heartbeat", HeartbeatAnswer),
        ("membership", MembershipAnswer),
        ("leave", MembershipAnswer),
    ],
)
def test_documents_answers_of_a_real_syncer_parse_and_round_trip(
    answers: dict[str, Any], key: str, model: type[Any]
) -> None:
    doc = answers[key]
    parsed = model.from_json(doc)
    assert _text({k: v for k, v in parsed.to_json().items() if k in doc}) == _text(doc)


def test_documents_answers_carry_the_typed_fields(answers: dict[str, Any]) -> None:
    join = JoinInfo.from_json(answers["join"])
    assert len(join.fragments) == 2 == len(join.versions) and join.state == protocol.STATE_ACTIVE
    assert join.outer_step == 0 and not join.finished
    push = PushAnswer.from_json(answers["push"])
    assert push.accepted and push.version == 0 and not push.duplicate
    assert PushAnswer.from_json(answers["duplicate"]).duplicate
    beat = HeartbeatAnswer.from_json(answers["heartbeat"])
    assert beat.state == protocol.STATE_ACTIVE and beat.versions == [0, 0]
    dropped = MembershipAnswer.from_json(answers["membership"])
    assert (dropped.island, dropped.state, dropped.reason) == (
        "island-2",
        protocol.STATE_DROPPED,
        "pods not Ready",
    )


def test_documents_tolerate_new_keys_and_give_them_back() -> None:
    doc = {
        "outerStep": 2,
        "versions": [2],
        "finished": False,
        "islands": {"island-0": {"state": "active", "newIslandField": [1]}},
        "newTopLevel": {"x": 1},
    }
    status = SyncerStatus.from_json(doc)
    assert status.outer_step == 2 and status.islands["island-0"].state == "active"
    back = status.to_json()
    assert back["newTopLevel"] == {"x": 1}
    assert back["islands"]["island-0"]["newIslandField"] == [1]


def test_documents_unknown_island_state_is_kept_but_not_known() -> None:
    island = IslandStatus.from_json({"state": "quarantined"})
    assert island.state == "quarantined" and island.known_state is None
    assert IslandStatus.from_json({"state": "timedOut"}).known_state == protocol.STATE_TIMED_OUT


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "expected a JSON object, got list"),
        ({"versions": [0], "finished": False}, "outerStep: Field required"),
        ({"outerStep": "three", "versions": [0], "finished": False}, "outerStep: Input should"),
        ({"outerStep": 0, "versions": 5, "finished": False}, "versions: Input should be a valid"),
        (
            {"outerStep": 0, "versions": [0], "finished": False, "islands": {"i": {}}},
            "islands.i.state: Field required",
        ),
        (
            {"outerStep": 0, "versions": [0], "finished": False, "islands": ["i"]},
            "islands: Input should be a valid dictionary",
        ),
    ],
)
def test_documents_malformed_status_is_refused_with_the_problem(doc: Any, message: str) -> None:
    with pytest.raises(DocumentError, match="malformed SyncerStatus") as err:
        SyncerStatus.from_json(doc)
    assert message in str(err.value)


def test_documents_join_needs_one_version_per_fragment() -> None:
    doc = {
        "fragments": [["a"], ["b"]],
        "versions": [0],
        "outerStep": 0,
        "finished": False,
        "codec": "none",
    }
    with pytest.raises(DocumentError, match="1 versions for 2 fragments"):
        JoinInfo.from_json(doc)


def test_documents_parse_json_object_refuses_other_bodies() -> None:
    assert parse_json_object(b'{"a": 1}', "x") == {"a": 1}
    with pytest.raises(DocumentError, match="malformed status: not JSON"):
        parse_json_object(b"<html>", "status")
    with pytest.raises(DocumentError, match="expected a JSON object, got str"):
        parse_json_object(b'"ok"', "status")


def test_documents_island_states_are_defined_once() -> None:
    assert get_args(protocol.IslandState) == protocol.ISLAND_STATES
    assert protocol.ISLAND_STATES == ("active", "dropped", "timedOut", "left")
    assert set(protocol.ADMIN_STATES) == {protocol.STATE_ACTIVE, protocol.STATE_DROPPED}


def test_documents_status_refusals_and_islands_the_syncer_dropped() -> None:
    banned = "refused_pushes: 5 pushes refused in a row (syncer.guards.maxRefusals); the last: x"
    doc = {
        "outerStep": 0,
        "versions": [0],
        "finished": False,
        "islands": {
            "island-0": {"state": "active"},
            "island-1": {"state": "dropped", "reason": banned},
            "island-2": {"state": "dropped", "reason": "island unhealthy: 0/1 pods Ready"},
            "island-3": {"state": "active", "reason": banned},  # re-added by the admin route
        },
        "refusals": {"island-1": {protocol.ERROR_NORM_OUTLIER: 5}},
    }
    status = SyncerStatus.from_json(doc)
    assert status.refusals == {"island-1": {"norm_outlier": 5}}
    assert status.to_json()["refusals"] == doc["refusals"]
    assert status.dropped_for_refusals() == {"island-1"}
    assert status.islands["island-1"].dropped_for_refusals
    assert not status.islands["island-3"].dropped_for_refusals
    older = SyncerStatus.from_json({k: v for k, v in doc.items() if k != "refusals"})
    assert older.refusals == {}
    problem = r"refusals\.island-1\.norm_outlier: Input should be a valid integer"
    with pytest.raises(DocumentError, match=problem):
        SyncerStatus.from_json({**doc, "refusals": {"island-1": {"norm_outlier": "many"}}})
