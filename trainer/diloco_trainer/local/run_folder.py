"""The folder of one local job (`runs/NAME/` by default): everything a user looks for after a run.

    runs/NAME/
      syncer/        the syncer's state: checkpoints (the weights; `diloco export runs/NAME`)
      logs/          one log per process
      summary.json   the summary of the whole job (every session of it)
      loss.png       eval loss against tokens and against time
      run.json       the job's figures of earlier sessions (wall time, bytes), for the summary
      spec.json, token, island-tokens/   what the processes read

Running the same job again with the same folder resumes it from its last checkpoint (the syncer
resumes from its state dir); `--fresh` moves the old folder aside first. A resumed job's summary
counts every session: its wall time and bytes are those of the earlier sessions (run.json) plus
this one's, as its tokens (the syncer's, from its checkpoint) are.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RUNS_DIR = Path("runs")
LEDGER_FILE = "run.json"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"
SYNCER_DIR = "syncer"


def default_folder(name: str) -> Path:
    """runs/NAME under the current directory."""
    return RUNS_DIR / name


def has_checkpoints(folder: Path) -> bool:
    """Whether the folder's syncer left a checkpoint (a run started there resumes from it)."""
    syncer = folder / SYNCER_DIR
    return syncer.is_dir() and any(syncer.glob("**/ckpt-*"))


def move_aside(folder: Path) -> Path | None:
    """`--fresh`: rename an existing folder to NAME.previous-YYYYmmdd-HHMMSS; the new name."""
    if not folder.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = folder.with_name(f"{folder.name}.previous-{stamp}")
    folder.rename(aside)
    return aside


@dataclass
class Ledger:
    """What earlier sessions of the job did that the syncer does not keep across a restart."""

    sessions: int = 0
    wall_seconds: float = 0.0
    bytes_pushed: int = 0
    bytes_pulled: int = 0

    @classmethod
    def load(cls, folder: Path) -> Ledger:
        """The folder's ledger; an empty one when there is none (or it cannot be read)."""
        try:
            raw = json.loads((folder / LEDGER_FILE).read_text())
            return cls(
                sessions=int(raw["sessions"]),
                wall_seconds=float(raw["wall_seconds"]),
                bytes_pushed=int(raw["bytes_pushed"]),
                bytes_pulled=int(raw["bytes_pulled"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return cls()

    def plus(self, wall_seconds: float, bytes_pushed: int, bytes_pulled: int) -> Ledger:
        """The ledger once this session's figures so far are added."""
        return Ledger(
            sessions=self.sessions + 1,
            wall_seconds=self.wall_seconds + wall_seconds,
            bytes_pushed=self.bytes_pushed + bytes_pushed,
            bytes_pulled=self.bytes_pulled + bytes_pulled,
        )

    def save(self, folder: Path) -> None:
        """Written atomically (a run killed while writing leaves the previous one)."""
        with contextlib.suppress(OSError):
            tmp = folder / f".{LEDGER_FILE}.tmp"
            tmp.write_text(json.dumps(asdict(self)) + "\n")
            tmp.replace(folder / LEDGER_FILE)
