"""bench.studies.plan_cost stays what it says: its steps run the learner's plan between sync
points only (no push, receipt or hold), at K = 1 with fragment 0's merge in flight."""

from __future__ import annotations

from bench.studies.plan_cost import INNER_STEPS, PlanBench, make_spec, measure


def test_plan_cost_steps_stay_between_sync_points_without_a_push() -> None:
    bench = PlanBench(make_spec(1))
    try:
        seen = set()
        for _ in range(3 * bench.stretch):
            bench.step(bench.plan)
            seen.add(bench.sync.position)
        # H = 30, F = 2: fragment 1 is due at 45, fragment 0 at 60; the stretch is 31..44.
        assert seen == set(range(INNER_STEPS + 1, INNER_STEPS + 15))
        assert bench.sync.last_push == {}  # nothing pushed (nor pushed again)
        assert list(bench.sync.inflight) == [0] and not bench.pending.done()
        # No hold, no blocking wait: K = 1 asks for its merge at 30 + τ without blocking (the
        # call's µs count as waited).
        assert bench.sync.held_since is None and bench.sync.waited < 0.05
        plan, base = measure(bench, steps=20, repeats=2)
        assert len(plan) == len(base) == 40 and min(plan) > 0 and min(base) > 0
    finally:
        bench.close()


def test_plan_cost_at_k_equal_m_has_nothing_in_flight() -> None:
    bench = PlanBench(make_spec(4))
    try:
        for _ in range(bench.stretch):
            bench.step(bench.plan)
        assert bench.sync.blocking and bench.sync.inflight == {}
        assert bench.in_flight().startswith("nothing")
    finally:
        bench.close()
