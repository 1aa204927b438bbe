"""A benchmark records the command that reproduces it with no path of the machine that ran it
(bench/harness/common.portable_args): the project speaks of itself only."""

from __future__ import annotations

import doctest
import sys

import pytest

from bench.harness import common


def test_portable_args_doctests_pass() -> None:
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(common) if t.name.endswith("portable_args")]
    runner = doctest.DocTestRunner()
    for test in tests:
        runner.run(test)
    assert tests and runner.summarize(verbose=False) == (0, 2)


def test_recorded_command_names_no_scratch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    script = str(common.REPO_ROOT / "bench" / "busy_link.py")
    log = str(common.REPO_ROOT / "bench" / "log" / "2026-11-30.md")
    argv = [script, "--workdir", "/scratch/x1/runs", "--results", log, "--steps", "240"]
    argv += ["--out=/scratch/x1/figures.json", "--preset", "gpt-tiny"]
    monkeypatch.setattr(sys, "argv", argv)
    assert common.command_line() == (
        "python -m bench.busy_link --workdir RUN_DIR --results bench/log/2026-11-30.md "
        "--steps 240 --out=RUN_DIR/figures.json --preset gpt-tiny"
    )
