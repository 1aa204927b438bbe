"""Errors meant for the user, progress lines, and log tails."""

from __future__ import annotations

import sys
from pathlib import Path


class ClusterError(Exception):
    """A failure with a message meant for the user (and maybe a component name).

    retryable: a fresh attempt (new ports, new data dir) may well succeed, e.g. a component
    died or missed its deadline; not so for a missing tool or a failed build.
    """

    def __init__(self, message: str, component: str | None = None, retryable: bool = False):
        super().__init__(message)
        self.component = component
        self.retryable = retryable


def info(msg: str) -> None:
    print(f"[local-cluster] {msg}", file=sys.stderr, flush=True)


def tail(path: Path, lines: int = 40) -> str:
    try:
        data = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(data[-lines:])


def failure_text(e: BaseException) -> str:
    if isinstance(e, ClusterError):
        return str(e)
    if isinstance(e, KeyboardInterrupt):
        return str(e) or "interrupted"
    return f"{type(e).__name__}: {e}"
