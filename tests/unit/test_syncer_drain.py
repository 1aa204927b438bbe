"""The syncer's side of the drain (learner/drain.py), in-process: an island that says it drained
is not waited for, and the job finishes once every active island has drained, evaluated and
checkpointed, even short of stopAfter (a dropped island's share is not coming)."""

from __future__ import annotations

from pathlib import Path

from diloco_trainer.syncer import checkpoint as ckpt
from diloco_trainer.syncer.records import Beat
from diloco_trainer.syncer.service import Syncer

from .test_syncer import FakeClock, body, delta, make_spec, run, started

DRAINED = Beat(step=8, tokens=200, drained=True)


def test_syncer_merges_without_waiting_for_a_drained_island(tmp_path: Path) -> None:
    spec = make_spec(sync={"quorum": 3, "graceSeconds": 600})

    async def scenario() -> Syncer:
        syncer = await started(spec, tmp_path, FakeClock())
        for i in range(3):
            await syncer.join(f"island-{i}", 1)
        for i in (0, 1):
            await syncer.receive_push(0, body(syncer, 0, f"island-{i}", delta(syncer, 0, i)))
        await syncer.tick()
        assert syncer.state.versions == [0]  # two of three: no quorum
        await syncer.heartbeat("island-2", DRAINED)
        await syncer.tick()
        return syncer

    syncer = run(scenario())
    assert syncer.state.versions == [1]
    assert not syncer.finished  # islands 0 and 1 have not drained
    assert run(syncer.status())["islands"]["island-2"]["drained"] is True


def test_syncer_finishes_once_every_active_island_drained(tmp_path: Path) -> None:
    spec = make_spec(sync={"quorum": 3, "graceSeconds": 600}, stopAfter={"outerSteps": 100})

    async def scenario() -> tuple[Syncer, list[bool]]:
        syncer = await started(spec, tmp_path, FakeClock())
        for i in range(3):
            await syncer.join(f"island-{i}", 1)
        await syncer.set_membership("island-2", "dropped", "node lost")
        for i in (0, 1):
            await syncer.receive_push(0, body(syncer, 0, f"island-{i}", delta(syncer, 0, i)))
        await syncer.tick()
        seen = [syncer.finished]
        await syncer.heartbeat("island-0", DRAINED)
        await syncer.tick()
        seen.append(syncer.finished)  # island-1 has not drained
        answer = await syncer.heartbeat("island-1", DRAINED)
        seen.append(answer["finished"])  # said before the scheduler ran
        await syncer.tick()
        seen.append(syncer.finished)
        return syncer, seen

    syncer, seen = run(scenario())
    assert seen == [False, False, False, True]
    assert syncer.state.versions == [1] and syncer.outer_step == 1  # far short of 100
    # The finish evaluated and checkpointed the final weights, as one at stopAfter does.
    assert [e["outerStep"] for e in syncer.jobs.evaluations.history][-1] == 1
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)][-1] == ckpt.checkpoint_name(1)
