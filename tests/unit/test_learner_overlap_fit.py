"""sync.overlapMode auto: τ fitted to the measured sync latency (overlap.fit_overlap,
overlap.sync_latency, overlap.OverlapFit), each push planned with the τ it was made with
(plan_step's windows), and a learner that applies a fast merge at its push step."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.core.compress import encode_tensors, encoded_nbytes, wire_bytes_per_value
from diloco_trainer.learner.overlap import (
    FIRST_OVERLAP,
    OVERLAP_FREE_SHARE,
    OverlapFit,
    auto_overlap_cap,
    fit_overlap,
    join_latency,
    sync_latency,
)
from diloco_trainer.learner.step_plan import plan_idle, plan_step

from .test_learner_fragment_sync import FakeLink, make_spec, make_sync, step


def fit(latency: float | None, *, mode: str = "auto", cap: int = 5, step_time: float = 0.45) -> int:
    return fit_overlap(
        mode=mode, cap=cap, latency=latency, step_time=step_time, inner_steps=30, fragments=2
    )


def test_fit_overlap_is_the_fewest_steps_that_leave_a_wait_under_1_percent() -> None:
    # H = 30, F = 2, 0.45 s a step: a round is 13.5 s, 1% of it 0.135 s, so each of the two
    # pushes may wait 0.0675 s: τ = ceil((L - 0.0675) / 0.45).
    assert OVERLAP_FREE_SHARE == 0.01
    assert fit(0.0) == 0
    assert fit(0.06) == 0
    assert fit(0.067) == 0
    assert fit(0.07) == 1  # ceil(0.0025 / 0.45)
    assert fit(0.5175) == 1  # (0.5175 - 0.0675) / 0.45 = 1 exactly: one step, no more
    assert fit(0.52) == 2  # ceil(1.0056)
    assert fit(1.0) == 3  # ceil(2.07)
    assert fit(2.4) == 5  # ceil(5.18) = 6, at most the cap
    assert fit(30.0) == 5
    assert fit(30.0, cap=3) == 3
    assert fit(1.0, cap=0) == 0  # sync.overlapSteps 0: never overlap
    # A GPU island (gpt-125m on the H200: 0.054 s a step, H = 40, merges back in 1.6 s): the cap.
    gpu = fit_overlap(mode="auto", cap=5, latency=1.6, step_time=0.054, inner_steps=40, fragments=2)
    assert gpu == 5


def test_fit_overlap_is_the_cap_when_fixed_and_one_step_until_measured() -> None:
    assert fit(0.0, mode="fixed") == 5
    assert fit(None, mode="fixed") == 5
    assert FIRST_OVERLAP == 1
    assert fit(None) == 1  # a job's first pushes: nothing measured
    assert fit(float("nan")) == 1
    assert fit(0.01, step_time=0.0) == 1  # no step measured yet
    assert fit(None, cap=0) == 0
    with pytest.raises(ValueError, match=r"sync\.overlapMode"):
        fit(0.1, mode="eager")
    with pytest.raises(ValueError, match=r"sync\.overlapSteps"):
        fit(0.1, cap=-1)


def test_sync_latency_adds_push_merge_pull_at_the_push_rate_and_rebuild() -> None:
    # Push 1000 bytes in 0.2 s; the pull's 3000 bytes at that rate take 0.6 s.
    got = sync_latency(
        push_seconds=0.2, push_bytes=1000, merge_seconds=0.5, pull_bytes=3000, rebuild_seconds=0.1
    )
    assert got == pytest.approx(0.2 + 0.5 + 0.6 + 0.1)
    assert sync_latency(push_seconds=0.2, push_bytes=0, merge_seconds=0.5, pull_bytes=10) == 0.7
    # The pull's own time measured (its time less the syncer's long-poll hold): taken as it is.
    measured = sync_latency(
        push_seconds=0.2,
        push_bytes=1000,
        merge_seconds=0.5,
        pull_bytes=3000,
        pull_seconds=0.05,
        rebuild_seconds=0.1,
    )
    assert measured == pytest.approx(0.2 + 0.5 + 0.05 + 0.1)
    # An older syncer says no mergeSeconds: nothing is known.
    none = sync_latency(push_seconds=0.2, push_bytes=1000, merge_seconds=None, pull_bytes=3000)
    assert none is None


def test_plan_step_keeps_each_in_flight_push_at_its_own_window() -> None:
    # H = 30, offsets 0 and 15. Fragment 0 was pushed at 30 with τ = 5; τ is 0 now.
    common: dict[str, Any] = {"inner_steps": 30, "offsets": [0, 15], "overlap": 0}
    inflight = {"pushed_at": {0: 30}, "windows": {0: (5, 5)}}
    for s in range(31, 35):
        assert plan_step(s, **common, **inflight).wait == ()
        assert plan_step(s, **common, **inflight).poll == ()
    assert plan_step(35, **common, **inflight).wait == (0,)
    # Without its window the same push would be waited for at once (τ = 0) and then only polled.
    assert plan_step(31, **common, pushed_at={0: 30}).poll == (0,)
    # Fragment 1, pushed now at 45 with τ = 0, is waited for at its push step; fragment 0's
    # window (pushed at 42, deadline 5) still holds.
    plan = plan_step(45, **common, pushed_at={0: 42}, windows={0: (5, 5)})
    assert plan.push == (1,) and plan.wait == (1,) and plan.poll == ()
    assert plan_step(47, **common, pushed_at={0: 42}, windows={0: (5, 5)}).wait == (0,)
    # A fragment pushed now takes the current window even if an old one is listed for it.
    again = plan_step(60, **common, pushed_at={}, windows={0: (5, 5)})
    assert again.push == (0,) and again.wait == (0,)
    with pytest.raises(ValueError, match="first poll"):
        plan_step(31, **common, pushed_at={0: 30}, windows={0: (3, 2)})


def test_plan_idle_polls_each_push_from_its_own_first_poll() -> None:
    assert plan_idle(32, overlap=1, pushed_at={0: 30}, windows={0: (5, 5)}).poll == ()
    assert plan_idle(35, overlap=1, pushed_at={0: 30}, windows={0: (5, 5)}).poll == (0,)
    assert plan_idle(31, overlap=1, pushed_at={0: 30}).poll == (0,)


def test_overlap_fit_uses_the_slowest_recent_sync_and_the_spec_windows() -> None:
    spec = parse_spec(
        {"islands": {"count": 4}, "inner": {"steps": 30}, "sync": {"quorum": 4, "fragments": 2}}
    )
    assert spec.sync.overlap_mode == "auto" and spec.sync.overlap_steps == 5
    fitter = OverlapFit(spec, blocking=True)
    assert fitter.fit(0.45) == 1  # nothing measured yet: one step
    assert fitter.latest == 5  # no push yet: the cap
    fitter.pushed(1, 0.45, 30)
    assert fitter.latest == 1
    fitter.observe(None)
    assert fitter.fit(0.45) == 1
    fitter.observe(0.05)
    assert fitter.fit(0.45) == 0 and fitter.window(0) == (0, 0)
    fitter.observe(2.0)  # one slow merge: ceil((2.0 - 0.0675) / 0.45) = 5
    assert fitter.fit(0.45) == 5
    for _ in range(3):
        fitter.observe(0.1)
    assert fitter.fit(0.45) == 5  # 2.0 is still among the last 4
    fitter.observe(0.1)
    assert fitter.fit(0.45) == 1  # ceil((0.1 - 0.0675) / 0.45)
    assert fitter.window(1) == (1, 1)
    late = parse_spec(
        {
            "islands": {"count": 4},
            "inner": {"steps": 30},
            "sync": {"quorum": 4, "mergeWait": "nextPush", "applyFrom": "arrival"},
        }
    )
    assert OverlapFit(late, blocking=True).window(3) == (1, 29)
    assert OverlapFit(late, blocking=False).window(3) == (1, 3)
    fixed = parse_spec({"inner": {"steps": 30}, "sync": {"overlapMode": "fixed"}})
    pinned = OverlapFit(fixed, blocking=True)
    pinned.observe(0.0)
    assert pinned.fit(0.45) == 5


def test_a_learner_that_never_blocks_fits_tau_too_up_to_overlap_steps() -> None:
    """Issue 47: at K < M τ is fitted as at K = M (H = 30, F = 2, t = 0.45 s: the 1% allowance
    is 0.01 x 30 x 0.45 / 2 = 0.0675 s), capped at overlapSteps (5), not H − 1 (29)."""
    spec = parse_spec(
        {"islands": {"count": 4}, "inner": {"steps": 30}, "sync": {"quorum": 1, "fragments": 2}}
    )
    decoupled = OverlapFit(spec, blocking=False)
    blocking = OverlapFit(spec, blocking=True)
    assert decoupled.fit(0.45) == 1  # nothing measured yet: one step, as at K = M
    decoupled.observe(0.0)
    assert decoupled.fit(0.45) == 0  # a sync hidden within the allowance: no kept step
    decoupled.observe(0.5)  # ceil((0.5 - 0.0675) / 0.45) = ceil(0.961) = 1
    assert decoupled.fit(0.45) == 1
    decoupled.observe(1.0)  # ceil((1.0 - 0.0675) / 0.45) = ceil(2.072) = 3
    assert decoupled.fit(0.45) == 3
    for fitter in (decoupled, blocking):
        fitter.observe(3.0)  # ceil((3.0 - 0.0675) / 0.45) = ceil(6.517) = 7
    assert blocking.fit(0.45) == 7
    assert decoupled.fit(0.45) == 5  # at most overlapSteps at K < M
    # It never waits: the deadline is τ itself, where it only polls (step_plan).
    assert decoupled.window(3) == (3, 3)
    fixed = parse_spec(
        {
            "islands": {"count": 4},
            "inner": {"steps": 30},
            "sync": {"quorum": 1, "overlapMode": "fixed"},
        }
    )
    pinned = OverlapFit(fixed, blocking=False)
    pinned.observe(0.0)
    assert pinned.fit(0.45) == 5  # fixed: overlapSteps, as before


@pytest.mark.parametrize(
    ("mode", "quorum", "latency", "applied"),
    [
        # First τ = 1 (nothing measured); then 0.001 s <= 1% of 4 steps of 0.1 s: τ = 0.
        ("auto", 2, 0.001, [5, 8, 12]),
        ("auto", 2, 0.15, [5, 10, 14]),  # then ceil((0.15 - 0.004) / 0.1) = 2
        ("fixed", 2, 0.001, [6, 10, 14]),
        # K < M (issue 47): the learner never blocks, and its τ is fitted as at K = M ...
        ("auto", 1, 0.001, [5, 8, 12]),
        ("auto", 1, 0.15, [5, 10, 14]),
        # ... up to overlapSteps (2), where a blocking one goes up to H - 1 = 3:
        # ceil((0.25 - 0.004) / 0.1) = 3, so τ = 3 at K = M (applied at 11) and 2 at K < M.
        ("auto", 1, 0.25, [5, 10, 14]),
        ("auto", 2, 0.25, [5, 11]),
        ("fixed", 1, 0.001, [6, 10, 14]),  # fixed at K < M: the cap, as before
    ],
)
def test_a_blocking_learner_applies_a_fast_merge_at_its_push_step(
    mode: str,
    quorum: int,
    latency: float,
    applied: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # H = 4, one fragment, overlapSteps 2, K = M = 2 (or K = 1): the first push (step 4) is
    # made with τ = 1 under auto, as nothing is measured (the cap under fixed);
    # every later one with the τ its predecessor's latency gives.
    caplog.set_level(logging.INFO, logger="diloco.learner")
    link = FakeLink(outer_lr=0.25, latency=latency)
    sync, w = make_sync(make_spec(quorum=quorum, overlapMode=mode), link)
    assert sync.blocking == (quorum == 2)
    got = [s for s in range(1, 15) if step(sync, w)]
    assert got == applied
    # Each push carries the 4 steps since the previous one (a receipt keeps the steps since its
    # push in the counters), whatever τ was.
    assert [meta.steps for _, meta, _ in link.pushes] == [4, 4, 4]
    changes = [
        (int(m.group(1)), int(m.group(2)))
        for r in caplog.records
        if (m := re.match(r"step (\d+): pushes overlap (\d+) step", r.getMessage()))
    ]
    taus = {4: applied[0] - 4, 8: applied[1] - 8}  # the τ of the pushes at 4 and 8
    assert changes == [(4, taus[4])] + ([(8, taus[8])] if taus[8] != taus[4] else [])


def test_auto_fits_a_blocking_learner_up_to_h_minus_one_not_overlap_steps() -> None:
    """Issue 45: a sync may take most of a round; auto's cap is H − 1 (overlapSteps if larger)."""
    assert auto_overlap_cap(overlap_steps=5, inner_steps=30) == 29
    assert auto_overlap_cap(overlap_steps=40, inner_steps=30) == 40
    assert auto_overlap_cap(overlap_steps=1, inner_steps=1) == 1
    assert auto_overlap_cap(overlap_steps=0, inner_steps=30) == 0  # no overlap asked for
    with pytest.raises(ValueError):
        auto_overlap_cap(overlap_steps=-1, inner_steps=30)
    spec = parse_spec(
        {"islands": {"count": 4}, "inner": {"steps": 30}, "sync": {"quorum": 4, "fragments": 2}}
    )
    fitter = OverlapFit(spec, blocking=True)
    fitter.observe(5.0)
    # allowance 0.01 x 30 x 0.45 / 2 = 0.0675 s: ceil((5.0 - 0.0675) / 0.45) = ceil(10.96) = 11,
    # where the old cap (overlapSteps, 5) stopped at 5.
    assert fitter.fit(0.45) == 11
    fitter.observe(100.0)
    assert fitter.fit(0.45) == 29  # at most H - 1
    # fixed and a learner that does not block keep overlapSteps.
    decoupled = OverlapFit(spec, blocking=False)
    decoupled.observe(100.0)
    assert decoupled.fit(0.45) == 5
    fixed = parse_spec({"inner": {"steps": 30}, "sync": {"quorum": 1, "overlapMode": "fixed"}})
    pinned = OverlapFit(fixed, blocking=True)
    pinned.observe(100.0)
    assert pinned.fit(0.45) == 5


