"""A syncer's start: build() makes every part of the service from the newest valid checkpoint of
its state dir, or afresh, and hands them over (service.Syncer takes them; nothing here reaches
into a built service).

Checkpoints on disk that are corrupt (checkpoint.py: hashes, readability, finite tensors) are
never resumed. When a valid one remains, the syncer resumes from the newest valid one and sets the
corrupt newer ones aside (so pruning and the next checkpoint's name are not confused by them).
When checkpoints are present and none is valid, the syncer refuses to start (ConfigError naming
each and what is wrong with it: exit code 2), unless syncer.checkpoint.allowFreshStartOnCorrupt
is set: then it sets them all aside and starts afresh. Either way the corrupt checkpoints are a
health problem until the next checkpoint is written.

The checkpoint's manifest is read through its model (api/manifest.CheckpointManifest). Island
records of a checkpoint are restored only for the job's own island names, at most as many as the
job has (admission.py), so islands created by a flood of joins do not come back. The guards'
hard norm caps are derived from the weights the job starts from (resumed or initial).

A state dir where the quality guard ended the job (storage/guard_end.py's record) starts
finished: the checkpoints after the best are set aside again (a crash may have come between the
record and the setting aside), so the syncer resumes from the best (or, when the initial weights
were the best, afresh: a function of the spec); the status names the best as the final
checkpoint, the health problem evalLossRose carries the recorded message, and no push is merged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.api.spec import ConfigError, JobSpec
from diloco_trainer.models.parts import TrainingParts, build_parts
from diloco_trainer.syncer.edge import ShardScope
from diloco_trainer.syncer.intake import (
    Admission,
    ContributionGuard,
    Gate,
    admitted_records,
    make_guard,
)
from diloco_trainer.syncer.merging import GlobalModel, MergeLog, Merger
from diloco_trainer.syncer.service.jobs import BackgroundJobs
from diloco_trainer.syncer.serving import Publisher
from diloco_trainer.syncer.state import (
    CORRUPT,
    EVAL_LOSS_ROSE,
    FAINT_ENDED,
    Health,
    SyncerMetrics,
    SyncState,
    round_policy,
    stop_reached,
)
from diloco_trainer.syncer.storage import FAINT_NAMED, GuardEnd, read_guard_end
from diloco_trainer.syncer.storage import checkpoint as ckpt

log = logging.getLogger("diloco.syncer")


@dataclass
class SyncerParts:
    """What a syncer is made of, built by build() (see service.Syncer for what each does)."""

    metrics: SyncerMetrics
    health: Health
    parts: TrainingParts
    model: GlobalModel
    publisher: Publisher
    state: SyncState
    merge_log: MergeLog
    merger: Merger
    jobs: BackgroundJobs
    gate: Gate
    spec_hash: str
    resumed_from: str | None  # the checkpoint it resumed from, None for a fresh start
    # stopAfter was reached before the start (a restart after the finish), or the quality guard
    # ended the job (storage/guard_end.py)
    finished: bool


def corrupt_message(state_dir: str, corrupt: list[tuple[str, str]]) -> str:
    """The error of a state dir whose checkpoints are all corrupt."""
    lines = "; ".join(f"{path}: {why}" for path, why in corrupt)
    return (
        f"every checkpoint in {state_dir} is corrupt ({lines}); refusing to start afresh over "
        "them: restore a checkpoint, or set syncer.checkpoint.allowFreshStartOnCorrupt to start "
        "the job from scratch"
    )


# Under the state dir: the encoded pushes of open rounds (folding.py), emptied at start.
PENDING_DIR = "pending"
# Under the state dir: θ_pub's older updates, served in update chains (update_history.py),
# emptied at start.
HISTORY_DIR = "history"


def build(
    spec: JobSpec,
    *,
    state_dir: Path,
    clock: Callable[[], float],
    config_file: Path | None = None,
    shard: int = 0,
) -> SyncerParts:
    """Every part of a syncer, from the newest valid checkpoint or afresh (see the module
    docstring); ConfigError when every checkpoint on disk is corrupt or one does not fit."""
    metrics = SyncerMetrics()
    health = Health(clock, metrics.healthy)
    parts = build_parts(spec, shard_index=0, num_shards=spec.total_shards(), with_train=False)
    n = spec.sync.fragments
    # One shard of several (shard_scope.py): it holds only its own fragments' tensors, and its
    # outer step and tokens count them; it evaluates nothing (no process holds the whole model).
    scope = ShardScope.of(spec, shard, n) if spec.syncer.shards > 1 else None
    owned = None if scope is None else scope.owned
    model = GlobalModel(spec, parts.model, parts.plain_merge_names, owned=owned)
    model.folds.spill_to(state_dir / PENDING_DIR)  # pending pushes on disk, not in memory
    publisher = Publisher(  # θ_pub's older updates on disk, not in memory
        model,
        max_staleness=spec.staleness_bound(),
        metrics=metrics,
        history_dir=state_dir / HISTORY_DIR,
    )
    merge_log = MergeLog(n, state_dir) if scope is None else scope.new_merge_log(n, state_dir)
    jobs = BackgroundJobs(
        spec,
        parts,
        model,
        state_dir=state_dir,
        metrics=metrics,
        clock=clock,
        health=health,
        evaluates=scope is None,
    )
    end = read_guard_end(state_dir)  # ConfigError when unreadable
    if end is not None:
        _keep_the_end(end, state_dir)
    loaded = _newest_valid(spec, state_dir, health)
    spec_hash = ckpt.spec_hash(spec.to_json())
    if loaded is not None and loaded.document.spec_hash != spec_hash:
        log.warning("the job spec changed since checkpoint %s; resuming anyway", loaded.path)
    policy = round_policy(spec, n)
    new_state = SyncState if scope is None else scope.new_state
    if loaded is None:
        state = new_state(policy, n)
    else:
        model.restore(loaded)  # ConfigError when it does not fit the model
        rounds = [model.outer.rounds(f) for f in range(n)]
        state = new_state(policy, n, versions=loaded.document.versions, rounds=rounds)
    guard = _guard(spec, model, loaded)
    if loaded is None:
        loss = jobs.evaluate_initial(step=state.outer_step, tokens=merge_log.tokens)
        log.info("fresh start: %d fragments, initial eval loss %s", n, loss)
    else:
        _restore_counters(loaded, state, Admission.from_spec(spec), merge_log, jobs, now=clock())
    gate = Gate(spec, guard=guard, metrics=metrics, config_file=config_file, health=health)
    gate.watch()  # the restored naming is reported at once, not at the next push
    gate.update_unsupported(state, clock())
    if end is not None:
        _restore_the_end(end, loaded, jobs, health)
    return SyncerParts(
        metrics=metrics,
        health=health,
        parts=parts,
        model=model,
        publisher=publisher,
        state=state,
        merge_log=merge_log,
        merger=Merger(model, merge_log, rule=spec.sync.merge, health=health, metrics=metrics),
        jobs=jobs,
        gate=gate,
        spec_hash=spec_hash,
        resumed_from=None if loaded is None else str(loaded.path),
        finished=end is not None
        or stop_reached(spec, outer_step=state.outer_step, tokens=merge_log.tokens),
    )


def _guard(spec: JobSpec, model: GlobalModel, loaded: ckpt.Checkpoint | None) -> ContributionGuard:
    """The guards, with the checkpoint's figures: the norm history, and who was named and on
    what figures (an island cannot wait for a restart to get a clean slate). The hard norm caps
    follow the weights the job starts from."""
    guard = make_guard(spec, model.numels(), model.fragment_norms())
    if loaded is not None:
        guard.history.restore(loaded.document.norm_history)
        guard.restore(loaded.document.guards, islands=loaded.document.islands.keys())
    return guard


def _keep_the_end(end: GuardEnd, state_dir: Path) -> None:
    """The quality guard ended this job before the start: set aside the checkpoints after its
    best, so that the syncer resumes from the best (see the module docstring)."""
    for path in ckpt.set_aside_after(state_dir, end.best_step if end.best is not None else 0):
        log.warning("checkpoint set aside as %s: the quality guard ended the job", path.name)
    log.warning("the quality guard ended this job: %s", end.message)


def _restore_the_end(
    end: GuardEnd, loaded: ckpt.Checkpoint | None, jobs: BackgroundJobs, health: Health
) -> None:
    """The job stays ended as the quality guard ended it: its final checkpoint and problem."""
    jobs.restore_end(end)
    health.report(FAINT_ENDED if end.kind == FAINT_NAMED else EVAL_LOSS_ROSE, end.message)
    if end.best is not None and (loaded is None or loaded.path.name != end.best):
        # The best was deleted or is corrupt: the job stays ended all the same.
        log.error("the quality guard's best checkpoint %s is not the one resumed", end.best)


def _newest_valid(spec: JobSpec, state_dir: Path, health: Health) -> ckpt.Checkpoint | None:
    """The newest valid checkpoint, with the corrupt ones set aside (or ConfigError: see the
    module docstring)."""
    found = ckpt.load_newest_valid(state_dir)
    if found.corrupt:
        if found.checkpoint is None and not spec.syncer.checkpoint.allow_fresh_start_on_corrupt:
            raise ConfigError(
                corrupt_message(str(state_dir), [(str(p), w) for p, w in found.corrupt])
            )
        for path, why in found.corrupt:
            aside = ckpt.set_aside(path)
            log.error("checkpoint %s is corrupt (%s); set aside as %s", path, why, aside.name)
        names = ", ".join(p.name for p, _ in found.corrupt)
        health.report(CORRUPT, f"corrupt checkpoints set aside at start: {names}")
    return found.checkpoint


def _restore_counters(
    loaded: ckpt.Checkpoint,
    state: SyncState,
    admission: Admission,
    merge_log: MergeLog,
    jobs: BackgroundJobs,
    *,
    now: float,
) -> None:
    """Load what a checkpoint's manifest holds besides the tensors into the parts being built."""
    m = loaded.document
    state.clocks.restore(m.work_clocks)
    islands, left_out = admitted_records(admission, m.islands)
    if left_out:
        log.warning("not restoring islands that are not this job's: %s", ", ".join(left_out[:20]))
    state.membership.restore(islands, now=now, counts=m.counts)
    state.restore_answers(m.push_answers)
    merge_log.restore(m)
    jobs.restore(m, loaded.outer_step)
    log.info(
        "resumed from %s: %d fragments, outer step %d, versions %s",
        loaded.path,
        len(state.rounds),
        loaded.outer_step,
        state.versions,
    )
