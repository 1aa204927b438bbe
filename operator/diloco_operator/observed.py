"""What the operator has seen of a job's pods and children, kept from watch events (pure).

The operator watches the job's pods and children anyway (kopf event handlers); keeping what those
events carry means a sync reads memory instead of listing the API server. A list is still taken
when a job is first synced and after each slow resync, and its answer has to be merged with
events that raced it, so every entry remembers the resourceVersion it was read at:

- an event or a listed object older than what is stored is ignored;
- a deletion leaves a tombstone (its version), so a list taken before the deletion does not bring
  the object back;
- a listed kind is authoritative up to the list's own version: entries of that kind missing from
  the list and not newer than it are dropped (tombstones too).

resourceVersions are compared as integers (what etcd-backed API servers hand out); one that does
not parse is treated as newest, so such an entry is taken as it comes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Metadata a child keeps in the cache: what the planner compares, and what the watch needs.
CHILD_METADATA = (
    "name",
    "namespace",
    "uid",
    "generation",
    "resourceVersion",
    "labels",
    "annotations",
    "ownerReferences",
    "deletionTimestamp",
)


def resource_version(obj: Mapping[str, Any]) -> int | None:
    """The object's metadata.resourceVersion as an integer (None when absent or opaque)."""
    return parse_version((obj.get("metadata") or {}).get("resourceVersion"))


def parse_version(value: Any) -> int | None:
    """A resourceVersion as an integer, None when it is absent or not a number."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def child_view(obj: Mapping[str, Any], kind: str | None = None) -> dict[str, Any]:
    """The part of a child the reconcile planner reads (kind, metadata, spec.replicas, status)."""
    meta = obj.get("metadata") or {}
    view: dict[str, Any] = {
        "kind": obj.get("kind") or kind,
        "metadata": {k: meta[k] for k in CHILD_METADATA if k in meta},
    }
    spec = obj.get("spec") or {}
    if "replicas" in spec:
        view["spec"] = {"replicas": spec["replicas"]}
    if obj.get("status") is not None:
        view["status"] = obj["status"]
    return view


@dataclass(frozen=True)
class _Entry(Generic[V]):
    version: int | None
    value: V | None  # None: a tombstone (deleted at `version`)


class ObjectCache(Generic[K, V]):
    """Objects of one job by key, each converted by `view` when stored."""

    def __init__(self, view: Callable[[Mapping[str, Any]], V]) -> None:
        self._view = view
        self._entries: dict[K, _Entry[V]] = {}

    def _older(self, key: K, version: int | None) -> bool:
        have = self._entries.get(key)
        if have is None or have.version is None or version is None:
            return False
        return version < have.version

    def upsert(self, key: K, obj: Mapping[str, Any]) -> bool:
        """Store an added or modified object unless something newer is stored; True if stored."""
        version = resource_version(obj)
        if self._older(key, version):
            return False
        self._entries[key] = _Entry(version, self._view(obj))
        return True

    def delete(self, key: K, obj: Mapping[str, Any]) -> None:
        """The object was deleted (its last state): keep a tombstone at its version."""
        version = resource_version(obj)
        if not self._older(key, version):
            self._entries[key] = _Entry(version, None)

    def forget(self, key: K) -> None:
        """Drop what is known of one key (the operator deleted it itself)."""
        self._entries.pop(key, None)

    def replace(
        self,
        listed: Mapping[K, Mapping[str, Any]],
        version: int | None,
        scope: Callable[[K], bool] = lambda _key: True,
    ) -> None:
        """Merge a list answer taken at `version` covering the keys `scope` accepts."""
        for key, obj in listed.items():
            self.upsert(key, obj)
        for key in [k for k in self._entries if scope(k) and k not in listed]:
            entry = self._entries[key]
            newer = entry.version is not None and version is not None and entry.version > version
            if not newer:
                del self._entries[key]

    def get(self, key: K) -> V | None:
        """The stored view of a key, None when absent or deleted."""
        entry = self._entries.get(key)
        return entry.value if entry is not None else None

    def values(self) -> list[V]:
        """Views of every object present (tombstones left out)."""
        return [e.value for e in self._entries.values() if e.value is not None]

    def keys(self) -> Iterable[K]:
        """Keys of every object present."""
        return [k for k, e in self._entries.items() if e.value is not None]

    def __len__(self) -> int:
        return sum(e.value is not None for e in self._entries.values())
