"""Polling with a deadline, for tests and benchmarks (stdlib only)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """poll_until ran past its deadline."""


class StoppedHolding(AssertionError):
    """holds_for saw its condition turn false."""


def poll_until(
    predicate: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.2,
    what: str = "condition",
    ignore: tuple[type[Exception], ...] = (),
) -> T:
    """Call predicate() until it returns a truthy value, and return that value.

    Exceptions of the `ignore` types count as "not yet" (the last one is quoted if the deadline
    passes); any other exception propagates at once. Raises WaitTimeout after `timeout` s.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ignore as e:
            last_error = e
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


def holds_for(
    predicate: Callable[[], bool],
    *,
    duration: float = 3.0,
    interval: float = 0.2,
    what: str = "condition",
) -> None:
    """Check predicate() repeatedly for `duration` seconds; raise the first time it is false."""
    deadline = time.monotonic() + duration
    checks = 0
    while True:
        if not predicate():
            raise StoppedHolding(f"{what} stopped holding after {checks} checks")
        checks += 1
        if time.monotonic() >= deadline:
            return
        time.sleep(interval)
