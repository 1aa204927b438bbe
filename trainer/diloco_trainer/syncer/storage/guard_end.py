"""The quality guard's end of a job, on disk: a restarted syncer stays finished (issue 46).

When the quality guard ends a job (a trip, or the budget's finish with a final evaluation above
(1 + margin) x the best checkpoint's: service/jobs.py), the checkpoints after the best are set
aside and the newest on disk is the best. A syncer restarted on that state dir would resume from
the best and, knowing nothing of the end, merge the bad island again. So the end is written
here, beside the checkpoints, before they are set aside::

    state_dir/quality-guard-end.json
      {"formatVersion": 1, "kind": "tripped" | "finalRose" | "faintNamed", "message": "...",
       "best": {"checkpoint": "ckpt-000000012", "outerStep": 12} | null,
       "time": 1764390000.0}

`best` null: no evaluation after the start was the best (the initial weights, a function of the
spec, are the final model). The file is JSON (nothing pickled), written to a temporary file,
fsynced and renamed over the old one (a rename within one filesystem is atomic), so a crash
leaves the old file or the new one. A start (service/startup.py) that finds it stays finished:
the same final checkpoint (the ones after it set aside again, in case the crash came between
this file and the setting aside), the health problem evalLossRose (faintIslandEnded for the
kind faintNamed: a job of two that ended for an island's faint claims) with the same message, no
merges. To resume merging anyway (say, after the bad island was removed from the job), delete
this file; the syncer then resumes from the best checkpoint. An unreadable file is a ConfigError
naming it (exit 2): ignoring it would resume merging the weights the guard stopped.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_trainer.api.spec import ConfigError
from diloco_trainer.syncer.storage.checkpoint import (
    CHECKPOINTS_DIR,
    PREFIX,
    _fsync_dir,
    outer_step_of,
)

GUARD_END_FILE = "quality-guard-end.json"
FORMAT_VERSION = 1
TRIPPED = "tripped"  # patience rises in a row (state/quality.tripped)
FINAL_ROSE = "finalRose"  # the budget's final evaluation rose above the best checkpoint's
# A job of two ended for an island's faint pushes with claims (intake/gate.Gate.faint_end): the
# same end at the best, its health problem state/problems.FAINT_ENDED.
FAINT_NAMED = "faintNamed"
KINDS = (TRIPPED, FINAL_ROSE, FAINT_NAMED)


@dataclass(frozen=True)
class GuardEnd:
    """How the quality guard ended the job: why (`kind`, the health message) and its final
    checkpoint (`best`, the directory name under checkpoints/; None: the initial weights)."""

    kind: str
    message: str
    best: str | None
    best_step: int
    time: float

    def to_json(self) -> dict[str, Any]:
        best = None if self.best is None else {"checkpoint": self.best, "outerStep": self.best_step}
        return {
            "formatVersion": FORMAT_VERSION,
            "kind": self.kind,
            "message": self.message,
            "best": best,
            "time": self.time,
        }

    @classmethod
    def from_json(cls, doc: Any) -> GuardEnd:
        """The end a document records; ValueError saying what is wrong with it."""
        if not isinstance(doc, dict) or doc.get("formatVersion") != FORMAT_VERSION:
            raise ValueError(f"not a formatVersion {FORMAT_VERSION} object")
        kind, message, best, when = (doc.get(k) for k in ("kind", "message", "best", "time"))
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(message, str) or not isinstance(when, int | float):
            raise ValueError("message must be a string and time a number")
        if best is None:
            return cls(kind, message, None, 0, float(when))
        name = best.get("checkpoint") if isinstance(best, dict) else None
        step = best.get("outerStep") if isinstance(best, dict) else None
        # Only a checkpoint's own name: the file cannot point the syncer outside its state dir.
        if not (isinstance(name, str) and name.startswith(PREFIX) and "/" not in name):
            raise ValueError(f"best.checkpoint {name!r} is not a checkpoint name")
        if type(step) is not int or outer_step_of(Path(name)) != step:
            raise ValueError(f"best.outerStep {step!r} is not the outer step of {name}")
        return cls(kind, message, name, step, float(when))

    def best_path(self, state_dir: Path) -> Path | None:
        return None if self.best is None else state_dir / CHECKPOINTS_DIR / self.best


def write_guard_end(state_dir: Path, end: GuardEnd) -> Path:
    """Write `end` atomically (temporary file, fsync, rename, fsync of the directory)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / GUARD_END_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{GUARD_END_FILE}.", dir=state_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(end.to_json(), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(state_dir)
    return path


def read_guard_end(state_dir: Path) -> GuardEnd | None:
    """The end recorded in `state_dir`, None when there is none; ConfigError naming the file
    when it cannot be read (see the module docstring)."""
    path = state_dir / GUARD_END_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the quality guard's end of the job: {err}") from err
    try:
        return GuardEnd.from_json(json.loads(text))
    except ValueError as err:  # json.JSONDecodeError is a ValueError
        raise ConfigError(
            f"{path}: not a valid record of the quality guard's end of the job ({err}); the "
            "syncer will not resume merging over it: fix or delete the file"
        ) from err
