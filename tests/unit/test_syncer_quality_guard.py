"""Issue 46, the quality guard (syncer.qualityGuard, syncer/state/quality.py) with hand-derived
values: `patience` evaluations in a row above (1 + margin) x the best before them trip it; the
pruning keeps the best checkpoint; an in-process syncer whose global model is pushed uphill ends
the job with the best checkpoint as its final one and the health problem evalLossRose, which the
operator shows as SyncerHealthy False (EvalLossRose) and one Warning Event."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_operator.conditions import job_conditions, syncer_health
from diloco_operator.phase import GUARD_ENDED, decide_phase
from diloco_operator.refusals import EVAL_LOSS_ROSE, EVAL_LOSS_ROSE_MESSAGE, post_refusal_events
from diloco_trainer.api.spec import ConfigError, JobSpec, parse_spec
from diloco_trainer.syncer.state.problems import EVAL_LOSS_ROSE as KIND
from diloco_trainer.syncer.state.quality import Kept, Trip, best_due, judged, tripped
from diloco_trainer.syncer.storage import checkpoint as ckpt
from diloco_trainer.syncer.storage.guard_end import (
    FINAL_ROSE,
    GUARD_END_FILE,
    TRIPPED,
    GuardEnd,
    read_guard_end,
    write_guard_end,
)

from .observations import SYNCER, observation, syncer_view
from .test_operator_refusals import JOB, OWN, _posted
from .test_syncer import FakeClock, body, make_spec, run, started

# margin 0.25 over a best of 2.0: the limit is 2.5 exactly in binary floating point.
M = 0.25


def test_trip_after_patience_rises_in_a_row() -> None:
    # 2.0 is the best; 2.6, 2.7, 2.51 are each above 2.5: three rises, patience 3.
    assert tripped([3.0, 2.0, 2.6, 2.7, 2.51], margin=M, patience=3) == Trip(
        best=2.0, rises=(2.6, 2.7, 2.51)
    )
    # One short of patience: two rises after the best.
    assert tripped([3.0, 2.0, 2.6, 2.7], margin=M, patience=3) is None
    # The best is the lowest before the tail, wherever it is: 1.9 (limit 2.375) -> 2.4 rises.
    assert tripped([1.9, 2.0, 2.4, 2.4], margin=M, patience=2) == Trip(best=1.9, rises=(2.4, 2.4))


def test_trip_is_strict_and_reset_by_a_loss_within_the_margin() -> None:
    # 2.5 is exactly the limit: no rise, so no trip.
    assert tripped([2.0, 2.6, 2.5, 2.6], margin=M, patience=3) is None
    # A loss within the margin in the middle breaks the run of rises.
    assert tripped([2.0, 2.6, 2.1, 2.6], margin=M, patience=3) is None
    # patience 1: a single rise trips; 5% over 2.0 is 2.1, and 2.2 is above it.
    assert tripped([2.0, 2.2], margin=0.05, patience=1) == Trip(best=2.0, rises=(2.2,))


def test_trip_needs_a_reference_and_is_off_at_patience_zero() -> None:
    assert tripped([9.0], margin=M, patience=1) is None  # nothing before it
    assert tripped([], margin=M, patience=1) is None
    assert tripped([2.0, 9.0, 9.0, 9.0], margin=M, patience=0) is None


def test_evaluations_of_the_warm_up_are_never_judged() -> None:
    # warmupOuterSteps 20: outer step 20 is still the warm-up's, 21 the first judged.
    assert not judged(20, 20) and judged(21, 20)
    assert judged(1, 0) and not judged(0, 0)


def test_trip_message_names_the_best_the_rises_and_the_model_kept() -> None:
    trip = Trip(best=2.0, rises=(2.6, 2.7))
    text = trip.message(0.05, Kept(outer_step=7, loss=2.0))
    assert "1.05 x the best (2.0000)" in text
    assert "2 evaluations in a row (latest 2.7000, worst 2.7000)" in text
    assert text.endswith("the job ends with the best checkpoint (outer step 7)")
    # The kept checkpoint is not the best evaluation: the message names it, loss and step.
    text = trip.message(0.05, Kept(outer_step=5, loss=2.05))
    assert text.endswith(
        "the job ends with the best checkpoint kept (outer step 5, eval loss 2.0500, "
        "within 1.05 x the best)"
    )
    assert trip.message(0.05, None).endswith(
        "the job ends with the initial weights (no best checkpoint was kept)"
    )


def test_a_new_best_is_written_when_none_is_kept_at_a_regular_step_or_an_interval_on() -> None:
    # every 10, margin 0.25; a kept loss of 1.1 is within 1.25 x 1.0, so only the step decides.
    assert best_due(3, 1.0, None, every=10, margin=M)  # nothing kept yet
    assert best_due(10, 1.0, Kept(9, 1.1), every=10, margin=M)  # a regular checkpoint anyway
    assert best_due(13, 1.0, Kept(3, 1.1), every=10, margin=M)  # kept one 10 steps old
    assert not best_due(12, 1.0, Kept(3, 1.1), every=10, margin=M)  # 9 steps old


def test_a_new_best_is_written_when_the_kept_one_is_above_the_margin_over_it() -> None:
    # 1.25 x 2.0 = 2.5 exactly: a kept 2.5 is at the limit (strict: no write), above it writes.
    assert not best_due(5, 2.0, Kept(4, 2.5), every=10, margin=M)
    assert best_due(5, 2.0, Kept(4, 2.5000001), every=10, margin=M)
    # The smoke run of the issue: kept 4.4442 (outer step 1), new best 2.9576 at step 4:
    # 1.25 x 2.9576 = 3.697 < 4.4442, so step 4 is written (the old rule waited an interval).
    assert best_due(4, 2.9576, Kept(1, 4.4442), every=10, margin=M)


def test_eval_losses_decide_which_bests_are_written_and_the_trip_exports_the_kept_one(
    tmp_path: Path,
) -> None:
    """Hand-derived, margin 0.25, everyOuterSteps 100 (no regular checkpoint, no age write),
    patience 2, no warm-up; each loss is an evaluation at outer steps 1..9 (binary-exact):
      1: 0.875   new best, none kept             -> written (kept 0.875)
      2: 0.75    new best, 1.25 x 0.75 = 0.9375 >= 0.875   -> not written
      3: 0.625   new best, 1.25 x 0.625 = 0.78125 < 0.875  -> written (kept 0.625)
      4: 0.5     new best, 1.25 x 0.5 = 0.625, not below 0.625 (strict) -> not written
      5: 0.6     no best, not above 0.625: no rise
      6: 0.4375  new best, 1.25 x 0.4375 = 0.546875 < 0.625 -> written (kept 0.4375)
      7: 0.4     new best, 1.25 x 0.4 = 0.5 >= 0.4375     -> not written
      8: 0.75, 9: 0.8  two rises above 0.5: the trip (best 0.4), the job ends with step 6's
    checkpoint (0.4375, within 1.25 x 0.4), which the message names. The old rule (a best
    kept at most once per checkpoint interval) wrote step 1 only and exported 0.875."""
    spec = make_spec(
        islands={"count": 2},
        syncer={
            "qualityGuard": {"margin": M, "patience": 2, "warmupOuterSteps": 0},
            "checkpoint": {"everyOuterSteps": 100, "keep": 1},
        },
    )
    losses = [0.875, 0.75, 0.625, 0.5, 0.6, 0.4375, 0.4, 0.75, 0.8]

    async def scenario() -> tuple[list[int], list[Trip | None], dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        assert syncer.jobs.best_loss is not None and syncer.jobs.best_loss > losses[0]
        written: list[int] = []
        trips = []
        for step, loss in enumerate(losses, start=1):

            async def snapshot(step: int = step) -> Any:
                written.append(step)
                return replace(await syncer._checkpoint_snapshot(), outer_step=step)

            trips.append(await syncer.jobs._judge(loss, step, snapshot))
        trip = trips[-1]
        assert trip is not None
        await syncer._end_degraded(trip)
        status = await syncer.status()
        await syncer.stop()
        return written, trips, status

    written, trips, status = run(scenario())
    assert written == [1, 3, 6]
    assert trips[:-1] == [None] * 8 and trips[-1] == Trip(best=0.4, rises=(0.75, 0.8))
    assert status["finished"] and status["checkpoint"]["outerStep"] == 6
    [problem] = status["health"]["problems"]
    assert problem["kind"] == KIND
    assert "1.25 x the best (0.4000)" in problem["message"]
    assert problem["message"].endswith(
        "the job ends with the best checkpoint kept (outer step 6, eval loss 0.4375, "
        "within 1.25 x the best)"
    )
    end = read_guard_end(tmp_path)
    assert end is not None and (end.best, end.best_step) == (ckpt.checkpoint_name(6), 6)
    # keep 1: step 1 was pruned when step 6 was written (step 3, the best then, protected);
    # nothing came after 6, so the newest on disk (what a restart or an export takes) is it.
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == [ckpt.checkpoint_name(3), ckpt.checkpoint_name(6)]


def test_quality_guard_spec_defaults_and_field_errors() -> None:
    guard = parse_spec({}).syncer.quality_guard
    assert (guard.margin, guard.patience, guard.enabled) == (0.25, 5, True)
    assert guard.warmup_outer_steps == 20
    off = parse_spec({"syncer": {"qualityGuard": {"patience": 0}}})
    assert not off.syncer.quality_guard.enabled
    with pytest.raises(ValueError, match="margin"):
        parse_spec({"syncer": {"qualityGuard": {"margin": 0}}})


def test_pruning_leaves_the_protected_checkpoint_and_a_trip_sets_the_newer_aside(
    tmp_path: Path,
) -> None:
    weights = {"w": torch.zeros(2)}
    paths = [
        ckpt.save_checkpoint(
            tmp_path, outer_step=s, weights=weights, momentum={}, manifest={}, keep=5
        )
        for s in (1, 2, 3, 4)
    ]
    doomed = ckpt.prune_checkpoints(tmp_path, 2, protect=paths[0])
    # keep 2 of the others (3, 4): 2 goes; 1 is protected, neither counted nor deleted.
    assert doomed == [paths[1]]
    assert ckpt.list_checkpoints(tmp_path) == [paths[0], paths[2], paths[3]]
    # After a trip that kept step 1: 3 and 4 are set aside (never loaded, pruned or listed).
    moved = ckpt.set_aside_after(tmp_path, 1)
    assert [p.name for p in moved] == ["rose-ckpt-000000003", "rose-ckpt-000000004"]
    assert ckpt.list_checkpoints(tmp_path) == [paths[0]]
    assert ckpt.outer_step_of(paths[3]) == 4


def _uphill_spec(*, patience: int = 2, outer_steps: int = 100, warmup: int = 0) -> JobSpec:
    return make_spec(
        islands={"count": 2},
        sync={"quorum": 1, "graceSeconds": 0},
        stopAfter={"outerSteps": outer_steps},
        syncer={
            "qualityGuard": {
                "margin": 0.05,
                "patience": patience,
                "warmupOuterSteps": warmup,
            },
            # No movement cap: these pushes are far from AdamW's, and the guard is judged
            # alone (test_syncer_movement_cap.py is the cap's).
            "guards": {
                "warmupPushes": 1000,
                "maxDeltaNorm": 1e6,
                "maxRefusals": 0,
                "movementFactor": 0,
            },
            "checkpoint": {"everyOuterSteps": 100, "keep": 1},
        },
    )


def _uphill_scenario(
    tmp_path: Path, *, patience: int = 2, outer_steps: int = 100, warmup: int = 0
) -> tuple[list[dict[str, Any]], list[Path]]:
    """Two islands, quorum 1, patience 2 and margin 5%: island-0 shrinks the weights (lower
    eval loss at the random start: logits nearer uniform), island-1 then pushes one fixed
    random direction, large, twice; each push is an outer step (evaluated)."""
    spec = _uphill_spec(patience=patience, outer_steps=outer_steps, warmup=warmup)

    async def scenario() -> list[dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        for island in ("island-0", "island-1"):
            await syncer.islands.join(island, 1)
        names = syncer.fragments[0]
        shrink = {n: 0.2 * syncer.model.weights[n].clone() for n in names}
        g = torch.Generator().manual_seed(0)
        uphill = {n: 3.0 * torch.randn(syncer.model.weights[n].shape, generator=g) for n in names}
        seen = []
        for island, d in (("island-0", shrink), ("island-1", uphill), ("island-1", uphill)):
            # Two rounds of work each (8 steps of H = 4): one push is an outer step of two islands.
            await syncer.receive_push(0, body(syncer, 0, island, d, steps=8, tokens=200))
            await syncer.tick()
            seen.append(await syncer.status())
        await syncer.stop()
        return seen

    seen = run(scenario())
    return seen, ckpt.list_checkpoints(tmp_path)


def test_uphill_pushes_end_the_job_with_the_best_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen, on_disk = _uphill_scenario(tmp_path)
    losses = [e["evalLoss"] for e in seen[-1]["evalHistory"]]
    # Preconditions of the scenario: the shrink lowered the loss (the best, at outer step 1),
    # the uphill pushes raised it above 1.05 x that best twice.
    assert losses[1] < losses[0]
    assert losses[2] > 1.05 * losses[1] and losses[3] > 1.05 * losses[1]
    first, rose_once, ended = seen
    assert first["checkpoint"]["outerStep"] == 1  # the new best was checkpointed at once
    assert not rose_once["finished"] and rose_once["health"]["healthy"]
    assert ended["finished"]
    assert [p["kind"] for p in ended["health"]["problems"]] == [KIND]
    message = ended["health"]["problems"][0]["message"]
    assert f"best ({losses[1]:.4f})" in message
    assert message.endswith("the job ends with the best checkpoint (outer step 1)")
    # The final checkpoint is the best (outer step 1), not the weights that rose; with keep 1
    # the pruning kept it, and the stop wrote none of the later weights.
    assert ended["checkpoint"] == first["checkpoint"]
    assert on_disk == [Path(first["checkpoint"]["path"])]
    # The operator: SyncerHealthy False with reason EvalLossRose, one Warning Event.
    healthy, reason, _ = syncer_health(syncer_view(ended))
    assert (healthy, reason) == (False, "EvalLossRose")
    caplog.set_level("INFO", logger="diloco_operator")
    notes: dict[str, str] = {}
    for _ in range(2):
        post_refusal_events(JOB, syncer_view(ended), OWN, {}, notes)
    posted = [m for m in _posted(caplog) if m.startswith(EVAL_LOSS_ROSE)]
    assert posted == [f"{EVAL_LOSS_ROSE} {EVAL_LOSS_ROSE_MESSAGE}"]


def test_rises_inside_the_warm_up_do_not_end_the_job(tmp_path: Path) -> None:
    """The same uphill pushes with warmupOuterSteps 2: the rise at outer step 2 is not judged,
    the one at step 3 is one rise, short of patience 2; the best (step 1) was still kept."""
    seen, _ = _uphill_scenario(tmp_path, warmup=2)
    first, _, last = seen
    losses = [e["evalLoss"] for e in last["evalHistory"]]
    assert losses[2] > 1.05 * losses[1] and losses[3] > 1.05 * losses[1]  # both rose
    assert not last["finished"] and last["health"]["healthy"]
    assert first["checkpoint"]["outerStep"] == 1


def test_operator_phase_and_conditions_of_a_job_the_guard_ended() -> None:
    """The job the quality guard ended is Succeeded (the syncer finished; islands scale to zero)
    with a message that says so, not "reached spec.stopAfter", and SyncerHealthy False with
    reason EvalLossRose; a job that reached its budget keeps the old message."""
    problem = {"kind": KIND, "count": 1, "message": "eval loss rose ..."}
    ended = {**SYNCER, "finished": True, "health": {"healthy": False, "problems": [problem]}}
    verdict = decide_phase(observation(syncer=ended), {"phase": "Running"})
    assert (verdict.phase, verdict.message) == ("Succeeded", GUARD_ENDED)
    conditions = {c.type: c for c in job_conditions(verdict, observation(syncer=ended), {})}
    healthy = conditions["SyncerHealthy"]
    assert (healthy.status, healthy.reason) == ("False", "EvalLossRose")
    budget = decide_phase(observation(syncer={**SYNCER, "finished": True}), {"phase": "Running"})
    assert budget.message == "the syncer reached spec.stopAfter"


def test_a_finish_after_a_rise_keeps_the_best_checkpoint(tmp_path: Path) -> None:
    """The budget (3 outer steps) runs out after two rises, fewer than patience 3: the final
    evaluation is above 1.05 x the best checkpoint's, so the final checkpoint is the best one
    and evalLossRose is reported; the job ended at its budget all the same."""
    seen, on_disk = _uphill_scenario(tmp_path, patience=3, outer_steps=3)
    first, _, ended = seen
    losses = [e["evalLoss"] for e in ended["evalHistory"]]
    assert ended["finished"] and ended["outerStep"] == 3
    assert losses[-1] > 1.05 * losses[1]
    assert ended["checkpoint"] == first["checkpoint"]  # outer step 1, the best
    problem = ended["health"]["problems"][0]
    assert problem["kind"] == KIND
    assert f"final eval loss {losses[-1]:.4f} above 1.05 x" in problem["message"]
    assert problem["message"].endswith("the final checkpoint is that best one (outer step 1)")
    # The finish's own checkpoint (of outer step 3) was written, then set aside: the newest
    # on disk is the best (a restart resumes from it, an export of the state dir takes it).
    assert [p.name for p in on_disk] == [ckpt.checkpoint_name(1)]
    aside = sorted(p.name for p in on_disk[0].parent.iterdir())
    assert aside == [ckpt.checkpoint_name(1), ckpt.ROSE_PREFIX + ckpt.checkpoint_name(3)]


def _restarted(tmp_path: Path, spec: JobSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """A syncer started again on the state dir: its status, then its answer to a push of
    island-1 (with a tick after it, so a due merge would run) and the status after."""

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        before = await syncer.status()
        await syncer.islands.join("island-1", 1)
        names = syncer.fragments[0]
        d = {n: 0.1 * torch.ones_like(syncer.model.weights[n]) for n in names}
        answer = await syncer.receive_push(0, body(syncer, 0, "island-1", d, steps=8, tokens=200))
        await syncer.tick()
        after = await syncer.status()
        await syncer.stop()
        assert after["versions"] == before["versions"]  # nothing merged
        return before, answer

    return run(scenario())


def test_a_syncer_restarted_after_a_trip_stays_finished(tmp_path: Path) -> None:
    """The trip's end is on disk (quality-guard-end.json): the restarted syncer is finished,
    names the same best checkpoint as the final one, reports evalLossRose with the same
    message, resumed from the best, and answers a push `finished` without merging it."""
    seen, _ = _uphill_scenario(tmp_path)
    ended = seen[-1]
    end = read_guard_end(tmp_path)
    assert end is not None and end.kind == TRIPPED
    assert (end.best, end.best_step) == (ckpt.checkpoint_name(1), 1)
    assert end.message == ended["health"]["problems"][0]["message"]
    status, answer = _restarted(tmp_path, _uphill_spec())
    assert status["finished"] and status["checkpoint"] == ended["checkpoint"]
    assert status["resumedFrom"] == ended["checkpoint"]["path"]
    assert status["outerStep"] == 1  # the best's: the weights that rose were never kept
    assert [(p["kind"], p["message"]) for p in status["health"]["problems"]] == [
        (KIND, end.message)
    ]
    assert answer["finished"] and not answer["accepted"]
    # A second restart finds the same (the record is not consumed by a start).
    again, _ = _restarted(tmp_path, _uphill_spec())
    assert again["finished"] and again["checkpoint"] == ended["checkpoint"]


def test_a_syncer_restarted_after_a_finish_that_rose_stays_finished(tmp_path: Path) -> None:
    """The budget's finish whose final evaluation rose (outer step 3) set its checkpoint aside:
    the restart resumes from the best (outer step 1, short of the budget of 3) and still does
    not merge: the end on disk says the job is over."""
    seen, _ = _uphill_scenario(tmp_path, patience=3, outer_steps=3)
    ended = seen[-1]
    end = read_guard_end(tmp_path)
    assert end is not None and end.kind == FINAL_ROSE and end.best_step == 1
    status, answer = _restarted(tmp_path, _uphill_spec(patience=3, outer_steps=3))
    assert status["finished"] and status["outerStep"] == 1
    assert status["checkpoint"] == ended["checkpoint"]
    assert status["health"]["problems"][0]["message"].startswith("final eval loss")
    assert answer["finished"]


def test_a_start_after_a_crash_before_the_setting_aside_sets_them_aside(tmp_path: Path) -> None:
    """The end was written but the process died before setting aside the checkpoints after
    the best: the start sets them aside and resumes from the best."""
    seen, _ = _uphill_scenario(tmp_path)
    best = Path(seen[-1]["checkpoint"]["path"])
    # As if the crash came before the setting aside: a later checkpoint is still listed.
    later = best.with_name(ckpt.checkpoint_name(3))
    (best.parent / (ckpt.ROSE_PREFIX + ckpt.checkpoint_name(3))).mkdir()
    shutil.copytree(best, later)
    status, _ = _restarted(tmp_path, _uphill_spec())
    assert status["finished"] and status["resumedFrom"] == str(best)
    assert ckpt.list_checkpoints(tmp_path) == [best]
    assert (best.parent / f"{ckpt.ROSE_PREFIX}{later.name}.1").is_dir()


def test_guard_end_record_round_trips_and_a_bad_one_is_a_config_error(tmp_path: Path) -> None:
    end = GuardEnd(TRIPPED, "rose", ckpt.checkpoint_name(12), 12, 5.0)
    write_guard_end(tmp_path, end)
    assert read_guard_end(tmp_path) == end
    assert [p.name for p in tmp_path.iterdir()] == [GUARD_END_FILE]  # no temporary left
    none = GuardEnd(FINAL_ROSE, "rose", None, 0, 5.0)
    write_guard_end(tmp_path, none)  # replaces the old one
    assert read_guard_end(tmp_path) == none
    assert read_guard_end(tmp_path / "elsewhere") is None
    path = tmp_path / GUARD_END_FILE
    bad = [
        ("{", "not a valid record"),
        ('{"formatVersion": 2}', "formatVersion 1"),
        ('{"formatVersion": 1, "kind": "x", "message": "m", "best": null, "time": 1}', "kind"),
        # A name outside the checkpoints, or a step that is not the name's.
        (
            '{"formatVersion": 1, "kind": "tripped", "message": "m", "time": 1,'
            ' "best": {"checkpoint": "../x", "outerStep": 1}}',
            "not a checkpoint name",
        ),
        (
            '{"formatVersion": 1, "kind": "tripped", "message": "m", "time": 1,'
            ' "best": {"checkpoint": "ckpt-000000012", "outerStep": 11}}',
            "outerStep 11",
        ),
    ]
    for text, why in bad:
        path.write_text(text)
        with pytest.raises(ConfigError, match=why) as err:
            read_guard_end(tmp_path)
        assert GUARD_END_FILE in str(err.value)
