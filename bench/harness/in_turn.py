"""Timing several functions in turn (a, b, a, b, ...) after one untimed run each: a drift of the
machine, its background load or the allocator's state between them falls on all of them alike.
Standard library only, so a torch-only benchmark can use it on a GPU machine."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def times_in_turn(fns: Sequence[Callable[[], object]], repeats: int) -> list[list[float]]:
    """Wall seconds of each of `fns`, `repeats` runs each, taken in turn after a warm-up each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, mine in zip(fns, times, strict=True):
            began = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - began)
    return times
