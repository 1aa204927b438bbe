"""The syncer's side of the drain (learner/drain.py), in-process: an island that says it drained
is not waited for, and once every active island has drained the job finishes, evaluated and
checkpointed, if what was merged is stopAfter.tokens but for the rounding of each island's part
to whole steps; short by more (work lost), it does not."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from diloco_trainer.core.island_rounds import IslandRound
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.records import Beat
from diloco_trainer.syncer.state.targets import CountBound
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .test_syncer import FakeClock, body, delta, make_spec, run, started

DRAINED = Beat(step=8, tokens=200, drained=True)


def test_syncer_merges_without_waiting_for_a_drained_island(tmp_path: Path) -> None:
    spec = make_spec(sync={"quorum": 3, "graceSeconds": 600})

    async def scenario() -> Syncer:
        syncer = await started(spec, tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        for i in (0, 1):
            await syncer.receive_push(0, body(syncer, 0, f"island-{i}", delta(syncer, 0, i)))
        await syncer.tick()
        assert syncer.state.versions == [0]  # two of three: no quorum
        await syncer.islands.heartbeat("island-2", DRAINED)
        await syncer.tick()
        return syncer

    syncer = run(scenario())
    assert syncer.state.versions == [1]
    assert not syncer.finished  # islands 0 and 1 have not drained
    assert run(syncer.status())["islands"]["island-2"]["drained"] is True


@pytest.mark.parametrize(
    ("budget", "finishes"),
    [
        # 200 tokens merged; a step of each active island is 8 x 16 = 128 tokens.
        (456, True),  # short by 256: the drain's rounding of two islands' parts
        (457, False),  # short by more: work was lost, the learners train on
    ],
)
def test_syncer_finishes_once_every_active_island_drained_at_the_budget(
    tmp_path: Path, budget: int, finishes: bool
) -> None:
    spec = make_spec(
        sync={"quorum": 3, "graceSeconds": 600}, stopAfter={"outerSteps": None, "tokens": budget}
    )

    async def scenario() -> tuple[Syncer, list[bool]]:
        syncer = await started(spec, tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        await syncer.islands.set_membership("island-2", "dropped", "node lost")
        for i in (0, 1):
            await syncer.receive_push(0, body(syncer, 0, f"island-{i}", delta(syncer, 0, i)))
        await syncer.tick()
        seen = [syncer.finished]
        await syncer.islands.heartbeat("island-0", DRAINED)
        await syncer.tick()
        seen.append(syncer.finished)  # island-1 has not drained
        answer = await syncer.islands.heartbeat("island-1", DRAINED)
        seen.append(answer["finished"])  # said before the scheduler ran
        await syncer.tick()
        seen.append(syncer.finished)
        return syncer, seen

    syncer, seen = run(scenario())
    assert seen == [False, False, False, finishes]
    assert syncer.state.versions == [1] and syncer.tokens == 200
    if finishes:  # the finish evaluated and checkpointed the final weights, as at stopAfter
        assert [e["outerStep"] for e in syncer.jobs.evaluations.history][-1] == 1
        assert [p.name for p in ckpt.list_checkpoints(tmp_path)][-1] == ckpt.checkpoint_name(1)


def test_syncer_sets_stop_targets_near_the_budget_and_drops_a_rejoiners(tmp_path: Path) -> None:
    # K = 2 of 3, 3,000 tokens; a step is 8 x 16 = 128 tokens. Each island reports 0 tokens,
    # then 640 a second later: 640 tokens/s each, 1,920 done, 1,080 left, far within the
    # horizon (3 heartbeats). Each gets a third: 640 + 360 = 1,000, down to 7 steps = 896.
    # Heartbeats every second (timeout 4 s): a pace needs reports half of that apart.
    # The push answers name the target too: they come every few steps where a heartbeat comes
    # once a beat, and a target set late reached the island past it (tests/e2e/test_drain.py).
    spec = make_spec(
        sync={"quorum": 2, "heartbeatTimeoutSeconds": 4},
        stopAfter={"outerSteps": None, "tokens": 3000},
    )
    clock = FakeClock()

    async def scenario() -> tuple[list[dict[str, object]], list[dict[str, object]]]:
        syncer = await started(spec, tmp_path, clock)
        islands = [f"island-{i}" for i in range(3)]
        for name in islands:
            await syncer.islands.join(name, 1)
            await syncer.islands.heartbeat(name, Beat(step=0, tokens=0, step_time=0.2))
        pushes = [await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 0)))]
        clock.now += 1.0
        answers = [await syncer.islands.heartbeat(n, Beat(step=5, tokens=640)) for n in islands]
        await syncer.islands.join("island-0", 1)  # restarted: its count starts from zero again
        answers += [
            await syncer.islands.heartbeat(n, Beat(step=1, tokens=128)) for n in islands[:2]
        ]
        for name in ("island-1", "island-0"):
            pushes.append(await syncer.receive_push(0, body(syncer, 0, name, delta(syncer, 0, 1))))
        return answers, pushes

    answers, pushes = run(scenario())
    # No target until every island's pace is known (the third island's second report).
    assert [a.get("stopAt") for a in answers[:3]] == [None, None, 896]
    assert answers[3].get("stopAt") is None  # the rejoined island trains on without one
    assert answers[4]["stopAt"] == 896
    # Before the split none; island-1's 896; the rejoined island-0 none.
    assert [a.get("stopAt") for a in pushes] == [None, 896, None]
    assert all(a["accepted"] for a in pushes)


def test_the_finish_evaluates_merges_that_completed_no_outer_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The final weights are evaluated even when the merges since the latest evaluation did not
    complete an outer step (a partial round at K < M, the drain's last pushes): the final eval
    loss is never that of older weights. Island-0's lone push is half a round (4 of 2 x 4
    steps), so the outer step stays 0, the start's evaluated step."""
    spec = make_spec(
        islands={"count": 2},
        sync={"quorum": 1, "graceSeconds": 0},
        stopAfter={"outerSteps": None, "tokens": 300},
    )

    async def scenario() -> Syncer:
        syncer = await started(spec, tmp_path, FakeClock())
        for i in range(2):
            await syncer.islands.join(f"island-{i}", 1)
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 0)))
        await syncer.tick()
        assert syncer.state.versions == [1] and syncer.state.outer_step == 0
        for i in range(2):
            await syncer.islands.heartbeat(f"island-{i}", DRAINED)
        await syncer.tick()
        return syncer

    with caplog.at_level(logging.INFO, logger="diloco.syncer"):
        syncer = run(scenario())
    assert syncer.finished  # 100 of 300 tokens: short by 200, under a step of each island
    history = syncer.jobs.evaluations.history
    assert [(e["outerStep"], e["tokens"]) for e in history] == [(0, 0), (0, 100)]
    assert history[-1]["evalLoss"] != history[0]["evalLoss"]
    # No merge line follows this finish: the final evaluation has its own line.
    loss = history[-1]["evalLoss"]
    assert f"final eval at outer step 0 (100 tokens): loss {loss:.4f}" in caplog.text
    assert run(syncer.status())["evalHistory"][-1]["tokens"] == 100


