"""The cache of watched objects: newest wins, deletions stick, lists merge with raced events."""

from __future__ import annotations

from typing import Any

from diloco_operator.observed import ObjectCache, child_view, parse_version, resource_version


def _obj(name: str, version: int | str | None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if version is not None:
        meta["resourceVersion"] = str(version)
    return {"metadata": meta, **extra}


def _cache() -> ObjectCache[str, dict[str, Any]]:
    return ObjectCache(lambda obj: dict(obj))


def _versions(cache: ObjectCache[str, dict[str, Any]]) -> dict[str, int | None]:
    return {v["metadata"]["name"]: resource_version(v) for v in cache.values()}


def test_object_cache_upsert_keeps_the_newest() -> None:
    cache = _cache()
    assert cache.upsert("a", _obj("a", 5))
    assert not cache.upsert("a", _obj("a", 4))  # a late event of an older state
    assert _versions(cache) == {"a": 5}
    assert cache.upsert("a", _obj("a", 9))
    assert _versions(cache) == {"a": 9} and len(cache) == 1


def test_object_cache_deletion_leaves_a_tombstone_older_states_cannot_pass() -> None:
    cache = _cache()
    cache.upsert("a", _obj("a", 5))
    cache.delete("a", _obj("a", 7))
    assert cache.values() == [] and len(cache) == 0 and cache.get("a") is None
    assert not cache.upsert("a", _obj("a", 6))  # modified before the deletion, seen after
    assert cache.upsert("a", _obj("a", 8))  # created again under the same name
    assert _versions(cache) == {"a": 8}


def test_object_cache_list_older_than_a_deletion_does_not_resurrect() -> None:
    cache = _cache()
    cache.upsert("a", _obj("a", 5))
    cache.delete("a", _obj("a", 7))
    cache.replace({"a": _obj("a", 5)}, version=6)  # the list was served before the delete
    assert cache.values() == []


def test_object_cache_list_drops_absent_entries_not_newer_than_it() -> None:
    cache = _cache()
    cache.upsert("gone", _obj("gone", 3))  # deleted while the watch was down
    cache.upsert("new", _obj("new", 12))  # created after the list was served
    cache.upsert("kept", _obj("kept", 4))
    cache.replace({"kept": _obj("kept", 10), "listed": _obj("listed", 9)}, version=11)
    assert _versions(cache) == {"new": 12, "kept": 10, "listed": 9}


def test_object_cache_list_scope_limits_what_it_can_drop() -> None:
    cache: ObjectCache[tuple[str, str], dict[str, Any]] = ObjectCache(lambda obj: dict(obj))
    cache.upsert(("Service", "s"), _obj("s", 1))
    cache.upsert(("ConfigMap", "c"), _obj("c", 1))
    cache.replace({}, version=5, scope=lambda key: key[0] == "Service")
    assert list(cache.keys()) == [("ConfigMap", "c")]


def test_object_cache_opaque_versions_are_taken_as_newest() -> None:
    cache = _cache()
    cache.upsert("a", _obj("a", 5))
    assert cache.upsert("a", _obj("a", "opaque"))
    assert parse_version("opaque") is None and parse_version("17") == 17
    cache.forget("a")
    assert len(cache) == 0


def test_child_view_keeps_what_the_planner_reads() -> None:
    sts = {
        "kind": "StatefulSet",
        "metadata": {
            "name": "j-island-0",
            "generation": 3,
            "resourceVersion": "42",
            "annotations": {"diloco.dev/spec-hash": "h"},
            "ownerReferences": [{"uid": "u"}],
            "managedFields": [{"manager": "x"}],
        },
        "spec": {"replicas": 2, "template": {"spec": {"containers": []}}},
        "status": {"readyReplicas": 2},
    }
    view = child_view(sts)
    assert view == {
        "kind": "StatefulSet",
        "metadata": {
            "name": "j-island-0",
            "generation": 3,
            "resourceVersion": "42",
            "annotations": {"diloco.dev/spec-hash": "h"},
            "ownerReferences": [{"uid": "u"}],
        },
        "spec": {"replicas": 2},
        "status": {"readyReplicas": 2},
    }
    listed = child_view({"metadata": {"name": "c"}}, kind="ConfigMap")
    assert listed == {"kind": "ConfigMap", "metadata": {"name": "c"}}
