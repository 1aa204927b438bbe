"""Writing one child without taking over an object the job does not own.

Child names are built from the job's name and its islands' prefix, so two jobs can want the same
name (job `a` with islands.namePrefix `b` and job `a-b` both want StatefulSet `a-b-island-0`), and
a user may have made an object of that name. A child the job owns (its controller owner
reference is the job) is applied server-side, forcing our fields back. Any other is read first:
absent, it is applied without forcing (which creates it); the job's after all (not in the watch's
view yet), applied unless it already holds the desired content; anyone else's, it is left alone
and reported as a Conflict naming who holds it (condition and Event).

Every write is a server-side apply under one field manager (never a plain create, whose
"Update" field ownership would keep fields a later apply leaves out). Between the read and the
apply another job could create the same name; the window is one or two requests long (a job's
first reconcile reads its children while its token Secret is being created: read_children).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from diloco_operator.kube import Kube
from diloco_operator.planner import Key, key, owned_by
from diloco_operator.resources import JOB_LABEL, SPEC_HASH

# "Not read yet" for write_child's `existing` (None there means "read: there is none").
UNREAD: Final = object()


@dataclass(frozen=True)
class Conflict:
    """A child name taken by an object the job does not own."""

    kind: str
    name: str
    holder: str  # who holds it, in words

    def message(self) -> str:
        """What the job's condition and Event say."""
        return (
            f"{self.kind} {self.name} already exists and belongs to {self.holder}: this job "
            "does not take it over (rename the job or change spec.islands.namePrefix)"
        )


def holder_of(obj: Mapping[str, Any]) -> str:
    """Who holds an object, from its controller owner reference or its job label."""
    meta = obj.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    controller = next((r for r in refs if r.get("controller")), refs[0] if refs else None)
    if controller is not None:
        return f"{controller.get('kind', 'an object')} {controller.get('name', '?')}"
    job = (meta.get("labels") or {}).get(JOB_LABEL)
    if job:
        return f"DiLoCoJob {job} (by its label)"
    return "nobody this job knows of (it has no owner)"


async def write_child(
    kube: Kube, obj: dict[str, Any], *, job_uid: str, owned: bool, existing: Any = UNREAD
) -> dict[str, Any] | Conflict:
    """Apply `obj` unless another holds its name; the object as stored, or the Conflict.

    `existing`: what a read of the name answered just before (read_children), so it is not read
    again; by default it is read here.
    """
    if owned:
        return await kube.apply(obj, force=True)
    meta = obj["metadata"]
    if existing is UNREAD:
        existing = await kube.get(obj["kind"], meta["namespace"], meta["name"])
    if existing is None:
        return await kube.apply(obj)
    if not owned_by(existing, job_uid):
        return Conflict(obj["kind"], meta["name"], holder_of(existing))
    if _spec_hash(existing) == _spec_hash(obj):
        return existing  # e.g. after a restart: nothing to write
    return await kube.apply(obj, force=True)


def _spec_hash(obj: Mapping[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(SPEC_HASH)


async def read_children(
    kube: Kube, namespace: str, keys: Iterable[Key]
) -> dict[Key, dict[str, Any] | None]:
    """Read each (kind, name) at once: the object, None where there is none."""
    wanted = list(keys)
    found = await asyncio.gather(*(kube.get(kind, namespace, name) for kind, name in wanted))
    return dict(zip(wanted, found, strict=True))


async def write_children(
    kube: Kube,
    objs: list[dict[str, Any]],
    observed: list[Mapping[str, Any]],
    *,
    job_uid: str,
    read: Mapping[Key, dict[str, Any] | None] | None = None,
) -> tuple[list[dict[str, Any]], list[Conflict]]:
    """write_child for each of `objs` at once (owned: among `observed`, the job's); the objects
    as stored and the conflicts. `read`: children already read (read_children), not read again."""
    owned = {key(o) for o in observed if owned_by(o, job_uid)}
    done = read or {}
    results = await asyncio.gather(
        *(
            write_child(
                kube, obj, job_uid=job_uid, owned=key(obj) in owned,
                existing=done.get(key(obj), UNREAD),
            )
            for obj in objs
        )
    )  # fmt: skip
    stored = [r for r in results if not isinstance(r, Conflict)]
    return stored, [r for r in results if isinstance(r, Conflict)]
