"""One syncer shard (syncer/edge/shard_scope.py): its outer step and tokens count its own fragments,
a request for another shard's fragment is refused 421 naming the owner before any body is read,
and a shard out of range is a config error naming the variable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from diloco_trainer.api import protocol
from diloco_trainer.api.sharding import ERROR_WRONG_SHARD
from diloco_trainer.api.spec import ConfigError
from diloco_trainer.syncer.edge.http import build_app
from diloco_trainer.syncer.edge.shard_scope import (
    ShardScope,
    ShardState,
    check_shard,
    wrong_shard_middleware,
)
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.rounds import RoundPolicy, SyncState

from .test_syncer import FakeClock, body, make_spec, run


def delta(syncer: Syncer, f: int, seed: int) -> dict[str, torch.Tensor]:
    """A pseudo-gradient of fragment f by its shapes (a shard holds no tensor of another's)."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: 1e-2 * torch.randn(shape, generator=g) for n, shape in syncer.model.expected[f].items()
    }


def _policy() -> RoundPolicy:
    return RoundPolicy(
        quorum=1,
        max_staleness=2,
        heartbeat_timeout=30.0,
        grace_seconds=0.0,
        inner_steps=4,
        offsets=(0, 1, 2, 3),
    )


def test_shard_state_outer_step_is_its_least_merged_own_fragment() -> None:
    # 4 fragments with 5, 1, 3, 2 rounds of work; shard 0 of 2 owns 0 and 2 -> min(5, 3) = 3,
    # shard 1 owns 1 and 3 -> min(1, 2) = 1; the whole job (one syncer) -> 1.
    rounds = [5, 1, 3, 2]
    scope0 = ShardScope(shard=0, shards=2, fragments=4)
    scope1 = ShardScope(shard=1, shards=2, fragments=4)
    assert scope0.new_state(_policy(), 4, rounds, rounds).outer_step == 3
    assert scope1.new_state(_policy(), 4, rounds, rounds).outer_step == 1
    assert SyncState(_policy(), 4, rounds, rounds).outer_step == 1
    assert isinstance(scope0.new_state(_policy(), 4), ShardState)


def test_shard_scope_refuses_a_shard_out_of_range_naming_the_variable() -> None:
    spec = make_spec(sync={"fragments": 2}, syncer={"shards": 2})
    check_shard(spec, 1)
    with pytest.raises(ConfigError, match=r"DILOCO_SYNCER_SHARD=2 is not a shard of syncer"):
        check_shard(spec, 2)
    with pytest.raises(ConfigError, match=r"more than the model's 1 fragment"):
        ShardScope.of(spec, 0, 1)


def _shard_syncer(tmp_path: Path, shard: int) -> Syncer:
    spec = make_spec(
        islands={"count": 1},
        sync={"quorum": 1, "graceSeconds": 0, "fragments": 2},
        syncer={"shards": 2},
    )
    return Syncer(spec, job_name="unit", state_dir=tmp_path, clock=FakeClock(), shard=shard)


def test_syncer_shard_counts_only_its_fragments(tmp_path: Path) -> None:
    syncer = _shard_syncer(tmp_path, shard=1)

    async def scenario() -> None:
        await syncer.start()
        await syncer.islands.join("island-0", 1)
        assert syncer.outer_step == 0
        await syncer.receive_push(1, body(syncer, 1, "island-0", delta(syncer, 1, 7)))
        await syncer.tick()
        await syncer.stop()

    run(scenario())
    # Fragment 1 merged once, fragment 0 (shard 0's) never: the shard is one outer step on.
    assert syncer.state.versions == [0, 1]
    assert syncer.outer_step == 1
    # 100 tokens merged into its one own fragment: 100 (a mean over both fragments would be 50).
    assert syncer.tokens == 100


