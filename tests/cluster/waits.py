"""Waits of the cluster tests: the harness's polls (hack/localcluster/polling.py), failing the
test on a timeout with one message, and the one deadline the tests share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from hack.localcluster import harness
from hack.localcluster.harness import StoppedHolding, WaitTimeout

T = TypeVar("T")

# Seconds; generous for a loaded 2-core machine: waits end as soon as their condition holds.
WAIT = 180.0


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 60.0,
    interval: float = 0.2,
    message: str = "condition",
) -> T:
    """Poll predicate() until it returns a truthy value and return that value.

    Fails the test after `timeout` seconds, quoting the last exception raised by predicate.
    """
    try:
        return harness.poll_until(
            predicate, timeout=timeout, interval=interval, what=message, ignore=(Exception,)
        )
    except WaitTimeout as e:
        error = str(e)  # failed outside the handler: the report shows one message, no chain
    pytest.fail(error)


def holds_for(
    predicate: Callable[[], bool],
    duration: float = 3.0,
    interval: float = 0.2,
    message: str = "condition",
) -> None:
    """Check predicate() repeatedly for `duration` seconds; fail the first time it is false."""
    try:
        harness.holds_for(predicate, duration=duration, interval=interval, what=message)
        return
    except StoppedHolding as e:
        error = str(e)
    pytest.fail(error)


def elapsed_until(predicate: Callable[[], Any], timeout: float, message: str) -> float:
    """Seconds until predicate() is truthy (fails the test after `timeout`)."""
    started = time.monotonic()
    wait_until(predicate, timeout=timeout, interval=0.05, message=message)
    return time.monotonic() - started
