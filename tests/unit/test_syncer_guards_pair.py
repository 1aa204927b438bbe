"""Issue 46, the rules for a job of two and the claims' ranges, with hand-derived values: no
island's claimed step time moves another's work-rate floor unless three islands claim one; the
learned norm bound of fewer than three islands is the smaller island's median (a ratchet of one
of two gains nothing); an island whose pushes all sit at the bound is reported as a health
problem and the operator's condition names it; stepTime and loss claims outside the job's range
are refused 400 naming the field; the status document never carries a non-finite number."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from diloco_operator.conditions import syncer_health
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.intake import guards
from diloco_trainer.syncer.intake.validation import (
    MAX_LOSS,
    parse_push_meta,
    step_time_limit,
)
from diloco_trainer.syncer.service.status_document import finite_only
from diloco_trainer.syncer.state.problems import AT_BOUND
from diloco_trainer.syncer.state.records import Beat

from .observations import syncer_view
from .test_syncer import FakeClock, body, delta, make_spec, run, started
from .test_syncer_guards import guard, stats


def test_pair_work_rate_floor_needs_three_claims() -> None:
    rate = guard().rate
    # A job of two: the liar's 86400 s does not raise the honest island's 0.2 s (the median of
    # two, 43200, over FASTEST 4 made it 10800 s: every honest push refused).
    assert rate.step_time(0.2, [0.2, 86400.0]) == pytest.approx(0.2)
    # ... and the honest island's 0.2 s no longer lifts the liar's 1 ms (its own word, at least
    # MIN_STEP_TIME): what a job of two cannot promise.
    assert rate.step_time(0.001, [0.2, 0.001]) == pytest.approx(0.001)
    # Three claims: the median is an honest majority's. The slow liar: median(0.2, 0.2, 86400)
    # = 0.2, floor 0.05, the honest island's own 0.2 stands; the fast liar's 1 ms counts as
    # median(0.2, 0.2, 0.001) / 4 = 0.05 s.
    assert rate.step_time(0.2, [0.2, 0.2, 86400.0]) == pytest.approx(0.2)
    assert rate.step_time(0.001, [0.2, 0.2, 0.001]) == pytest.approx(0.05)


def test_pair_learned_bound_is_the_smaller_median_below_three_islands() -> None:
    g = guard(maxDeltaNorm=1e6, normFactor=10, warmupPushes=3)
    for norm in (1.0, 2.0, 3.0):
        g.accepted(0, "a", stats(norm))  # a's median 2
    for norm in (4.0, 5.0, 6.0):
        g.accepted(0, "b", stats(norm))  # b's median 5
    # Two islands: min(2, 5) x 10 = 20 (the median of two was 3.5 x 10 = 35).
    assert g.learned_bound(0) == pytest.approx(20.0)
    for norm in (0.5, 0.5, 0.5):
        g.accepted(0, "c", stats(norm))
    # Three: median(2, 5, 0.5) = 2 -> 20; with c at 10 instead, median(2, 5, 10) = 5 -> 50.
    assert g.learned_bound(0) == pytest.approx(20.0)
    for norm in (10.0, 10.0, 10.0, 10.0):
        g.accepted(0, "c", stats(norm))
    assert g.learned_bound(0) == pytest.approx(50.0)
    # Restored medians follow the same rule: two restored [2, 8] -> 2 x 10 = 20 (was 50).
    restored = guard(maxDeltaNorm=1e6, normFactor=10, warmupPushes=3)
    restored.history.restore([[2.0, 8.0], []])
    assert restored.learned_bound(0) == pytest.approx(20.0)


def test_pair_ratchet_of_one_of_two_gains_nothing() -> None:
    """Issue 46, finding 2: with the median of two, each level at 5x was within 10 x the mean of
    the honest median and the attacker's own, so it climbed to the hard cap."""
    g = guard(maxDeltaNorm=1e6, normFactor=10, warmupPushes=3)
    for _ in range(3):
        g.accepted(0, "a", stats(1.0))
    norm, accepted = 1.0, []
    for _ in range(200):
        try:
            g.check_delta(0, "c", stats(norm))
        except guards.ContributionRefused:
            norm /= 5
        else:
            g.accepted(0, "c", stats(norm))
            accepted.append(norm)
        norm *= 5
    # The bound is 10 x min(1, c's median) <= 10, whatever c pushed.
    assert max(accepted) <= 10.0
    assert g.learned_bound(0) == pytest.approx(10.0)
    # The honest island is judged by the same 10: its own pushes at 1 are far inside.
    g.check_delta(0, "a", stats(1.0))


def test_pair_detection_names_an_island_at_the_bound() -> None:
    g = guard(maxDeltaNorm=1e6, normFactor=10, warmupPushes=3)
    for _ in range(3):
        g.accepted(0, "a", stats(1.0))  # the bound: 10 x 1 = 10, at-bound from 0.8 x 10 = 8
    for _ in range(guards.AT_BOUND_PUSHES - 1):
        g.check_delta(0, "c", stats(8.0))
        g.check_delta(0, "a", stats(1.0))
    assert g.suspects() == {}  # seven at the bound: not yet
    with pytest.raises(guards.ContributionRefused):
        g.check_delta(0, "c", stats(11.0))  # refused above it counts as at the bound
    assert list(g.suspects()) == ["c"]
    assert "fragment 0" in g.suspects()["c"]
    g.check_delta(0, "c", stats(7.9))  # one push below 8 in its last eight: no longer
    assert g.suspects() == {}
    for _ in range(guards.AT_BOUND_PUSHES):
        g.check_delta(0, "c", stats(9.0))
    assert list(g.suspects()) == ["c"]
    g.forget("c")
    assert g.suspects() == {}