async def _answers(syncer: Syncer, shard: int) -> list[tuple[int, dict[str, str]]]:
    app = build_app(syncer, "tok")
    app.middlewares.append(wrong_shard_middleware(shard, 2))
    auth = {"Authorization": "Bearer tok"}
    async with TestClient(TestServer(app)) as client:
        await client.post(protocol.ROUTE_JOIN, json={"island": "island-0"}, headers=auth)
        out = []
        push = body(syncer, 1, "island-0", delta(syncer, 1, 3))
        for method, path, data in (
            ("GET", protocol.ROUTE_FRAGMENT.format(fragment=1), None),
            ("POST", protocol.ROUTE_PUSH.format(fragment=1), push),
            ("GET", protocol.ROUTE_MERGES.format(fragment=1), None),
            ("GET", protocol.ROUTE_FRAGMENT.format(fragment=0), None),
        ):
            resp = await client.request(method, path, data=data, headers=auth)
            raw = await resp.read()
            doc = json.loads(raw) if resp.content_type == "application/json" else {}
            out.append((resp.status, doc))
        return out


def test_shard_refuses_other_shards_fragments_with_421_naming_the_owner(tmp_path: Path) -> None:
    syncer = _shard_syncer(tmp_path, shard=0)
    (pull1, push1, merges1, pull0) = run(_answers(syncer, shard=0))
    for status, doc in (pull1, push1, merges1):
        assert status == 421
        assert doc["code"] == ERROR_WRONG_SHARD
        assert "fragment 1 belongs to syncer shard 1 of 2" in doc["error"]
    assert pull0[0] == 200  # its own fragment is served
    # The refused push changed nothing: no pending contribution on fragment 1.
    assert syncer.state.rounds[1].pending == {}
    assert syncer.state.versions == [0, 0]


def test_middleware_leaves_routes_without_a_fragment_alone() -> None:
    async def scenario() -> int:
        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application(middlewares=[wrong_shard_middleware(1, 2)])
        app.router.add_get("/v1/status", ok)
        async with TestClient(TestServer(app)) as client:
            return (await client.get("/v1/status")).status

    assert run(scenario()) == 200


def test_shard_holds_only_its_own_fragments_tensors(tmp_path: Path) -> None:
    syncer = _shard_syncer(tmp_path, shard=1)
    own, other = syncer.fragments[1], syncer.fragments[0]
    assert set(syncer.model.weights) == set(own)
    assert set(syncer.model.published) <= set(own)
    # The module's other tensors are released (no elements), not just left out of the dicts.
    params = dict(syncer.parts.model.named_parameters())
    assert all(params[n].numel() == 0 for n in other)
    assert all(params[n].numel() > 0 for n in own)
    # No process holds the whole model: a shard evaluates nothing.
    assert syncer.jobs.snapshot().eval_history == []


def test_shard_resumes_its_own_tensors_from_a_whole_model_checkpoint(tmp_path: Path) -> None:
    # A checkpoint with every tensor (a shard's from before shards held only theirs, or one
    # syncer's with the same fragments): the shard takes its own fragments' and drops the rest.
    whole = Syncer(
        make_spec(islands={"count": 1}, sync={"quorum": 1, "graceSeconds": 0, "fragments": 2}),
        job_name="unit",
        state_dir=tmp_path,
        clock=FakeClock(),
    )

    async def merge_both() -> None:
        await whole.start()
        await whole.islands.join("island-0", 1)
        for f in (0, 1):
            await whole.receive_push(f, body(whole, f, "island-0", delta(whole, f, 5 + f)))
            await whole.tick()
        await whole.stop()

    run(merge_both())
    shard = _shard_syncer(tmp_path, shard=1)
    assert shard.resumed_from is not None
    assert set(shard.model.weights) == set(shard.fragments[1])
    for name in shard.fragments[1]:
        assert torch.equal(shard.model.weights[name], whole.model.weights[name])
    assert set(shard.model.outer.state_tensors()) == set(shard.fragments[1])
    assert shard.state.versions[1] == 1
