"""Issue 46, what the last session left of the work evidence of a job of two:

- the guards' per-island figures (the work evidence's movement per claimed step, the windows
  the naming reads, the refusal streaks) are kept with the syncer's checkpoint
  (api/manifest.SavedGuards, written by ContributionGuard.saved and read by .restore), so an
  island that claims work it does not carry cannot get a clean slate by waiting for a restart;
  a checkpoint from before them still loads, the figures starting afresh;
- an island named unsupported (its last pushes all refused `work_unsupported`) no longer counts
  towards the quorum: at K = M the other island's merges do not wait for a push the gate
  refuses (SyncState.set_unsupported), and the first push of it the gate accepts counts again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from diloco_trainer.api import protocol
from diloco_trainer.api.manifest import CheckpointManifest, SavedGuards
from diloco_trainer.syncer.intake import guards
from diloco_trainer.syncer.state.problems import AT_BOUND, WORK_UNSUPPORTED
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .test_rounds import make_state, push
from .test_syncer import FakeClock, body, make_spec, run, started
from .test_syncer_work_evidence import (
    PAIR,
    filled,
    join_pair,
    merge_log,
    pair_guard,
    refused,
    stats,
)


def named_guard() -> guards.ContributionGuard:
    """A guard of a job of two whose 'bad' island is named unsupported: the honest island's
    three pushes of 4 steps at 0.01 (0.0025 a step, above the step cap 0.0015: the reference is
    0.0015), then eight zero pushes of 16 claimed steps from 'bad' (each refused: the bar is
    16 x 0.0015 / 32 = 0.00075)."""
    g = pair_guard(syncer={"guards": {"movementFactor": 1.5, "maxDeltaNorm": 1e6}})
    for _ in range(3):
        g.check_delta(0, "honest", stats(0.01), 4)
        g.accepted(0, "honest", stats(0.01), 4)
    for _ in range(guards.AT_BOUND_PUSHES):
        assert refused(g, "bad", 0.0, 16)
    return g


def through_a_checkpoint(saved: SavedGuards) -> SavedGuards | None:
    """As a checkpoint's manifest carries it: its wire form, JSON, parsed back."""
    manifest = CheckpointManifest(versions=[0], guards=saved)
    return CheckpointManifest.from_json(json.loads(json.dumps(manifest.to_wire()))).guards


def test_guard_figures_survive_a_checkpoint() -> None:
    g = named_guard()
    g.streaks["honest"] = 4  # four refusals in a row that count towards maxRefusals (5)
    assert list(g.unsupported()) == ["bad"]
    saved = through_a_checkpoint(g.saved())
    assert saved is not None
    # Movement per claimed step: the honest island's three accepted pushes, 0.01 / 4 each; the
    # bad island has none (zeros are never accepted). Its last eight judged pushes moved 0 of
    # the reference each; none of them was judged against the learned bound (no warm-up yet).
    assert saved.movement == [{"honest": [0.0025] * 3}]
    assert saved.carried == [{"bad": [0.0] * guards.AT_BOUND_PUSHES}]
    assert saved.streaks == {"honest": 4}
    fresh = pair_guard(syncer={"guards": {"movementFactor": 1.5, "maxDeltaNorm": 1e6}})
    fresh.restore(saved, islands={"honest", "bad"})
    # Named at once, on the same figures: the bar of a push of 16 steps is still 0.00075.
    assert list(fresh.unsupported()) == ["bad"] and "1/32" in fresh.unsupported()["bad"]
    assert fresh.evidence is not None
    assert fresh.evidence.bar(0, "bad", 16) == pytest.approx(16 * 0.0015 / 32)
    assert fresh.streaks == {"honest": 4}
    # One more own-fault refusal drops the honest island, as it would have without a restart.
    assert fresh.refused("honest", guards.ContributionRefused("x", "x")) is True
    # A push of its claimed work ends the naming after the restart, as before it.
    assert not refused(fresh, "bad", 0.01, 16)
    assert fresh.unsupported() == {}


def test_guard_figures_restore_only_the_jobs_islands_and_bounded_windows() -> None:
    saved = SavedGuards(
        movement=[{"a": [1.0] * 40, "stranger": [1.0] * 3}],
        carried=[{"a": [0.0] * 20 + [math.inf], "stranger": [0.0] * 8}],
        at_bound=[{"a": [True] * 30, "stranger": [True] * 8}],
        streaks={"a": 1, "stranger": 2, "b": 5},
    )
    g = pair_guard()
    g.restore(saved, islands={"a", "b"})
    assert g.evidence is not None
    # An island the checkpoint has no record of is none of the job's; each window keeps its
    # newest entries up to its length (16 movements, 8 judged pushes); a streak at or past
    # maxRefusals (5) is not one the running syncer can hold (it drops the island at 5).
    assert list(g.evidence.rates[0]) == ["a"] and len(g.evidence.rates[0]["a"]) == 16
    assert list(g.carried) == [(0, "a")] and len(g.carried[(0, "a")]) == 8
    assert list(g.at_bound) == [(0, "a")] and len(g.at_bound[(0, "a")]) == 8
    assert g.streaks == {"a": 1}
    # An infinite figure (a reference of 0) is written finite and reads as moving enough.
    saved_back = through_a_checkpoint(g.saved())
    assert saved_back is not None and saved_back.carried[0]["a"][-1] == guards.SAVED_MAX
    assert g.unsupported() == {}  # the newest of its eight moved 'infinitely' more