def test_covered_latency_is_the_own_sync_or_the_whole_push_to_merge_time() -> None:
    from diloco_trainer.learner.overlap import covered_latency

    assert covered_latency(covers="sync", latency=0.3, seconds=0.8) == 0.3
    assert covered_latency(covers="merge", latency=0.3, seconds=0.8) == 0.8
    assert covered_latency(covers="merge", latency=0.3, seconds=0.2) == 0.3  # never below
    assert covered_latency(covers="merge", latency=None, seconds=0.8) is None
    with pytest.raises(ValueError):
        covered_latency(covers="all", latency=0.3, seconds=0.8)


def test_a_blocking_learner_fits_the_whole_merge_time_under_overlap_covers_merge() -> None:
    import dataclasses

    class SlowMerge(FakeLink):
        """Each merge back 0.75 s after the push, 0.15 s of it the learner's own sync."""

        async def sync_fragment(self, *args: Any, **kwargs: Any) -> Any:
            result = await super().sync_fragment(*args, **kwargs)
            return dataclasses.replace(result, seconds=0.75)

    # At 0.1 s a step (H = 4, F = 1: an allowance of 0.004 s), "sync" fits ceil(1.46) = 2
    # steps, "merge" ceil(7.46) = 8, capped at H - 1 = 3.
    for covers, seen, tau in (("sync", 0.15, 2), ("merge", 0.75, 3)):
        link = SlowMerge(outer_lr=0.25, latency=0.15)
        sync, w = make_sync(make_spec(quorum=2, overlapCovers=covers), link)
        for _ in range(5):  # pushed at step 4 with τ = 1 (nothing measured), received at 5
            step(sync, w)
        assert sync.overlap_fit.latency == seen
        assert sync.overlap_fit.fit(0.1) == tau


