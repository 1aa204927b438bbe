"""Identical islands keep their rounds on a loaded shared host (inner.stepsPerIsland auto,
core/island_rounds.aged_past_join), at the syncer over real HTTP: a real `diloco syncer` process,
islands that join and heartbeat with stepTime (the api's SyncerJsonClient), the H_i read from the
heartbeat answers. No learner runs: the step times are the schedule of issue 47's failure, so
the assertions are about the rule, not about how loaded the machine is.

The failure (tests/e2e/test_convergence.py[4] with auto, CI and a helper's reproduction at load
12: 4 identical islands, K = 4, H = 10): the islands that started first probed with the cores to
themselves (0.05 s, 0.0625 s a step); island-1, started later, ran its first steps beside
island-3's start-up and probed 0.125 s, then 0.1125 s (its second probe), and was cut to 5 of 10
against the early islands' probes (to 4 in the reproduction, at 0.1244 s and 0.1163 s). Step
times here are those x 100 (5 s, 6.25 s, ...): the syncer's reference round (H x t_ref, 62.5 s)
then outlasts the test on any machine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from diloco_trainer.api.client import SyncerJsonClient
from diloco_trainer.api.spec import JobSpec

from .conftest import SyncerHandle

pytestmark = pytest.mark.e2e

H = 10
SCALE = 100.0  # the failure's step times x 100: the timeouts of the syncer's clock never pass


def _spec(make_spec: Callable[..., JobSpec]) -> JobSpec:
    return make_spec(
        islands={"count": 4},
        inner={"steps": H, "stepsPerIsland": "auto"},
        # stepTime up to 20 heartbeat timeouts (validation.step_time_limit)
        sync={"quorum": 4, "heartbeatTimeoutSeconds": 60},
        stopAfter={"outerSteps": 10},
    )


async def _beat(client: SyncerJsonClient, island: int, step: int, step_time: float) -> int:
    answer = await client.heartbeat(f"island-{island}", step=step, step_time=step_time * SCALE)
    assert answer.inner_steps is not None
    return answer.inner_steps


def test_a_late_identical_islands_probe_is_not_judged_against_early_probes(
    make_spec: Callable[..., JobSpec], syncer_proc: Callable[..., SyncerHandle]
) -> None:
    handle = syncer_proc(_spec(make_spec))

    async def schedule() -> list[int]:
        async with SyncerJsonClient(handle.url, handle.token) as client:
            await client.join("island-0", 1)
            await client.join("island-2", 1)
            # the early islands' probes (step 3), made with the cores to themselves
            await _beat(client, 0, 3, 0.05)
            await _beat(client, 2, 3, 0.0625)
            await client.join("island-1", 1)
            await client.join("island-3", 1)
            # island-1's probe: 0.125 s, 2.5x island-0's and 2x island-2's; island-3's
            # (joined after it, so all it reports is of the load since island-1's join)
            seen = [await _beat(client, 1, 3, 0.125)]
            await _beat(client, 3, 3, 0.0875)
            # island-1's second probe: 0.1125 s; island-3's, 0.07 s
            seen.append(await _beat(client, 1, 5, 0.1125))
            await _beat(client, 3, 5, 0.07)
            seen.append(await _beat(client, 1, 7, 0.1125))
            return seen

    # Before: the probe against the lower median of 0.05, 0.0625, 0.125 (3 of 4 reported) read
    # 2x, target 5, one reading pending; the second probe against the lower median of 0.05,
    # 0.0625, 0.0875, 0.1125 = 0.0625 read 1.8x, target 5, confirmed: cut to
    # floor(0.9 x 10 x 0.0625 / 0.1125) = 5 (K = M's room) at step 5. Now island-0's and
    # island-2's step times predate island-1's join and neither has stepped or reported since:
    # they are not aged past it (aged_past_join), and island-1's reports wait unread for them
    # (for at most a reference round, 10 x 6.25 s); island-3's count.
    assert asyncio.run(schedule()) == [H, H, H]


def test_a_slow_island_that_joins_last_is_cut_at_its_probe_against_idle_peers(
    make_spec: Callable[..., JobSpec], syncer_proc: Callable[..., SyncerHandle]
) -> None:
    """K = M, speeds 1,1,1,3: the fast islands ran their first round and wait at its end for
    the slow island's push (their heartbeats report the same step again: idle since its join,
    they load no core), so their step times count at once and its probe cuts its first round."""
    handle = syncer_proc(_spec(make_spec))

    async def schedule() -> int:
        async with SyncerJsonClient(handle.url, handle.token) as client:
            for i in (0, 1, 2):
                await client.join(f"island-{i}", 1)
                await _beat(client, i, 3, 0.05)  # probe
                await _beat(client, i, 10, 0.05)  # at its round's end, waiting
            await client.join("island-3", 1)
            for i in (0, 1, 2):
                await _beat(client, i, 10, 0.05)  # still waiting: idle since the join
            # its probe: t_ref = lower median of 0.05 x 3, 0.15 = 0.05, target
            # floor(10 x 0.05 / 0.15) = 3 <= 5 with all 4 reporting: taken at once
            return await _beat(client, 3, 3, 0.15)

    assert asyncio.run(schedule()) == 3
