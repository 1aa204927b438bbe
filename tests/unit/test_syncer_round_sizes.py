"""The syncer's side of each island's round (syncer/state/round_sizes.py): readings once per
reference round, H_i from the island's own step time, the push bound that follows, and a liar
that moves only its own round. Expected values derived by hand in the comments."""

from __future__ import annotations

from diloco_trainer.api.spec import parse_spec
from diloco_trainer.syncer.state import IslandRecord, RoundSizes
from diloco_trainer.syncer.state.round_sizes import island_index


def _job(**inner: object) -> RoundSizes:
    spec = parse_spec(
        {
            "inner": {"steps": 30, "stepsPerIsland": "auto", **inner},
            "islands": {"count": 4, "overrides": [{"islands": [2], "innerSteps": 12}]},
            "sync": {"overlapSteps": 5},
        }
    )
    return RoundSizes(spec)


def _islands(times: list[float]) -> list[IslandRecord]:
    return [IslandRecord(name=f"island-{i}", step_time=t) for i, t in enumerate(times)]


def test_island_index() -> None:
    assert island_index("island-3") == 3
    assert island_index("eu-island-12") == 12
    assert island_index("node-3") is None


def test_a_slow_island_gets_a_third_of_the_round_at_its_first_report() -> None:
    sizes = _job()
    recs = _islands([1.0, 1.0, 1.0, 3.0])
    slow = recs[3]
    sizes.joined(slow)
    assert sizes.steps_of(slow, slow.name) == 30  # H until measured
    # every island has reported: its first report is read at once; t_ref = lower median of
    # 1,1,1,3 = 1 s, target 30 x 1 / 3 = 10, taken at once (fresh)
    sizes.read(slow, recs, now=0.0)
    assert sizes.steps_of(slow, slow.name) == 10
    # the next reading only a reference round (H x t_ref = 30 s) later
    recs[3].step_time = 6.0  # target 5: would count as a reading
    sizes.read(slow, recs, now=29.0)
    assert slow.round is not None and slow.round.pending == 0
    recs[3].step_time = 3.0
    sizes.read(slow, recs, now=30.0)  # reading 2 agrees
    assert sizes.steps_of(slow, slow.name) == 10
    # its pushes may carry 4 x the longer of its two last rounds + overlapSteps: 4 x 30 + 5
    assert sizes.max_push_steps(slow, slow.name) == 125
    # a fast island keeps H
    fast = recs[0]
    sizes.joined(fast)
    for now in (0.0, 30.0, 60.0, 90.0):
        sizes.read(fast, recs, now=now)
    assert sizes.steps_of(fast, fast.name) == 30
    assert sizes.max_push_steps(fast, fast.name) == 4 * 30 + 5


def test_a_liar_moves_only_its_own_round() -> None:
    sizes = _job()
    # island-3 claims a step time of 1 microsecond: the lower median of 1e-6, 1, 1, 2 is 1
    recs = _islands([1.0, 1.0, 2.0, 1e-6])
    honest = recs[0]
    sizes.joined(honest)
    for now in (0.0, 30.0, 60.0, 90.0, 120.0):
        sizes.read(honest, recs, now=now)
    assert sizes.steps_of(honest, honest.name) == 30  # its own 1 s against t_ref 1 s


def test_a_pinned_island_is_never_read() -> None:
    sizes = _job()
    recs = _islands([1.0, 1.0, 5.0, 1.0])
    pinned = recs[2]
    sizes.joined(pinned)
    for now in (0.0, 30.0, 60.0, 90.0):
        sizes.read(pinned, recs, now=now)
    assert sizes.steps_of(pinned, pinned.name) == 12
    assert sizes.max_push_steps(pinned, pinned.name) == 4 * 12 + 5


def test_fixed_rounds_are_never_read() -> None:
    sizes = _job(stepsPerIsland="fixed")
    recs = _islands([1.0, 1.0, 1.0, 3.0])
    slow = recs[3]
    sizes.joined(slow)
    for now in (0.0, 30.0, 60.0, 90.0):
        sizes.read(slow, recs, now=now)
    assert sizes.steps_of(slow, slow.name) == 30