def test_a_merge_that_reaches_the_stop_logs_the_final_evaluation_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The merge that reaches stopAfter evaluates the final weights: its loss is logged on one
    line, not again on the merge's own line (it was logged twice)."""
    spec = make_spec(
        islands={"count": 1},
        sync={"quorum": 1, "graceSeconds": 0},
        stopAfter={"outerSteps": 1, "tokens": None},
    )

    async def scenario() -> Syncer:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 0)))
        await syncer.tick()
        return syncer

    with caplog.at_level(logging.INFO, logger="diloco.syncer"):
        syncer = run(scenario())
    assert syncer.finished and syncer.state.outer_step == 1
    loss = syncer.jobs.evaluations.history[-1]["evalLoss"]
    assert caplog.text.count(f"{loss:.4f}") == 1
    assert "final eval at outer step 1 (" in caplog.text


def test_k_equal_m_targets_wait_until_every_running_island_heard_the_split(
    tmp_path: Path,
) -> None:
    """K = M = 3, H = 4, 128 tokens a step, stopAfter 15,360 tokens: a share of 1/M is 40 steps
    (5,120 tokens). Islands 1 and 2 report 36 steps (4,608) at t = 1; then island-0's round is
    cut to 2 steps (the budget is split from now on) and it reports 32 steps (4,096), the
    reading that carried its new round to it.

    Split at once over all three by tokens per round (2 x 128 against 4 x 128): 2,048 left,
    island-0 4,096 + 409.6 -> 35 steps (4,480), islands 1 and 2 4,608 + 819.2 -> 42 steps
    (5,376) each. But islands 1 and 2 have not heard the split: they drain on their share, 40
    steps. Merged: 4,480 + 2 x 5,120 = 14,720, 640 short: five steps, more than the slack of a
    step an island (384), so the job never finishes at the drain (issues 45/47).

    Waiting until every island still training has heard it: islands 1 and 2 drain on their
    share first (5,120 merged each, final); island-0 then gets what is left, 15,360 - 10,240 -
    4,096 = 1,024 more: 5,120 (40 steps), and the drain ends at the budget exactly."""
    spec = make_spec(
        islands={"count": 3},
        # heartbeats every second: a pace from reports 1 s apart (more than half of that)
        sync={"quorum": 3, "graceSeconds": 600, "heartbeatTimeoutSeconds": 4},
        stopAfter={"outerSteps": None, "tokens": 15_360},
    )
    clock = FakeClock()

    async def scenario() -> list[object]:
        syncer = await started(spec, tmp_path, clock)
        names = [f"island-{i}" for i in range(3)]
        for name in names:
            await syncer.islands.join(name, 1)
            await syncer.islands.heartbeat(name, Beat(step=0, tokens=0))
        clock.now += 1.0
        seen: list[object] = []
        for name in names[1:]:
            answer = await syncer.islands.heartbeat(name, Beat(step=36, tokens=4608))
            seen.append(answer.get("splitBudget", False))
        # island-0's round cut to 2 steps, as round_sizes' reading of its step time does
        syncer.state.membership.islands["island-0"].round = IslandRound(2)
        syncer.gate.rounds.split = True
        # its 32 steps merged (at its round boundary): a count its record supports (issue 46)
        syncer.state.membership.islands["island-0"].merged_tokens = 4096.0
        first = await syncer.islands.heartbeat("island-0", Beat(step=32, tokens=4096))
        seen += [first.get("splitBudget", False), first.get("stopAt")]
        for name in names[1:]:  # at their share, each with its 40 steps merged
            syncer.state.membership.islands[name].merged_tokens = 5120.0
            await syncer.islands.heartbeat(name, Beat(step=40, tokens=5120, drained=True))
        later = await syncer.islands.heartbeat("island-0", Beat(step=32, tokens=4096))
        seen.append(later.get("stopAt"))
        return seen

    assert run(scenario()) == [False, False, True, None, 5120]