def test_a_checkpoint_without_guard_figures_still_loads() -> None:
    older = CheckpointManifest.from_json({"versions": [3], "outerStep": 3, "normHistory": [[1.0]]})
    assert older.guards is None
    g = pair_guard()
    g.restore(older.guards, islands={"a"})
    assert g.saved() == SavedGuards(movement=[{}], carried=[{}], at_bound=[{}], streaks={})


def test_a_named_island_no_longer_counts_towards_the_quorum() -> None:
    """K = M = 2: the honest island's push waits for the other's, however long; named
    unsupported, the other is no island of the rounds (quorum min(2, 2 - 1) = 1), so the
    pending push is due at once, and the first push of it the gate accepts counts again."""
    state = make_state(quorum=2, islands=2, grace=5.0)
    push(state, "island-0", 10.0)
    assert state.effective_quorum() == 2 and not state.merge_due(0, 1000.0)
    assert state.set_unsupported(frozenset({"island-1"}), 1000.0) is True
    assert state.set_unsupported(frozenset({"island-1"}), 1000.0) is False  # no change
    assert state.effective_quorum() == 1 and state.spanning() == {"island-0"}
    assert state.rounds[0].quorum_since == 1000.0
    # every island it spans has pushed: due at once, not after the grace window
    assert state.merge_due(0, 1000.0)
    assert state.fold_order(0) is None  # not ordered_folds
    assert state.set_unsupported(frozenset(), 1001.0) is True
    assert state.effective_quorum() == 2 and state.rounds[0].quorum_since is None
    assert not state.merge_due(0, 2000.0)


def test_syncer_named_island_survives_a_restart_and_holds_no_round(tmp_path: Path) -> None:
    """In process, K = M = 2 (quorum 2), H = 4, lr 1e-3, movement cap 1.5: after three rounds
    of both islands, island-0's push waits for island-1's (the round spans both); island-1's
    eight zero pushes of 4 claimed steps are refused `work_unsupported` (island-0 moves 1e-3 x
    sqrt(n) / 4 a step, above the step cap 0.1 x 1.5 x 1e-3 x sqrt(n), so the bar is 4 x 1.5e-4
    x sqrt(n) / 32 > 0) and name it; the pending push then merges alone: fraction 1 (one island
    spans the round), complete. The syncer is stopped (its final checkpoint) and started again
    on its state dir: island-1 is still named (the health problem, the quorum), and island-0's
    next push merges alone at once."""
    spec = make_spec(**PAIR, sync={"fragments": 1, "quorum": 2, "graceSeconds": 0})

    async def scenario() -> None:
        syncer = await started(spec, tmp_path, FakeClock())
        try:
            await join_pair(syncer)
            honest, zero, carried = filled(syncer, 1e-3), filled(syncer, 0.0), filled(syncer, 1e-3)
            # Three rounds of both islands: the reference of each needs three pushes (OWN_MIN).
            for _ in range(3):
                for island, d in (("island-0", honest), ("island-1", carried)):
                    answer = await syncer.receive_push(0, body(syncer, 0, island, d, steps=4))
                    assert answer["accepted"], answer
                await syncer.tick()
            assert [e["complete"] for e in merge_log(tmp_path)] == [True] * 3
            answer = await syncer.receive_push(0, body(syncer, 0, "island-0", honest, steps=4))
            assert answer["accepted"], answer
            await syncer.tick()
            assert len(merge_log(tmp_path)) == 3  # K = M: it waits for island-1
            for _ in range(guards.AT_BOUND_PUSHES):
                with pytest.raises(guards.ContributionRefused) as err:
                    await syncer.receive_push(0, body(syncer, 0, "island-1", zero, steps=4))
                assert err.value.code == protocol.ERROR_UNSUPPORTED_WORK
            assert syncer.state.unsupported == {"island-1"}
            assert syncer.state.effective_quorum() == 1
            await syncer.tick()
            last = merge_log(tmp_path)[-1]
            assert len(merge_log(tmp_path)) == 4 and [
                c["island"] for c in last["contributors"]
            ] == ["island-0"]
            assert last["fraction"] == pytest.approx(1.0) and last["complete"] is True
        finally:
            await syncer.stop()  # the final checkpoint
        loaded = ckpt.load_latest(tmp_path)
        assert loaded is not None and loaded.document.guards is not None
        # island-0's fourth push was judged against island-1's three: 2.5e-4 a step over the
        # cap's 1.5e-4 (island-1's own 2.5e-4 is above it), 5/3; island-1's eight moved nothing.
        assert loaded.document.guards.carried == [
            {"island-0": [pytest.approx(5 / 3, rel=1e-4)], "island-1": [0.0] * 8}
        ]
        again = await started(spec, tmp_path, FakeClock())
        try:
            assert again.gate.unsupported_islands() == {"island-1"}
            assert again.state.unsupported == {"island-1"}
            assert again.state.effective_quorum() == 1
            problems = {p["kind"]: p["message"] for p in again.health.to_json()["problems"]}
            assert "island-1" in problems.get(WORK_UNSUPPORTED, ""), problems
            assert AT_BOUND not in problems
            answer = await again.receive_push(0, body(again, 0, "island-0", honest, steps=4))
            assert answer["accepted"], answer
            await again.tick()
            last = merge_log(tmp_path)[-1]
            assert len(merge_log(tmp_path)) == 5 and [
                c["island"] for c in last["contributors"]
            ] == ["island-0"]
            assert last["complete"] is True
        finally:
            await again.stop()

    run(scenario())
