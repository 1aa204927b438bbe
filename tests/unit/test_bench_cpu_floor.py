"""bench/harness/cpu_floor's arithmetic (busy_emulated's host floor, issue 45) and
bench/busy_emulated's reading of a learner's sync path by part, on hand-written inputs."""

from __future__ import annotations

import math
import os

import pytest

from bench.busy_emulated import parts_per_round, sync_parts
from bench.harness.cpu_floor import (
    CpuSampler,
    PerRound,
    floor_utilisation,
    host_ticks,
    needed_share,
    offered,
    per_round,
    stat_cpu_ticks,
)


def test_stat_cpu_ticks_sums_fields_14_to_17_after_a_command_name_with_spaces_and_parens() -> None:
    # Fields: 1 pid, 2 (comm), 3 state, 4-13 ten numbers, 14 utime 700, 15 stime 50,
    # 16 cutime 3, 17 cstime 2, then more that must not count (priority 20, nice 0).
    line = "4242 (py (x) y) S 1 2 3 4 5 6 7 8 9 10 700 50 3 2 20 0 1 0 99"
    assert stat_cpu_ticks(line) == 700 + 50 + 3 + 2


def test_host_ticks_leaves_idle_and_iowait_out_of_busy() -> None:
    # user 100, nice 10, system 40, idle 500, iowait 20, irq 5, softirq 3, steal 2 (guest 7, 0:
    # already in user). total = 100+10+40+500+20+5+3+2 = 680; busy = 680 - 500 - 20 = 160.
    text = "cpu  100 10 40 500 20 5 3 2 7 0\ncpu0 50 5 20 250 10 2 1 1 0 0\n"
    assert host_ticks(text) == (160, 680)
    with pytest.raises(ValueError):
        host_ticks("intr 1 2 3\n")


def test_per_round_is_the_slope_from_round_1_to_the_first_sample_at_the_last_round() -> None:
    rows = [
        (0, 0.0, 1.0, 5.0),  # start-up: left out
        (1, 10.0, 20.0, 40.0),  # first after outer step 1: a
        (2, 14.0, 27.0, 48.0),
        (4, 22.0, 41.0, 64.0),  # first at the last outer step (4): b
        (4, 30.0, 60.0, 90.0),  # drain and final evaluation: left out
    ]
    # b - a over 3 rounds: wall 12/3 = 4, CPU 21/3 = 7, host 24/3 = 8; others 8 - 7 = 1.
    r = per_round(rows)
    assert r == PerRound(wall=4.0, cpu=7.0, host_cpu=8.0, rounds=3)
    assert r.others_cpu == 1.0
    assert PerRound(4.0, 7.0, 6.0, 3).others_cpu == 0.0  # host's reading lags ours: none
    assert per_round([(0, 0.0, 0.0, 0.0), (1, 1.0, 1.0, 1.0)]).rounds == 0
    assert math.isnan(per_round([]).cpu)


def test_floor_utilisation_is_compute_over_the_longer_of_compute_and_cpu_per_core() -> None:
    # 3 s of steps a round; 9 CPU-s on 2 cores take 4.5 s: 3 / 4.5 = 2/3.
    assert floor_utilisation(9.0, 3.0, 2) == pytest.approx(2 / 3)
    # 5 CPU-s on 2 cores take 2.5 s < 3 s: the cores are no bound.
    assert floor_utilisation(5.0, 3.0, 2) == 1.0
    # 1.5 cores: 9 / 1.5 = 6 s: 3 / 6 = 0.5.
    assert floor_utilisation(9.0, 3.0, 1.5) == pytest.approx(0.5)
    assert floor_utilisation(9.0, 3.0, -0.2) == 0.0
    with pytest.raises(ValueError):
        floor_utilisation(9.0, 0.0, 2)


def test_offered_and_needed_share() -> None:
    assert offered(4.0, 2) == 8.0  # 2 cores x a 4 s round
    # 6 CPU-s a round, 3 s of compute, 2 cores: 6 / (2 x 3) = 1.0; 9 CPU-s: 1.5 (floor 2/3).
    assert needed_share(6.0, 3.0, 2) == 1.0
    assert needed_share(9.0, 3.0, 2) == 1.5


def test_cpu_sampler_reads_a_live_process_and_keeps_an_exited_ones_last_reading() -> None:
    sampler = CpuSampler()
    sampler(1, [os.getpid()])
    sum(i * i for i in range(300_000))  # spend some CPU in this process
    sampler.last[999_999_999] = 2.5  # a process that has exited: no /proc entry any more
    sampler(2, [os.getpid(), 999_999_999])
    (s1, w1, c1, h1), (s2, w2, c2, h2) = sampler.rows
    assert (s1, s2) == (1, 2)
    assert w2 >= w1 and h2 >= h1
    assert c2 >= c1 + 2.5  # the exited process's reading is in the sum


def test_sync_parts_reads_the_exit_line_and_parts_per_round_sums_islands() -> None:
    line = (
        "INFO sync path by part over 300 steps: push 0.600s (20 calls, 30.00 ms each), "
        "receipt 0.300s (20 calls, 15.00 ms each), apply 0.150s (300 calls, 0.50 ms each); "
        "in all 1.050s (3.50 ms a step)"
    )
    a = sync_parts(line)
    assert a == (300, {"push": 0.6, "receipt": 0.3, "apply": 0.15})
    b = (100, {"push": 0.2, "plan": 0.1})
    assert sync_parts("no such line") == (0, {})
    # 400 steps in all, H = 40: push (0.6 + 0.2) / 400 x 40 = 0.08 s a round, receipt 0.03,
    # apply 0.015, plan 0.01.
    got = parts_per_round([a, b], 40)
    assert got == pytest.approx({"push": 0.08, "receipt": 0.03, "apply": 0.015, "plan": 0.01})
    assert parts_per_round([(0, {})], 40) == {}