@pytest.mark.parametrize(("quorum", "finished"), [(2, [False, False, True]), (1, [True] * 3)])
def test_at_k_equal_m_the_token_budget_waits_for_every_islands_drain(
    tmp_path: Path, quorum: int, finished: list[bool]
) -> None:
    """Two islands; a merge of both pushes (100 tokens each) takes the job to 200 tokens, past a
    budget of 150. At K = M (quorum 2, rounds of H: the islands drain on their 1/M shares) the
    job ends only once both have drained: fill steps at H (step_plan.fills_drift) put tokens on
    top of the shares, and the islands' last pushes are still to come. At K < M (quorum 1) it
    ends at that merge, as before."""
    spec = make_spec(
        islands={"count": 2},
        sync={"quorum": quorum, "graceSeconds": 600},
        stopAfter={"outerSteps": None, "tokens": 150},
    )

    async def scenario() -> tuple[Syncer, list[bool]]:
        syncer = await started(spec, tmp_path, FakeClock())
        for i in range(2):
            await syncer.islands.join(f"island-{i}", 1)
        for i in range(2):
            await syncer.receive_push(0, body(syncer, 0, f"island-{i}", delta(syncer, 0, i)))
        await syncer.tick()
        assert syncer.tokens == 200 and syncer.shares_kept() is (quorum == 2)
        seen = [syncer.finished]
        for i in range(2):
            await syncer.islands.heartbeat(f"island-{i}", DRAINED)
            await syncer.tick()
            seen.append(syncer.finished)
        return syncer, seen

    _, seen = run(scenario())
    assert seen == finished


