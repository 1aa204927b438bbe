"""`diloco run`'s live view and progress line, and the console script's help and extras."""

from __future__ import annotations

import importlib.util
import io
from typing import Any

import pytest
from diloco_trainer import cli, cli_help
from diloco_trainer.api import contract
from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.local.progress import (
    exit_notes,
    island_order,
    progress_line,
    status_view,
)
from rich.console import Console


def _status(islands: list[str], eval_loss: float | None = 2.123456789012345) -> SyncerStatus:
    return SyncerStatus.from_json(
        {
            "outerStep": 3,
            "versions": [3],
            "finished": False,
            "tokens": 12345,
            "evalLoss": eval_loss,
            "islands": {name: {"state": "active"} for name in islands},
        }
    )


def _render(view: Any) -> str:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(view)
    out = console.file.getvalue()
    assert isinstance(out, str)
    return out


def test_live_view_sorts_islands_by_number() -> None:
    names = [f"island-{i}" for i in (10, 2, 0, 1, 11)]
    assert sorted(names, key=island_order) == [
        "island-0",
        "island-1",
        "island-2",
        "island-10",
        "island-11",
    ]
    text = _render(status_view(parse_spec({}), _status(names), started=0.0, slowdowns={}, dead={}))
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("island-")]
    assert rows == ["island-0", "island-1", "island-2", "island-10", "island-11"]


def test_live_view_shows_a_dead_learner_rank_and_the_slowed_island() -> None:
    # diloco run names learner processes ISLAND/rankR.
    dead = {"island-1/rank0": 1, "island-10/rank1": -9}
    assert exit_notes("island-1", dead) == ["rank0 exited 1"]
    assert exit_notes("island-10", dead) == ["rank1 exited -9"]
    assert exit_notes("island-2", dead) == []
    names = ["island-0", "island-1", "island-2", "island-10"]
    view = status_view(parse_spec({}), _status(names), started=0.0, slowdowns={10: 3.0}, dead=dead)
    rows = {line.split()[0]: line for line in _render(view).splitlines() if "island-" in line}
    assert "rank0 exited 1" in rows["island-1"]
    assert "rank1 exited -9" in rows["island-10"] and "slowed 3x" in rows["island-10"]
    assert "exited" not in rows["island-0"] and "slowed" not in rows["island-0"]


def test_progress_line_prints_the_eval_loss_to_four_digits() -> None:
    line = progress_line(_status(["island-0"]), 12.4)
    assert line == "outer step 3  tokens 12,345  eval loss 2.1235  (12s)"
    assert "eval loss -" in progress_line(_status(["island-0"], eval_loss=None), 0)


def test_learner_and_syncer_help_list_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    for command, names in (
        ("learner", [contract.ISLAND, contract.SYNCER_URL, contract.CONFIG_FILE, contract.RANK]),
        ("syncer", [contract.CONFIG_FILE, contract.TOKEN_FILE, contract.STATE_DIR]),
    ):
        with pytest.raises(SystemExit) as exited:
            cli.main([command, "--help"])
        assert exited.value.code == 0
        out = capsys.readouterr().out
        for name in names:
            assert name in out, (command, name)
        assert "contract.py" not in out


def test_trainer_commands_name_the_missing_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def without_torch(name: str, *args: Any) -> Any:
        return None if name in ("torch", "safetensors") else real(name, *args)

    monkeypatch.setattr(cli_help.importlib.util, "find_spec", without_torch)
    for argv in (["run"], ["learner"], ["syncer"], ["export", "x", "-o", "y"]):
        assert cli.main(argv) == cli.MISSING_EXTRA
        err = capsys.readouterr().err
        assert f"diloco {argv[0]} needs the [trainer] extra (torch, safetensors missing)" in err
        assert "pip install 'diloco-operator[trainer]'" in err
    monkeypatch.setattr(cli_help.importlib.util, "find_spec", real)
    assert cli_help.missing_trainer_modules() == []