def join(
    seconds: list[float | None],
    *,
    nbytes: list[int] | None = None,
    values: int = 2000,
    push: str = "int8",
    pull: str = "int8",
) -> float | None:
    return join_latency(
        pull_bytes=[4000] * len(seconds) if nbytes is None else nbytes,
        pull_seconds=seconds,
        values=values,
        fragments=len(seconds),
        push_codec=push,
        pull_codec=pull,
    )


def test_wire_bytes_per_value_counts_the_codecs_scales() -> None:
    assert wire_bytes_per_value("none") == 4.0
    assert wire_bytes_per_value("fp16") == 2.0
    assert wire_bytes_per_value("bf16") == 2.0
    assert wire_bytes_per_value("int8") == 1.03125  # 1 + 4/128
    assert wire_bytes_per_value("int4") == 0.53125  # 1/2 + 4/128
    with pytest.raises(ValueError):
        wire_bytes_per_value("int2")
    # What the codecs put on the wire for 1280 values (10 blocks), counted from a real encoding.
    x = {"w": torch.linspace(-1.0, 1.0, 1280)}
    for codec in ("none", "fp16", "bf16", "int8", "int4"):
        sent = encoded_nbytes(encode_tensors(x, codec))
        assert sent == 1280 * wire_bytes_per_value(codec), codec


