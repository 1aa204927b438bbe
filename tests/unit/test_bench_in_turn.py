"""bench/harness/in_turn times functions in turn after one warm-up run each: the order is what makes
a drifting machine fall on every function alike."""

from __future__ import annotations

from bench.harness.in_turn import times_in_turn


def test_functions_are_warmed_up_once_then_timed_in_turn() -> None:
    calls: list[str] = []
    times = times_in_turn([lambda: calls.append("a"), lambda: calls.append("b")], repeats=3)
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed ones
    assert [len(t) for t in times] == [3, 3]
    assert all(s >= 0.0 for t in times for s in t)