def test_a_fresh_islands_first_report_waits_for_its_peers_reports() -> None:
    sizes = _job()
    recs = _islands([1.0, 0.0, 1.0, 3.0])  # island-1 has not reported yet
    slow = recs[3]
    sizes.joined(slow)
    # 3 of 4 reported: the reference (lower median of 1, 1, 3 = 1) is not the job's yet, so
    # the first report only starts the clock, as for a rejoin
    sizes.read(slow, recs, now=0.0)
    assert sizes.steps_of(slow, slow.name) == 30
    sizes.read(slow, recs, now=29.0)  # H x t_ref = 30 s not passed: no reading
    assert sizes.steps_of(slow, slow.name) == 30
    sizes.read(slow, recs, now=30.0)  # reading 1, still fresh: 10 at once
    assert sizes.steps_of(slow, slow.name) == 10


def test_a_rejoined_island_is_read_a_reference_round_after_its_first_report() -> None:
    sizes = _job()
    recs = _islands([1.0, 1.0, 1.0, 3.0])
    slow = recs[3]
    sizes.joined(slow)
    sizes.read(slow, recs, now=0.0)  # first reading: 10
    sizes.joined(slow)  # its learner restarted: its round stays, its clock restarts
    recs[3].step_time = 1.0  # target 30 (a warm-up figure, say)
    sizes.read(slow, recs, now=100.0)  # starts the clock: no reading
    sizes.read(slow, recs, now=101.0)
    assert slow.round is not None and slow.round.pending == 0
    assert sizes.steps_of(slow, slow.name) == 10


def test_a_probe_near_the_reference_waits_for_the_regular_reading() -> None:
    sizes = _job()
    recs = _islands([1.0, 1.0, 1.0, 1.5])  # target 30 x 1 / 1.5 = 20: more than half of 30
    noisy = recs[3]
    sizes.joined(noisy)
    sizes.read(noisy, recs, now=0.0)  # every island reported, but the probe is no reading
    assert sizes.steps_of(noisy, noisy.name) == 30
    recs[3].step_time = 1.1  # its regular reading, H x t_ref = 30 s later: target 27, within 20%
    sizes.read(noisy, recs, now=30.0)
    assert sizes.steps_of(noisy, noisy.name) == 30
    assert noisy.round is not None and not noisy.round.fresh


def test_the_budget_is_split_once_a_round_moves_and_stays_split() -> None:
    """No pin: while every island's round is H, no split (each island keeps its share of 1/M,
    as with stepsPerIsland fixed); the slow island's round moving to 10 splits it for good."""
    spec = parse_spec({"inner": {"steps": 30, "stepsPerIsland": "auto"}, "islands": {"count": 4}})
    sizes = RoundSizes(spec)
    recs = _islands([1.0, 1.0, 1.0, 1.0])
    for rec in recs:
        sizes.joined(rec)
    # equal islands, readings within the band (target 30 x 1 / 1.3 = 23): all keep H, no split
    recs[3].step_time = 1.3
    for now in (0.0, 30.0, 60.0, 90.0):
        sizes.read(recs[3], recs, now=now)
    assert sizes.steps_of(recs[3], recs[3].name) == 30 and not sizes.split
    # island-3 slows to 3 s: target 10, beyond the band twice in a row -> 10, and split
    recs[3].step_time = 3.0
    sizes.read(recs[3], recs, now=120.0)
    sizes.read(recs[3], recs, now=150.0)
    assert sizes.steps_of(recs[3], recs[3].name) == 10 and sizes.split
    # it recovers (target 30, confirmed after the cooldown): its round is H again, still split
    recs[3].step_time = 1.0
    for now in (180.0, 210.0, 240.0, 270.0):
        sizes.read(recs[3], recs, now=now)
    assert sizes.steps_of(recs[3], recs[3].name) == 30 and sizes.split


def test_a_pin_other_than_h_splits_the_budget_from_the_start() -> None:
    assert _job().split  # island 2 pinned at 12, H = 30
