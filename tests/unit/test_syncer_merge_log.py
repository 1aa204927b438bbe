"""The merge log at a stop (syncer/merge_log.MergeLog.close): entries kept in memory while
merges.jsonl could not be written are written at the stop when it can be again, and otherwise the
syncer's log says how many are lost with the process (issue 22, finding 6's leftover).

The fault is real: merges.jsonl replaced by a directory, which no process (root included) can
append to (IsADirectoryError, an OSError as from a full or read-only disk)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from diloco_trainer.api.documents import MergeRecord
from diloco_trainer.syncer.merging import merge_log
from diloco_trainer.syncer.merging.merge_log import MERGE_LOG_FILE, MergeLog


def versions(path: Path) -> list[int]:
    return [json.loads(line)["version"] for line in path.read_text().splitlines()]


def unwritable(tmp_path: Path) -> MergeLog:
    """A log whose file became a directory after version 1 was written; versions 2 and 3 kept."""
    log = MergeLog(1, tmp_path)
    log.write(MergeRecord(version=1, fragment=0))
    (tmp_path / MERGE_LOG_FILE).unlink()
    (tmp_path / MERGE_LOG_FILE).mkdir()
    log.write(MergeRecord(version=2, fragment=0))
    log.write(MergeRecord(version=3, fragment=0))
    assert len(log.unwritten) == 2 and log.problem is not None
    return log


def test_close_writes_the_kept_entries_when_the_log_is_writable_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = unwritable(tmp_path)
    (tmp_path / MERGE_LOG_FILE).rmdir()
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        assert log.close() == 0
    assert versions(tmp_path / MERGE_LOG_FILE) == [2, 3]
    assert not log.unwritten and log.problem is None
    assert "2 merge log entries kept were written" in caplog.text


def test_close_says_how_many_are_lost_when_the_log_is_still_unwritable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = unwritable(tmp_path)
    with caplog.at_level(logging.ERROR, logger="diloco.syncer"):
        assert log.close() == 2
    (line,) = [r for r in caplog.records if "stopping" in r.getMessage()]
    assert line.levelno == logging.ERROR
    assert "2 merge log entries never written" in line.getMessage()
    assert (tmp_path / MERGE_LOG_FILE).is_dir()  # nothing written anywhere else


def test_close_counts_entries_dropped_beyond_the_memory_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A bound of 2 (the real one is UNWRITTEN_ENTRIES): versions 2, 3, 4 wait, 2 is dropped.
    monkeypatch.setattr(merge_log, "UNWRITTEN_ENTRIES", 2)
    log = unwritable(tmp_path)
    log.unwritten = type(log.unwritten)(log.unwritten, maxlen=2)
    log.write(MergeRecord(version=4, fragment=0))
    assert log.dropped == 1 and [e.version for e in log.unwritten] == [3, 4]
    (tmp_path / MERGE_LOG_FILE).rmdir()
    with caplog.at_level(logging.ERROR, logger="diloco.syncer"):
        assert log.close() == 1  # 3 and 4 written, 2 lost
    assert versions(tmp_path / MERGE_LOG_FILE) == [3, 4]
    assert "1 dropped earlier are lost" in caplog.text


def test_close_with_nothing_kept_writes_nothing_and_loses_nothing(tmp_path: Path) -> None:
    log = MergeLog(1, tmp_path)
    log.write(MergeRecord(version=1, fragment=0))
    assert log.close() == 0
    assert versions(tmp_path / MERGE_LOG_FILE) == [1]