def test_join_latency_scales_the_joins_seconds_per_byte_to_a_syncs_bytes() -> None:
    """Issue 45: the join's pulls (full fp32 weights) give the link's seconds per byte; a sync
    moves one mean fragment up in the push codec and down in the pull codec."""
    # Two fragments of 4000 bytes (1000 fp32 values each) in 0.1 s each: 0.2 / 8000 =
    # 2.5e-5 s a byte. A sync of a 1000-value fragment, int8 both ways: 1000 x 2 x 1.03125 =
    # 2062.5 bytes -> 0.0515625 s.
    assert join([0.1, 0.1]) == pytest.approx(0.0515625)
    # Uncompressed both ways: 8000 bytes, twice a fragment's pull: 0.2 s.
    assert join([0.1, 0.1], push="none", pull="none") == pytest.approx(0.2)
    # int8 up, fp32 down: 1000 x (1.03125 + 4) = 5031.25 bytes -> 0.1257813 s.
    assert join([0.1, 0.1], pull="none") == pytest.approx(0.12578125)
    # Unequal pulls: 0.3 s for 10000 bytes is 3e-5 s a byte; 2000 values over 2 fragments.
    assert join([0.1, 0.2], nbytes=[4000, 6000]) == pytest.approx(3e-5 * 2062.5)
    assert join([-0.1, 0.2]) == pytest.approx(0.2 / 8000 * 2062.5)  # a negative reading: 0
    assert join([]) is None  # no pull
    assert join([0.1, None]) is None  # an older syncer did not say its hold
    assert join([float("nan"), 0.1]) is None
    assert join([0.1, 0.1], nbytes=[0, 0]) is None
    assert join([0.1, 0.1], values=0) is None


