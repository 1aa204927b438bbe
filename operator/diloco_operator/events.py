"""Kubernetes Events on a DiLoCoJob: what happened to it, for `kubectl describe`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf

log = logging.getLogger("diloco_operator")


def post_event(body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    """Post an Event (type `kind`: Normal or Warning) on the job, and log it."""
    # LookupError: outside kopf's context (never in the operator): log only.
    with contextlib.suppress(LookupError):
        # A Kubernetes object is what kopf's RawBody types; kopf reads its metadata only.
        kopf.event(
            kopf.Body(cast(kopf.RawBody, dict(body))), type=kind, reason=reason, message=message
        )
    meta = body["metadata"]
    log.info("%s/%s: %s %s", meta["namespace"], meta["name"], reason, message)
