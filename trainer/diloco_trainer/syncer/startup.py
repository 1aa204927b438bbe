"""A syncer's start: from the newest valid checkpoint of its state dir, or afresh.

Checkpoints on disk that are corrupt (checkpoint.py: hashes, readability, finite tensors) are
never resumed. When a valid one remains, the syncer resumes from the newest valid one and sets the
corrupt newer ones aside (so pruning and the next checkpoint's name are not confused by them).
When checkpoints are present and none is valid, the syncer refuses to start (ConfigError naming
each and what is wrong with it: exit code 2), unless syncer.checkpoint.allowFreshStartOnCorrupt
is set: then it sets them all aside and starts afresh. Either way the corrupt checkpoints are a
health problem until the next checkpoint is written.

Island records of a checkpoint are restored only for the job's own island names, at most as many
as the job has (admission.py), so islands created by a flood of joins do not come back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from diloco_trainer.api.spec import ConfigError
from diloco_trainer.syncer import checkpoint as ckpt
from diloco_trainer.syncer.admission import admitted_records
from diloco_trainer.syncer.health import CORRUPT
from diloco_trainer.syncer.rounds import SyncState

if TYPE_CHECKING:
    from diloco_trainer.syncer.service import Syncer

log = logging.getLogger("diloco.syncer")


def corrupt_message(state_dir: str, corrupt: list[tuple[str, str]]) -> str:
    """The error of a state dir whose checkpoints are all corrupt."""
    lines = "; ".join(f"{path}: {why}" for path, why in corrupt)
    return (
        f"every checkpoint in {state_dir} is corrupt ({lines}); refusing to start afresh over "
        "them: restore a checkpoint, or set syncer.checkpoint.allowFreshStartOnCorrupt to start "
        "the job from scratch"
    )


def resume_or_init(syncer: Syncer) -> None:
    """Restore the newest valid checkpoint, or start afresh (see the module docstring)."""
    found = ckpt.load_newest_valid(syncer.state_dir)
    if found.corrupt:
        if (
            found.checkpoint is None
            and not syncer.spec.syncer.checkpoint.allow_fresh_start_on_corrupt
        ):
            raise ConfigError(
                corrupt_message(str(syncer.state_dir), [(str(p), w) for p, w in found.corrupt])
            )
        for path, why in found.corrupt:
            aside = ckpt.set_aside(path)
            log.error("checkpoint %s is corrupt (%s); set aside as %s", path, why, aside.name)
        names = ", ".join(p.name for p, _ in found.corrupt)
        syncer.health.report(CORRUPT, f"corrupt checkpoints set aside at start: {names}")
    if found.checkpoint is None:
        loss = syncer.jobs.evaluate_initial(step=syncer.state.outer_step, tokens=syncer.tokens)
        log.info(
            "fresh start: %d fragments, initial eval loss %.4f", len(syncer.model.fragments), loss
        )
    else:
        restore(syncer, found.checkpoint)
    syncer.finished = syncer.stop_reached()
    syncer.metrics.outer_step.set(syncer.state.outer_step)


def restore(syncer: Syncer, loaded: ckpt.Checkpoint) -> None:
    """Load a checkpoint into the syncer's rooms."""
    syncer.model.restore(loaded)
    m = loaded.manifest
    if m.get("specHash") != syncer.spec_hash:
        log.warning("the job spec changed since checkpoint %s; resuming anyway", loaded.path)
    n = len(syncer.model.fragments)
    rounds = [syncer.model.outer.rounds(f) for f in range(n)]
    syncer.state = SyncState(syncer.state.policy, n, versions=m["versions"], rounds=rounds)
    syncer.state.restore_clocks(m.get("workClocks", []))
    islands, left_out = admitted_records(syncer.gate.admission, m.get("islands", {}))
    if left_out:
        log.warning("not restoring islands that are not this job's: %s", ", ".join(left_out[:20]))
    syncer.state.restore_islands(dict(islands), now=syncer.clock())
    syncer.state.restore_answers(m.get("pushAnswers", []))
    syncer.gate.guard.history.restore(m.get("normHistory", []))
    syncer.merge_log.restore(m)
    syncer.jobs.restore(m, loaded.outer_step)
    syncer.resumed_from = str(loaded.path)
    log.info(
        "resumed from %s: %d fragments, outer step %d, versions %s",
        loaded.path,
        n,
        loaded.outer_step,
        syncer.state.versions,
    )