def test_pair_detection_reaches_health_and_the_operator_condition(tmp_path: Path) -> None:
    """An in-process syncer of two islands: one pushes at the bound, the health problem
    islandAtBound is listed and the job's SyncerHealthy condition says IslandPushesAtBound; its
    pushes back near the median clear it."""
    spec = make_spec(
        sync={"quorum": 1, "graceSeconds": 0},
        syncer={
            "guards": {"warmupPushes": 3, "normFactor": 10, "maxRefusals": 0, "maxDeltaNorm": 1e6},
            # Pushes at 0.9 x the bound raise the eval loss: the quality guard (off here) would
            # end the job (test_syncer_quality_guard.py); this test is the detection's.
            "qualityGuard": {"patience": 0},
        },
    )

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        for island in ("island-0", "island-1"):
            await syncer.islands.join(island, 1)
        honest = delta(syncer, 0, 0)
        for _ in range(3):
            for island in ("island-0", "island-1"):
                await syncer.receive_push(0, body(syncer, 0, island, honest))
            await syncer.tick()
        bound = syncer.gate.guard.learned_bound(0)
        assert bound is not None
        norm = math.sqrt(sum(float((t * t).sum()) for t in honest.values()))
        at = {n: t * (0.9 * bound / norm) for n, t in honest.items()}
        for _ in range(guards.AT_BOUND_PUSHES):
            await syncer.receive_push(0, body(syncer, 0, "island-1", at))
            await syncer.tick()
        flagged = await syncer.status()
        await syncer.receive_push(0, body(syncer, 0, "island-1", honest))
        cleared = await syncer.status()
        await syncer.stop()
        return flagged, cleared

    flagged, cleared = run(scenario())
    kinds = [p["kind"] for p in flagged["health"]["problems"]]
    assert kinds == [AT_BOUND]
    assert "island-1" in flagged["health"]["problems"][0]["message"]
    healthy, reason, _ = syncer_health(syncer_view(flagged))
    assert (healthy, reason) == (False, "IslandPushesAtBound")
    assert cleared["health"] == {"healthy": True, "problems": []}
    assert flagged["refusals"] == {}  # at 0.9 x the bound: accepted, only named


def test_pair_step_time_limit_from_the_heartbeat_timeout() -> None:
    assert step_time_limit(30.0) == pytest.approx(600.0)  # 20 x the default timeout
    assert step_time_limit(3600.0) == pytest.approx(72000.0)  # the largest timeout
    assert step_time_limit(1e9) == pytest.approx(86400.0)  # a day at most
    good = protocol.PushMeta("island-0", 0, 10, 1, 1.0, 0.1, "none").to_metadata()
    parse_push_meta({**good, "stepTime": "600"}, "none", 600.0)
    with pytest.raises(Refused) as err:
        parse_push_meta({**good, "stepTime": "600.5"}, "none", 600.0)
    assert err.value.status == 400 and "metadata.stepTime" in err.value.message


@pytest.mark.parametrize("loss", ["1e308", "-1e308", "1000000001"])
def test_pair_push_loss_beyond_the_range_is_refused(loss: str) -> None:
    good = protocol.PushMeta("island-0", 0, 10, 1, 1.0, 0.1, "none").to_metadata()
    with pytest.raises(Refused) as err:
        parse_push_meta({**good, "loss": loss}, "none")
    assert err.value.status == 400 and "metadata.loss" in err.value.message
    parse_push_meta({**good, "loss": str(MAX_LOSS)}, "none")  # at the bound: in


def test_pair_heartbeat_step_time_above_the_limit_is_refused(tmp_path: Path) -> None:
    spec = make_spec(sync={"heartbeatTimeoutSeconds": 30})

    async def scenario() -> tuple[Refused, dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await syncer.islands.heartbeat("island-0", Beat(1, 64, loss=3.0, step_time=600.0))
        with pytest.raises(Refused) as err:
            await syncer.islands.heartbeat("island-0", Beat(1, 64, loss=3.0, step_time=86400.0))
        doc = await syncer.status()
        await syncer.stop()
        return err.value, doc

    err, doc = run(scenario())
    assert err.status == 400 and "heartbeat.stepTime" in err.message and "600" in err.message
    assert doc["islands"]["island-0"]["stepTime"] == pytest.approx(600.0)  # unchanged


def test_pair_status_document_never_carries_non_finite_numbers() -> None:
    doc = {
        "loss": math.inf,
        "evalLoss": -math.inf,
        "islands": {"a": {"loss": math.nan, "stepTime": 0.2, "name": "a", "n": 3}},
        "merges": [{"loss": 1e308 * 10}, {"loss": 5.5}],
        "flag": True,
    }
    out = finite_only(doc)
    assert out == {
        "loss": None,
        "evalLoss": None,
        "islands": {"a": {"loss": None, "stepTime": 0.2, "name": "a", "n": 3}},
        "merges": [{"loss": None}, {"loss": 5.5}],
        "flag": True,
    }
    json.dumps(out, allow_nan=False)  # strict JSON


def test_pair_spec_range_is_the_spec_module_default() -> None:
    spec = parse_spec({"model": {"preset": "gpt-tiny"}})
    assert step_time_limit(spec.sync.heartbeat_timeout_seconds) == pytest.approx(600.0)
