"""Which credential may call which route of the syncer (api/credentials.py says what each is).

The auth middleware (http.py) verifies the bearer token once per request and keeps who it speaks
for on the request; routes that act as an island check that name against it once they have
parsed it (the island of a push is in its body's metadata, which the push path reads once). A
refusal is a 403 naming the credential and what it may not do; the island's state is untouched.
"""

from __future__ import annotations

from aiohttp import web

from diloco_trainer.api import credentials
from diloco_trainer.api.credentials import Principal
from diloco_trainer.syncer.errors import Refused

PRINCIPAL = web.RequestKey("principal", Principal)  # the request's verified Principal


def authenticate(root: str, token: str) -> Principal:
    """The principal `token` speaks for; Refused(403) when it is no credential of this job."""
    principal = credentials.verify(root, token)
    if principal is None:
        raise Refused(403, "invalid bearer token")
    return principal


def require_membership(principal: Principal, island: str) -> None:
    """Refused(403) unless `principal` may drop or re-add `island`."""
    if not principal.may_set_membership(island):
        raise Refused(
            403,
            f"{principal.describe()} may not set the membership of island {island!r} (the "
            "operator's route; islands' credentials cannot call it)",
        )


def principal_of(request: web.Request) -> Principal:
    """The principal the auth middleware stored on the request (root when there is none: the
    handlers called directly, without the middleware, in unit tests)."""
    return request.get(PRINCIPAL) or Principal(credentials.ROOT)
