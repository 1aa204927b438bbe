"""Times as Kubernetes writes them (RFC 3339, UTC, whole seconds), and as the syncer sends them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

# 9999-12-31T23:59:59Z: later Unix times (from a confused or hostile syncer) are not shown.
MAX_UNIX_SECONDS = 253402300799


def rfc3339(moment: datetime) -> str:
    """UTC time in the form Kubernetes uses: 2024-01-02T03:04:05Z."""
    return moment.astimezone(UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    """Parse an RFC 3339 time as written by rfc3339() or the API server."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def time_field(value: Any) -> str | None:
    """A syncer time (Unix seconds or an ISO string) as RFC 3339, None when absent."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        if not 0 < value < MAX_UNIX_SECONDS:
            return None  # also NaN; a time past year 9999 cannot be written
        return rfc3339(datetime.fromtimestamp(float(value), tz=UTC))
    parsed = parse_time(str(value))
    return rfc3339(parsed) if parsed else None
