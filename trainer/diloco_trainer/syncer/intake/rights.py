"""Which island a credential may act as (api/credentials.py says what each credential is): the
routes that act as an island check the name they parsed (join, heartbeat, leave), a push the
name its metadata gives (require_push). A refusal is a 403 naming the credential and what it may
not do; nothing is changed."""

from __future__ import annotations

from collections.abc import Mapping

from diloco_trainer.api import credentials, protocol
from diloco_trainer.api.credentials import Principal
from diloco_trainer.syncer.errors import Refused


def require_island(principal: Principal, island: str, route: str) -> None:
    """Refused(403) unless `principal` may act as `island` (join, push, heartbeat, leave)."""
    if not principal.may_act_as(island):
        raise Refused(403, f"{principal.describe()} may not {route} as island {island!r}")


def require_push(principal: Principal, meta: Mapping[str, str]) -> None:
    """Refused(403) unless `principal` may push as the island a push's metadata (its header,
    read once: validation.read_push_header) names; 400 when it names none. The root may push
    anything: the push path checks the metadata itself."""
    if principal.kind == credentials.ROOT:
        return
    island = meta.get(protocol.META_ISLAND)
    if not island:
        raise Refused(400, f"push metadata has no {protocol.META_ISLAND!r}")
    require_island(principal, island, "push")
