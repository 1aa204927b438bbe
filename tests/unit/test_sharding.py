"""Syncer shards: the fragment -> shard assignment, the spec's rules, and N shards' answers read
as one syncer's (api/sharding.py). Expected values are worked out by hand in the comments."""

from __future__ import annotations

import hashlib

import pytest
from diloco_trainer.api.documents import CheckpointRef, HeartbeatAnswer, JoinInfo, SyncerStatus
from diloco_trainer.api.sharding import (
    fragments_of,
    join_urls,
    merge_heartbeat,
    merge_join,
    merge_status,
    shard_of,
    split_urls,
    wrong_shard_message,
)
from diloco_trainer.api.spec import ConfigError, parse_spec


def test_shard_of_deals_fragments_round_robin() -> None:
    # 5 fragments over 2 shards: 0->0, 1->1, 2->0, 3->1, 4->0.
    assert [shard_of(f, 2) for f in range(5)] == [0, 1, 0, 1, 0]
    # 7 fragments over 3 shards: f mod 3.
    assert [shard_of(f, 3) for f in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [shard_of(f, 1) for f in range(4)] == [0, 0, 0, 0]


def test_fragments_of_is_the_inverse_of_shard_of() -> None:
    assert fragments_of(0, 2, 5) == [0, 2, 4]
    assert fragments_of(1, 2, 5) == [1, 3]
    assert fragments_of(2, 3, 7) == [2, 5]
    # Every fragment in exactly one shard.
    owned = sorted(f for s in range(3) for f in fragments_of(s, 3, 7))
    assert owned == list(range(7))


def test_shard_arguments_refused_with_names() -> None:
    with pytest.raises(ValueError, match=r"syncer\.shards must be >= 1"):
        shard_of(0, 0)
    with pytest.raises(ValueError, match="shard 2 is not one of the 2 syncer shards"):
        fragments_of(2, 2, 4)


def test_wrong_shard_message_names_the_owner() -> None:
    message = wrong_shard_message(3, 2, 0)
    assert "fragment 3 belongs to syncer shard 1 of 2" in message
    assert "not to this shard (0)" in message


def test_urls_split_and_joined_in_shard_order() -> None:
    urls = ["http://a:1", "http://b:2"]
    assert split_urls(join_urls(urls)) == urls
    assert split_urls("http://a:1/") == ["http://a:1"]
    with pytest.raises(ValueError, match="empty URL"):
        split_urls("http://a:1,,http://b:2")


def test_spec_shards_default_one_and_at_most_fragments() -> None:
    assert parse_spec({}).syncer.shards == 1
    assert parse_spec({"sync": {"fragments": 4}, "syncer": {"shards": 4}}).syncer.shards == 4
    with pytest.raises(ConfigError, match=r"syncer.shards \(3\) must be <= sync.fragments \(2\)"):
        parse_spec({"syncer": {"shards": 3}})
    with pytest.raises(ConfigError, match=r"spec\.syncer\.shards"):
        parse_spec({"syncer": {"shards": 0}})


def test_spec_shards_refused_with_a_remote_endpoint() -> None:
    doc = {"syncer": {"shards": 2, "endpoint": "https://syncer.example:443"}}
    with pytest.raises(ConfigError, match=r"syncer\.shards must be 1 with syncer\.endpoint"):
        parse_spec(doc)


def _join(versions: list[int], outer: int, finished: bool) -> JoinInfo:
    return JoinInfo(
        fragments=[["a"], ["b"], ["c"]],
        versions=versions,
        outer_step=outer,
        finished=finished,
        codec="int8",
    )


def test_merge_join_takes_each_fragment_from_its_owner() -> None:
    # Shard 0 owns fragments 0 and 2, shard 1 fragment 1.
    shard0 = _join([4, 0, 6], outer=4, finished=True)
    shard1 = _join([0, 5, 0], outer=5, finished=False)
    merged = merge_join([shard0, shard1])
    assert merged.versions == [4, 5, 6]
    assert merged.outer_step == 4  # the least of 4 and 5
    assert merged.finished is False  # shard 1 has not finished
    assert merge_join([shard0, shard1.model_copy(update={"finished": True})]).finished


def _status(**fields: object) -> SyncerStatus:
    base: dict[str, object] = {"outer_step": 0, "versions": [0, 0, 0], "finished": False}
    return SyncerStatus.model_validate({**base, **fields})


def test_merge_status_aggregates_per_fragment_and_sums() -> None:
    shard0 = _status(
        outer_step=3,
        versions=[3, 0, 7],
        pending=[1, 0, 2],
        tokens=100,
        merge_count=10,
        pulls={"full": 4},
        refusals={"island-0": {"stale": 1}},
        checkpoint=CheckpointRef(path="/a/checkpoints/ckpt-3", outer_step=3),
        last_merge_time=50.0,
    )
    shard1 = _status(
        outer_step=2,
        versions=[0, 2, 0],
        pending=[0, 1, 0],
        tokens=40,
        merge_count=2,
        pulls={"full": 1, "updates": 3},
        refusals={"island-0": {"stale": 2}, "island-1": {"norm_outlier": 1}},
        checkpoint=CheckpointRef(path="/b/checkpoints/ckpt-2", outer_step=2),
        last_merge_time=70.0,
        failure="merge failed",
    )
    merged = merge_status([shard0, shard1])
    assert merged.outer_step == 2  # the least-merged fragment is shard 1's
    assert merged.versions == [3, 2, 7]
    assert merged.pending == [1, 1, 2]
    # 3 fragments: shard 0 owns 2 (its mean 100), shard 1 owns 1 (40): (2 x 100 + 40) / 3 = 80.
    assert merged.tokens == 80
    assert merged.merge_count == 12
    assert merged.pulls == {"full": 5, "updates": 3}
    assert merged.refusals == {"island-0": {"stale": 3}, "island-1": {"norm_outlier": 1}}
    # Paths that name no shard dirs: the least advanced shard's checkpoint.
    assert merged.checkpoint == CheckpointRef(path="/b/checkpoints/ckpt-2", outer_step=2)
    assert merged.last_merge_time == 70.0
    assert merged.failure == "merge failed"
    assert merged.finished is False


def test_merge_status_of_one_shard_is_that_status() -> None:
    only = _status(outer_step=5, versions=[5, 5, 5], finished=True)
    assert merge_status([only]) is only


def test_merge_status_without_a_checkpoint_on_some_shard_has_none() -> None:
    shard0 = _status(checkpoint=CheckpointRef(path="/a/checkpoints/ckpt-3", outer_step=3))
    assert merge_status([shard0, _status()]).checkpoint is None


def test_merge_heartbeat_takes_versions_from_owners_and_finishes_with_all() -> None:
    shard0 = HeartbeatAnswer(state="active", finished=True, versions=[3, 0, 4])
    shard1 = HeartbeatAnswer(state="active", finished=False, versions=[0, 2, 0])
    merged = merge_heartbeat([shard0, shard1])
    assert merged.versions == [3, 2, 4]
    assert merged.state == "active"
    assert merged.finished is False


def test_merge_status_digest_covers_every_shard() -> None:
    a, b = _status(digest="aa"), _status(digest="bb")
    # sha256 of "aa,bb": a different order or a missing digest gives another answer.
    expected = hashlib.sha256(b"aa,bb").hexdigest()
    assert merge_status([a, b]).digest == expected
    assert merge_status([b, a]).digest != expected
    assert merge_status([a, _status()]).digest is None


def test_spec_shard_endpoints_one_per_shard_and_checked_like_endpoint() -> None:
    urls = ["https://s0.example:443", "https://s1.example:443"]
    spec = parse_spec({"syncer": {"shards": 2, "shardEndpoints": urls}})
    assert spec.syncer.shard_endpoints == urls and spec.syncer.remote
    # quorum beyond this cluster's islands is fine with a remote syncer (other regions' islands)
    assert parse_spec(
        {"sync": {"quorum": 5}, "syncer": {"shards": 2, "shardEndpoints": urls}}
    ).syncer.remote
    with pytest.raises(ConfigError, match=r"shardEndpoints lists 1 URL\(s\): it needs one per"):
        parse_spec({"syncer": {"shards": 2, "shardEndpoints": urls[:1]}})
    with pytest.raises(ConfigError, match=r"syncer\.shardEndpoints\[1\] must be https://"):
        parse_spec({"syncer": {"shards": 2, "shardEndpoints": [urls[0], "http://s1.example"]}})
    with pytest.raises(ConfigError, match=r"spec\.syncer\.shardEndpoints\.0"):
        parse_spec({"syncer": {"shards": 2, "shardEndpoints": ["ftp://x", urls[1]]}})


def test_merge_status_checkpoint_is_the_state_root_export_reads() -> None:
    def ref(path: str, step: int) -> CheckpointRef:
        return CheckpointRef(path=path, outer_step=step)

    # `diloco run`: STATE/shard-I/checkpoints/ckpt-N -> STATE at the least outer step.
    local = [
        _status(checkpoint=ref("/w/syncer/shard-0/checkpoints/ckpt-000000004", 4)),
        _status(checkpoint=ref("/w/syncer/shard-1/checkpoints/ckpt-000000003", 3)),
    ]
    assert merge_status(local).checkpoint == ref("/w/syncer", 3)
    # Pods: every shard sees its own directory of the claim at one path.
    pods = [
        _status(checkpoint=ref("/var/lib/diloco/checkpoints/ckpt-000000005", 5)),
        _status(checkpoint=ref("/var/lib/diloco/checkpoints/ckpt-000000006", 6)),
    ]
    assert merge_status(pods).checkpoint == ref("/var/lib/diloco", 5)
