"""The syncer's one error type: a request refused, with the HTTP status the edge answers and a
machine-readable code clients act on. Every sub-package raises it; the edge turns it into an
error body (edge/http.py)."""

from __future__ import annotations


class Refused(Exception):
    """A request the state machine refuses; `status` is the HTTP status the server answers and
    `code` (optional) a machine-readable reason clients can act on (protocol.ERROR_* constants);
    `retry_after` (seconds) is sent as Retry-After with a 503."""

    def __init__(
        self, status: int, message: str, code: str = "", *, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after