def test_an_island_that_never_joined_does_not_hold_the_drained_finish(tmp_path: Path) -> None:
    """Issue 46 (bench.adversary's honest baselines): K = 2 of 3, the third island never up
    (islands.startupTimeoutSeconds, 600 s, not passed). Island-1 pushes 100 tokens and says it
    drained; island-0's last push (100 more) completes the round: due at once, no grace window
    of 600 s for island-2, 200 merged. Budget 456: short by 256, a step (8 x 16 = 128 tokens)
    of each of the two active islands, the drain's rounding. Both drained: the job finishes, no
    wait for the third island, which has no part of a budget split between the other two."""
    spec = make_spec(
        sync={"quorum": 2, "graceSeconds": 600}, stopAfter={"outerSteps": None, "tokens": 456}
    )

    async def scenario() -> tuple[Syncer, list[object]]:
        syncer = await started(spec, tmp_path, FakeClock())
        for i in range(2):
            await syncer.islands.join(f"island-{i}", 1)
        seen: list[object] = [syncer.state.membership.awaited()]
        await syncer.receive_push(0, body(syncer, 0, "island-1", delta(syncer, 0, 1)))
        await syncer.islands.heartbeat("island-1", DRAINED)
        await syncer.tick()  # one push of a quorum of two, island-1 drained: not due yet
        seen.append(syncer.tokens)
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 0), base=0))
        await syncer.tick()
        seen += [syncer.tokens, syncer.finished]
        await syncer.islands.heartbeat("island-0", DRAINED)
        await syncer.tick()
        seen.append(syncer.finished)
        return syncer, seen

    syncer, seen = run(scenario())
    # main: [1, 0, 0, False, False], the round held by quorum and the finish by island-2
    assert seen == [1, 0, 200, False, True]
    assert syncer.state.versions == [1] and syncer.tokens == 200


def test_an_island_that_never_reports_its_pace_holds_no_target_nor_the_finish(
    tmp_path: Path,
) -> None:
    """Issue 46 (adv14's paced_ratchet runs): K = 2 of 3, island-2 joined and never reports its
    count. Islands 0 and 1 report 0 tokens at 1,000 s, 64 at 1,001 s (no pace yet: less than
    half a heartbeat interval, 2.5 s, apart) and 896 at 1,014 s: 64 tokens/s each; budget
    456, 128 of it counted: 328 left, within the horizon (15 s x 128/s). Island-2's pace is
    awaited 15 s after its first join (3 heartbeats of 5 s at heartbeatTimeoutSeconds 30), its
    rejoin at 1,014 s included: no target at 1,014 s; at 1,015 s it is left out (had its rejoin
    restarted the wait, an island rejoining every few seconds would hold the split), and 0 and
    1, at 64 + 14 x 64 = 960 each (as their counts say), past the budget, drain at once: 7
    steps of 128 = 896. Each pushes 100 tokens and drains: 200 merged, short of 456 by 256, a
    step of each targeted island: the job finishes, island-2 active and not drained. On main
    no target ever came and the finish waited for island-2."""
    spec = make_spec(
        sync={"quorum": 2, "graceSeconds": 5}, stopAfter={"outerSteps": None, "tokens": 456}
    )
    clock = FakeClock()

    async def scenario() -> tuple[Syncer, list[object]]:
        syncer = await started(spec, tmp_path, clock)
        honest = ["island-0", "island-1"]
        for name in [*honest, "island-2"]:
            await syncer.islands.join(name, 1)
        for name in honest:
            await syncer.islands.heartbeat(name, Beat(step=0, tokens=0, step_time=0.2))
        clock.now += 1.0
        seen: list[object] = [
            (await syncer.islands.heartbeat(n, Beat(step=4, tokens=64))).get("stopAt")
            for n in honest
        ]
        clock.now += 13.0  # 1,014 s: island-2 may still report
        await syncer.islands.join("island-2", 1)  # a rejoin does not restart its wait
        seen += [
            (await syncer.islands.heartbeat(n, Beat(step=56, tokens=896))).get("stopAt")
            for n in honest
        ]
        clock.now += 1.0  # 1,015 s: its wait is over
        seen += [
            (await syncer.islands.heartbeat(n, Beat(step=60, tokens=960))).get("stopAt")
            for n in honest
        ]
        seen.append(dict(syncer.islands.targets))
        await syncer.receive_push(0, body(syncer, 0, "island-1", delta(syncer, 0, 1)))
        await syncer.islands.heartbeat("island-1", Beat(step=8, tokens=960, drained=True))
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 0), base=0))
        clock.now += 6.0  # past the grace window: island-2, active, could have pushed
        await syncer.tick()
        seen += [syncer.tokens, syncer.finished]
        await syncer.islands.heartbeat("island-0", Beat(step=8, tokens=960, drained=True))
        await syncer.tick()
        seen.append(syncer.finished)
        return syncer, seen

    syncer, seen = run(scenario())
    # main: [None, None, None, None, None, None, {}, 200, False, False]
    targets = {"island-0": 896, "island-1": 896}
    assert seen == [None, None, None, None, 896, 896, targets, 200, False, True]
    status = run(syncer.status())["islands"]["island-2"]
    assert status["state"] == "active" and status["drained"] is False


