"""One syncer shard's scope (`syncer.shards: N`, api/sharding.py): which fragments this process
merges, checkpoints and serves, and the refusal of requests for the others.

A shard is a whole syncer whose pushes and pulls are only those of its fragments: the HTTP edge
refuses any other fragment with 421 (code `wrong_shard`, the message naming the owner) before a
body is read, so the other fragments' rounds stay empty, are never merged, and keep the weights
the job started from. The outer step it reports (status, stopAfter, checkpoint cadence) is that
of its least-merged own fragment (ShardState), and its merged tokens are averaged over its own
fragments (ShardMergeLog), so one shard finishes when its fragments have had their rounds of work
or tokens. The membership is whole on every shard (the module docstring of
api/sharding.py says why).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

from diloco_trainer.api.contract import SYNCER_SHARD as SHARD_VARIABLE
from diloco_trainer.api.sharding import (
    ERROR_WRONG_SHARD,
    WRONG_SHARD_STATUS,
    fragments_of,
    shard_of,
    wrong_shard_message,
)
from diloco_trainer.api.spec import ConfigError, JobSpec
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.merging import MergeLog
from diloco_trainer.syncer.state import RoundPolicy, SyncState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class ShardScope:
    """Shard `shard` of `shards` of a model in `fragments` fragments."""

    shard: int
    shards: int
    fragments: int

    @classmethod
    def of(cls, spec: JobSpec, shard: int, fragments: int) -> ShardScope:
        """The scope of shard `shard` of the job; ConfigError naming the variable and the field
        when the shard does not exist or would own no fragment."""
        check_shard(spec, shard)
        shards = spec.syncer.shards
        if shards > fragments:
            raise ConfigError(
                f"syncer.shards ({shards}) is more than the model's {fragments} fragment(s): "
                "every shard must own at least one"
            )
        return cls(shard=shard, shards=shards, fragments=fragments)

    @property
    def owned(self) -> list[int]:
        return fragments_of(self.shard, self.shards, self.fragments)

    def new_state(
        self,
        policy: RoundPolicy,
        num_fragments: int,
        versions: list[int] | None = None,
        rounds: list[int] | None = None,
    ) -> SyncState:
        """The rounds of every fragment, counting the outer step over this shard's own."""
        return ShardState(policy, num_fragments, versions, rounds, owned=self.owned)

    def new_merge_log(self, num_fragments: int, state_dir: Path) -> MergeLog:
        """The merge log, counting tokens over this shard's own fragments."""
        return ShardMergeLog(num_fragments, state_dir, owned=self.owned)


def check_shard(spec: JobSpec, shard: int) -> None:
    """ConfigError naming the variable and the field when the job has no shard `shard`."""
    shards = spec.syncer.shards
    if not 0 <= shard < shards:
        raise ConfigError(
            f"{SHARD_VARIABLE}={shard} is not a shard of syncer.shards ({shards}): "
            f"expected 0..{shards - 1}"
        )


def wrong_shard_middleware(shard: int, shards: int) -> Middleware:
    """The aiohttp middleware that refuses (421) a fragment route of another shard's fragment
    before its body is read (http.errors, outside it, answers the Refused). A fragment number
    the model does not have is answered 421 too when another shard would own it, else 404 by
    the route: either way nothing is read."""

    @web.middleware
    async def only_own_fragments(request: web.Request, handler: Handler) -> web.StreamResponse:
        raw = request.match_info.get("fragment", "")
        if raw.isdigit() and shard_of(int(raw), shards) != shard:
            raise Refused(
                WRONG_SHARD_STATUS,
                wrong_shard_message(int(raw), shards, shard),
                ERROR_WRONG_SHARD,
            )
        return await handler(request)

    return only_own_fragments


class ShardState(SyncState):
    """SyncState whose outer step is that of the least-merged fragment this shard owns (the
    others are never merged here)."""

    def __init__(
        self,
        policy: RoundPolicy,
        num_fragments: int,
        versions: list[int] | None = None,
        rounds: list[int] | None = None,
        *,
        owned: list[int],
    ) -> None:
        super().__init__(policy, num_fragments, versions, rounds)
        self.owned = owned

    @property
    def outer_step(self) -> int:
        return min(self.rounds[f].rounds for f in self.owned)


class ShardMergeLog(MergeLog):
    """MergeLog whose merged tokens are averaged over this shard's own fragments (the others
    are never merged here), so stopAfter.tokens means the same on every shard as for the job;
    sharding.merge_status weighs each shard's by its share of the fragments."""

    def __init__(self, fragments: int, state_dir: Path, *, owned: list[int]) -> None:
        super().__init__(fragments, state_dir)
        self.owned = owned

    @property
    def tokens(self) -> int:
        return round(sum(self.fragment_tokens[f] for f in self.owned) / len(self.owned))
