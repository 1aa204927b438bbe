"""The error line `diloco run` shows for a child that failed: the last line of its log that says
what went wrong (issue 48: the console said only "exited with code 2 (log: ...)")."""

from __future__ import annotations

from diloco_trainer.local.launch import last_error_line


def test_a_logged_error_is_the_line_shown() -> None:
    log = (
        "2026-01-01 10:00:00 INFO island-0/0 diloco_trainer.learner: starting\n"
        "2026-01-01 10:00:01 ERROR island-0/0 diloco_trainer.learner.loop: inner.precision fp16 "
        "needs a CUDA device\n"
        "2026-01-01 10:00:01 INFO island-0/0 diloco_trainer.learner: bye\n"
    )
    line = last_error_line(log)
    assert line is not None and line.endswith("inner.precision fp16 needs a CUDA device")


def test_a_tracebacks_last_line_and_a_commands_refusal() -> None:
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "ValueError: sync.fragments (200) is more than the model's 29 tensors\n"
    )
    assert last_error_line(traceback) == (
        "ValueError: sync.fragments (200) is more than the model's 29 tensors"
    )
    assert last_error_line("diloco syncer: token file /x is empty\n") == (
        "diloco syncer: token file /x is empty"
    )
    assert last_error_line("torch.OutOfMemoryError: CUDA out of memory\n") == (
        "torch.OutOfMemoryError: CUDA out of memory"
    )


def test_a_log_without_an_error_has_none() -> None:
    assert last_error_line("") is None
    assert last_error_line("2026 INFO syncer: merged fragment 0 (errors: 0)\n") is None