def test_a_blocking_learners_first_pushes_fit_the_joins_estimate() -> None:
    # H = 30, F = 2, 0.03 s a step: the 1% allowance is 0.01 x 30 x 0.03 / 2 = 0.0045 s.
    spec = parse_spec(
        {"islands": {"count": 4}, "inner": {"steps": 30}, "sync": {"quorum": 4, "fragments": 2}}
    )
    assert spec.sync.compression == "int8"

    def joined(fitter: OverlapFit, seconds: list[float | None], pull: str = "int8") -> None:
        # Two fragments of 1000 values, 4000 bytes each at the join (fp32).
        fitter.joined(pull_bytes=[4000, 4000], pull_seconds=seconds, values=2000, pull_codec=pull)

    fitter = OverlapFit(spec, blocking=True)
    assert fitter.fit(0.03) == 1  # no join seen: FIRST_OVERLAP
    # The join's pulls took 0.4 s each: 0.8 / 8000 = 1e-4 s a byte; a sync 2062.5 bytes ->
    # 0.20625 s; τ = ceil((0.20625 - 0.0045) / 0.03) = ceil(6.725) = 7.
    joined(fitter, [0.4, 0.4])
    assert fitter.join_estimate == pytest.approx(0.20625)
    assert fitter.fit(0.03) == 7
    # Pulled uncompressed (pull codec none): 1000 x (1.03125 + 4) x 1e-4 = 0.503125 s,
    # ceil((0.503125 - 0.0045) / 0.03) = ceil(16.62) = 17.
    none = OverlapFit(spec, blocking=True)
    joined(none, [0.4, 0.4], pull="none")
    assert none.fit(0.03) == 17
    # A fast link (1 ms pulls): 2.5e-7 x 2062.5 = 0.0005 s, under the allowance: τ = 0.
    fast = OverlapFit(spec, blocking=True)
    joined(fast, [0.001, 0.001])
    assert fast.fit(0.03) == 0
    # A slow one: at most H - 1 = 29, as any fitted τ.
    slow = OverlapFit(spec, blocking=True)
    joined(slow, [10.0, 10.0])
    assert slow.fit(0.03) == 29
    # The first sync measured replaces the estimate: 0.09 s -> ceil((0.09 - 0.0045) / 0.03) = 3.
    fitter.observe(0.09)
    assert fitter.fit(0.03) == 3
    # An older syncer (no pull seconds) or an unknown pull codec: one step, as before.
    unknown = OverlapFit(spec, blocking=True)
    joined(unknown, [0.4, None])
    assert unknown.fit(0.03) == 1
    joined(unknown, [0.4, 0.4], pull="zstd")
    assert unknown.fit(0.03) == 1
    # K < M never waits: its first τ stays FIRST_OVERLAP whatever the join took.
    decoupled = OverlapFit(spec, blocking=False)
    joined(decoupled, [0.4, 0.4])
    assert decoupled.fit(0.03) == 1
    # fixed: the cap.
    fixed = parse_spec(
        {"islands": {"count": 4}, "inner": {"steps": 30}, "sync": {"overlapMode": "fixed"}}
    )
    pinned = OverlapFit(fixed, blocking=True)
    joined(pinned, [0.4, 0.4])
    assert pinned.fit(0.03) == 5