def test_a_heartbeat_count_of_two_to_the_fifty_moves_no_other_islands_target(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 46 (adv15's reproduction): K = 2 of 3, 128 tokens a step, H = 4, τ = 1 (a capped
    push: 17 steps, 2,176 tokens), heartbeats every second (timeout 4 s: pace span 0.5 s, wait 3 s,
    horizon 3 s), budget 2,000. Islands 0 and 1 claim 0.2 s a step and report 0 tokens at
    1,000 s and 640 at 1,001 s (640 tokens/s each); island-2 reports 0, then 2^50 at 1,001 s.

    Main: island-2's pace counts; done 2^50 + 1,280, left < 0: islands 0 and 1 get their
    current counts, 640 (5 steps into the job). Now: with two step-time claims (fewer than 3)
    island-2's count may grow at 1.5 x 128 / 0.001 s = 192,000 tokens/s, plus 2,176: 2^50 in
    1 s is far past it, so it is left out at once, and islands 0 and 1 split 2,000 - 1,280 =
    720 (0.56 s at 1,280/s): 640 + 360 = 1,000 -> 7 steps = 896 each, as a job of the two."""
    spec = make_spec(
        sync={"quorum": 2, "graceSeconds": 5, "heartbeatTimeoutSeconds": 4},
        stopAfter={"outerSteps": None, "tokens": 2_000},
    )
    clock = FakeClock()
    honest = ["island-0", "island-1"]

    async def scenario() -> list[object]:
        syncer = await started(spec, tmp_path, clock)
        for name in [*honest, "island-2"]:
            await syncer.islands.join(name, 1)
            await syncer.islands.heartbeat(name, Beat(step=0, tokens=0, step_time=0.2))
        clock.now += 1.0
        for name in honest:
            await syncer.islands.heartbeat(name, Beat(step=5, tokens=640))
        liar = await syncer.islands.heartbeat("island-2", Beat(step=5, tokens=2**50))
        seen: list[object] = [liar.get("stopAt"), dict(syncer.islands.targets)]
        for name in honest:
            seen.append((await syncer.islands.heartbeat(name, Beat(5, 640))).get("stopAt"))
        return seen

    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        seen = run(scenario())
    # main: [2**50, {"island-0": 640, "island-1": 640, "island-2": 2**50}, 640, 640]
    assert seen == [None, {"island-0": 896, "island-1": 896}, 896, 896]
    assert "island island-2: its heartbeat count (tokens) grew by" in caplog.text


def test_refused_pushes_count_towards_what_an_islands_count_may_run_ahead(
    tmp_path: Path,
) -> None:
    """A refused push's tokens are not trained again, so its island's count runs ahead of its
    merged tokens by them (gate.count_bound's `ahead`: a capped push, 4 x H + τ = 17 steps x 128
    = 2,176, plus those). Refused at 422 for 18 steps: its 100 tokens; refused for claiming
    10^9 tokens: held to a capped push's 2,176. Ahead: 2,176 + 2,276 = 4,452. Its
    rate: 1.5 x 128 / its claimed 0.2 s = 960 tokens/s. A rejoin starts a new count: the
    refused tokens go back to 0."""
    spec = make_spec(sync={"quorum": 2, "graceSeconds": 5}, syncer={"guards": {"maxRefusals": 5}})

    async def scenario() -> list[object]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await syncer.islands.heartbeat("island-0", Beat(step=0, tokens=0, step_time=0.2))
        members = syncer.state.membership
        seen: list[object] = []
        for meta in ({"steps": 18, "tokens": 100}, {"steps": 4, "tokens": 10**9}):
            try:
                await syncer.receive_push(
                    0, body(syncer, 0, "island-0", delta(syncer, 0, 0), **meta)
                )
            except Refused as err:
                seen.append(err.status)
        seen.append(members.islands["island-0"].refused_tokens)
        seen.append(syncer.gate.count_bound(members, "island-0"))
        await syncer.islands.join("island-0", 1)
        seen.append(members.islands["island-0"].refused_tokens)
        return seen

    assert run(scenario()) == [422, 422, 2_276.0, CountBound(rate=960.0, ahead=4_452.0), 0.0]


RESTART_SPEC = {
    "islands": {"count": 2},
    "sync": {"quorum": 1, "graceSeconds": 0, "heartbeatTimeoutSeconds": 4},
    "stopAfter": {"outerSteps": None, "tokens": 3_712},
}


async def restart_pair(state_dir: Path, clock: FakeClock) -> Syncer:
    """A syncer on RESTART_SPEC with island-0 and island-1 joined (stopped if a join fails)."""
    syncer = await started(make_spec(**RESTART_SPEC), state_dir, clock)
    try:
        for name in ("island-0", "island-1"):
            await syncer.islands.join(name, 1)
    except BaseException:
        await syncer.stop()
        raise
    return syncer


async def push_merged(syncer: Syncer, clock: FakeClock, island: str, seed: int) -> None:
    """A push of 4 steps, 512 tokens, merged alone (quorum 1, grace 0), a second later."""
    clock.now += 1.0
    d = delta(syncer, 0, seed)
    answer = await syncer.receive_push(0, body(syncer, 0, island, d, tokens=512, steps=4))
    assert answer["accepted"], answer
    await syncer.tick()


async def paces_after_restart(
    syncer: Syncer, clock: FakeClock, counts: tuple[int, int], step: int = 640
) -> dict[str, int]:
    """Islands 0 and 1 report (0, counts[0]), then `step` more each a second later: the targets."""
    for name, tokens in zip(("island-0", "island-1"), counts, strict=True):
        await syncer.islands.heartbeat(name, Beat(step=1, tokens=tokens, step_time=0.2))
    clock.now += 1.0
    for name, tokens in zip(("island-0", "island-1"), counts, strict=True):
        await syncer.islands.heartbeat(name, Beat(step=6, tokens=tokens + step))
    return dict(syncer.islands.targets)


def test_a_restarted_syncer_keeps_each_islands_count_base_and_refused_tokens(
    tmp_path: Path,
) -> None:
    """adv17 (issue 46): a learner rides out a syncer restart without joining again and its
    count goes on from the base of its last join (its island's merged tokens then), so the
    checkpoint keeps that base and the refused tokens (CheckpointManifest.counts). K = 1 of 2,
    128 tokens a step, H = 4, τ = 1 (a capped push: 17 steps, 2,176 tokens), heartbeats every
    second (timeout 4 s), budget 3,712. island-1 merges a push of 512 tokens, its learner
    restarts (base 512), has a push of 18 steps, 100 tokens, refused (422: 100 refused) and
    merges another (1,024); the syncer is stopped (its checkpoint) and started again.
    island-0 reports 0 then 640 a second later, island-1 640 then 1,280 (640 tokens/s each).

    Now: base 512 and 100 refused, restored; island-1's part its count less the refused,
    512 + 1,280 - 100 = 1,692 (within [1,024, 1,024 + 2,176]); done 640 + 1,692 = 2,332,
    left 1,380, 690 each: island-0 1,330 -> 10 steps (1,280), island-1 1,280 + 690 = 1,970 ->
    15 steps (1,920). Main: base 0 and nothing refused after the restart; part 1,280, done
    1,920, left 1,792, 896 each: island-0 1,536 (12 steps), island-1 2,176 (17): 1,536 + 512
    + 2,176 = 4,224, the budget overshot by the base."""
    clock = FakeClock()

    async def scenario() -> list[object]:
        syncer = await restart_pair(tmp_path, clock)
        try:
            await push_merged(syncer, clock, "island-1", 1)
            await syncer.islands.join("island-1", 1)  # its learner restarted
            with pytest.raises(Refused) as err:
                await syncer.receive_push(
                    0, body(syncer, 0, "island-1", delta(syncer, 0, 3), tokens=100, steps=18)
                )
            assert err.value.status == 422
            await push_merged(syncer, clock, "island-1", 2)  # a checkpoint is due after it
        finally:
            await syncer.stop()  # its checkpoint
        again = await started(make_spec(**RESTART_SPEC), tmp_path, clock)
        try:
            rec = again.state.membership.islands["island-1"]
            seen: list[object] = [rec.merged_tokens, rec.count_base, rec.refused_tokens]
            seen.append(await paces_after_restart(again, clock, (0, 640)))
            return seen
        finally:
            await again.stop()

    # main: [1024.0, 0.0, 0.0, {"island-0": 1536, "island-1": 2176}]
    assert run(scenario()) == [1_024.0, 512.0, 100.0, {"island-0": 1_280, "island-1": 1_920}]
