"""Issues 46/47: at K = M an island whose every push a guard refuses must not stall the job.

hetero17's CPU island at M = 4: the direction check refused every push of it (never counted
towards a drop: the others' votes decide it), the round spanned it (K = M), and fragment 0 never
merged again. Now REFUSED_RUN (3) refusals in a row to one fragment, whatever the reason, leave
the island out of the rounds and the quorum (intake/refused_runs.py, SyncState.set_unsupported)
until a push of it to that fragment is accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_operator.conditions import syncer_health
from diloco_operator.refusals import PROBLEM_EVENTS
from diloco_trainer.api import protocol
from diloco_trainer.syncer.intake import guards
from diloco_trainer.syncer.intake.refused_runs import REFUSED_RUN, RefusedRuns
from diloco_trainer.syncer.state.problems import LEFT_OUT

from .observations import syncer_view
from .test_rounds import make_state, push
from .test_syncer import FakeClock, body, make_spec, run, started
from .test_syncer_work_evidence import filled, merge_log


def test_three_refusals_in_a_row_to_one_fragment_leave_the_island_out() -> None:
    assert REFUSED_RUN == 3
    runs = RefusedRuns()
    runs.refused(0, "x")
    runs.refused(0, "x")
    assert runs.left_out() == {}  # two in a row: a blip, not yet a run
    runs.accepted(0, "x")  # an accepted push starts the run again
    runs.refused(0, "x")
    runs.refused(0, "x")
    assert runs.left_out() == {}
    runs.refused(0, "x")  # the third in a row since the last accepted one
    assert list(runs.left_out()) == ["x"] and "fragment 0" in runs.left_out()["x"]
    # Per fragment: pushes to fragment 1 accepted do not end fragment 0's run (its rounds would
    # wait for it again at every other push), nor do refusals to fragment 1 add to it.
    runs.accepted(1, "x")
    runs.refused(1, "y")
    runs.refused(1, "y")
    runs.refused(0, "y")
    assert list(runs.left_out()) == ["x"]
    runs.accepted(0, "x")  # the first push of it to that fragment accepted: counted again
    assert runs.left_out() == {}
    runs.refused(1, "y")
    assert list(runs.left_out()) == ["y"]
    runs.forget("y")  # dropped: its runs start again
    assert runs.left_out() == {} and runs.counts == {}


def test_k_equals_m_does_not_wait_for_a_left_out_island() -> None:
    """K = M = 3: the two honest pushes wait for the third island's, however long (the round
    spans all three); left out, it does not count: quorum min(3, 3 - 1) = 2, and the round of
    the two is due at once (every island it spans has pushed)."""
    state = make_state(quorum=3, islands=3, grace=5.0)
    push(state, "island-0", 10.0)
    push(state, "island-1", 11.0)
    assert state.effective_quorum() == 3 and not state.merge_due(0, 1000.0)
    assert state.set_unsupported(frozenset({"island-2"}), 1000.0) is True
    assert state.effective_quorum() == 2 and state.spanning() == {"island-0", "island-1"}
    assert state.merge_due(0, 1000.0)


def test_k_below_m_keeps_its_quorum_when_the_adversary_leaves_itself_out() -> None:
    """K = 2 of M = 3: an adversary refused and left out lowers nothing: min(2, 3 - 1) = 2, so a
    round still needs two accepted pushes (one honest push alone waits); only with more than
    M - K = 1 island left out or gone does the quorum fall below K: min(2, 3 - 2) = 1, which
    needs the guards to refuse an honest island (a majority of the direction votes, the median
    over islands: not a minority of adversaries)."""
    state = make_state(quorum=2, islands=3, grace=5.0)
    push(state, "island-0", 10.0)
    state.set_unsupported(frozenset({"island-2"}), 20.0)
    assert state.effective_quorum() == 2
    assert state.rounds[0].quorum_since is None and not state.merge_due(0, 1000.0)
    state.set_unsupported(frozenset({"island-1", "island-2"}), 30.0)
    assert state.effective_quorum() == 1 and state.rounds[0].quorum_since == 30.0


def test_syncer_k_equals_m_merges_past_an_island_the_direction_check_refuses(
    tmp_path: Path,
) -> None:
    """In process, K = M = 3: island-0 and island-1 push +1e-3 an element (accepted, pending:
    the round waits for island-2); island-2 pushes -1e-3, cosine -1 with each of them: refused
    by the direction check (norm_outlier, never towards a drop). Two such refusals leave the
    round open; the third leaves island-2 out (quorum 2) and the round merges the two honest
    pushes, complete (the round spans the two). island-2 is not dropped; its next push along
    the others' descent is accepted and it counts again (quorum 3)."""
    spec = make_spec(
        sync={"fragments": 1, "quorum": 3, "graceSeconds": 0},
        syncer={"guards": {"maxRefusals": 2}},  # never reached: direction refusals do not count
    )

    async def scenario() -> None:
        syncer = await started(spec, tmp_path, FakeClock())
        try:
            for island in ("island-0", "island-1", "island-2"):
                await syncer.islands.join(island, 1)
            honest, against = filled(syncer, 1e-3), filled(syncer, -1e-3)
            for island in ("island-0", "island-1"):
                answer = await syncer.receive_push(0, body(syncer, 0, island, honest))
                assert answer["accepted"], answer
            for n in range(1, REFUSED_RUN + 1):
                assert syncer.state.effective_quorum() == 3 and syncer.state.versions == [0], n
                assert LEFT_OUT not in syncer.health.problems, n  # two refusals: a blip
                with pytest.raises(guards.ContributionRefused) as err:
                    await syncer.receive_push(0, body(syncer, 0, "island-2", against))
                assert err.value.code == protocol.ERROR_NORM_OUTLIER
                assert "points against" in str(err.value)
                await syncer.tick()
            assert syncer.gate.unsupported_islands() == {"island-2"}
            assert syncer.state.versions == [1]  # merged at the third refusal's tick
            last = merge_log(tmp_path)[-1]
            assert sorted(c["island"] for c in last["contributors"]) == ["island-0", "island-1"]
            assert last["complete"] is True
            assert syncer.state.membership.islands["island-2"].state == protocol.STATE_ACTIVE
            assert syncer.gate.refusals_json() == {"island-2": {protocol.ERROR_NORM_OUTLIER: 3}}
            status = await syncer.status()
            assert status["quorum"] == 2
            # Named as a health problem of its own: the job's SyncerHealthy condition says
            # IslandLeftOut, and the operator posts the Event IslandLeftOutOfRounds once.
            named = syncer.health.problems[LEFT_OUT]["message"]
            assert "island island-2's last 3 pushes to fragment 0 were all refused" in named
            healthy, reason, _ = syncer_health(syncer_view(status))
            assert (healthy, reason) == (False, "IslandLeftOut")
            assert PROBLEM_EVENTS[LEFT_OUT][0] == "IslandLeftOutOfRounds"
            # Its next push along the descent: accepted, and it is an island of the rounds again.
            answer = await syncer.receive_push(0, body(syncer, 0, "island-2", honest))
            assert answer["accepted"], answer
            assert syncer.gate.unsupported_islands() == frozenset()
            assert syncer.state.effective_quorum() == 3
            assert LEFT_OUT not in syncer.health.problems  # cleared with it
        finally:
            await syncer.stop()

    run(scenario())
