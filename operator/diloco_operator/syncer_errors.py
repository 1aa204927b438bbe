"""What the job's status says about a failed call to its syncer (pure).

A syncer endpoint may be any host the job's author names, so nothing the syncer answers reaches
status.conditions: only a fixed message per class of failure, with the URL from the spec and the
HTTP status. (The operator's log keeps the answer's text, for whoever runs the operator.)
"""

from __future__ import annotations

from diloco_trainer.api.protocol import ERROR_MALFORMED, SyncerError

# SyncerError.code of the operator's own failures before any request: its message is ours.
CODE_CREDENTIALS = "operator_credentials"


def credentials_error(message: str) -> SyncerError:
    """A failure to find a credential to call the syncer with (never sent anywhere)."""
    return SyncerError(0, message, CODE_CREDENTIALS)


def condition_message(err: SyncerError, url: str) -> str:
    """The SyncerReachable message for `err` on a call to the syncer at `url`."""
    status = err.status
    if err.code == CODE_CREDENTIALS:
        return f"no credential to call the syncer with: {err.message}"
    if status == 0:
        return f"syncer {url} did not answer (connection refused, timed out or TLS failed)"
    if err.code == ERROR_MALFORMED:
        return f"syncer {url} answered HTTP {status} with something that is not its document"
    if 300 <= status < 400:
        return f"syncer {url} answered with a redirect (HTTP {status}); redirects are not followed"
    if status in (401, 403):
        return f"syncer {url} refused the operator's credential (HTTP {status})"
    if status >= 500:
        return f"syncer {url} failed (HTTP {status})"
    return f"syncer {url} refused the request (HTTP {status})"