@pytest.mark.parametrize(
    ("quorum", "applied"),
    [
        # K = M = 2, H = 4, one fragment of 2 values, compression none (make_spec), pulled
        # uncompressed: the join's pull of 8 bytes in 0.075 s is 0.009375 s a byte, a sync
        # 2 x 2 x 4 = 16 bytes -> 0.15 s; 0.1 s a step, allowance 0.01 x 4 x 0.1 = 0.004 s:
        # τ = ceil((0.15 - 0.004) / 0.1) = 2. The first push (step 4) is applied at 6, not 5
        # (τ = 1); later pushes as before.
        (2, [6, 10, 14]),
        (1, [5, 10, 14]),  # K < M: τ = 1 at the first push whatever the join took
    ],
)
def test_the_first_push_at_k_equals_m_overlaps_the_joins_estimate(
    quorum: int, applied: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="diloco.learner")
    link = FakeLink(outer_lr=0.25, latency=0.15)
    sync, w = make_sync(make_spec(quorum=quorum), link)
    sync.overlap_fit.joined(pull_bytes=[8], pull_seconds=[0.075], values=2, pull_codec="none")
    got = [s for s in range(1, 15) if step(sync, w)]
    assert got == applied
    first = next(r.getMessage() for r in caplog.records if "pushes overlap" in r.getMessage())
    if quorum == 2:
        assert "step 4: pushes overlap 2 step(s)" in first
        assert "0.150s estimated from the join's pulls" in first
    else:
        assert "not measured yet" in first
