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
    duration,
    eta_seconds,
    exit_notes,
    island_order,
    progress_key,
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
    assert line == "outer step 3  tokens 12,345  eval loss 2.1235  996 tok/s  (12s)"
    assert "eval loss -" in progress_line(_status(["island-0"], eval_loss=None), 0)


def _evaluated(step: int, history: list[tuple[int, float]], **extra: Any) -> SyncerStatus:
    """A status at outer step `step` whose evaluations so far are `history` (step, loss): the
    syncer evaluates in the background, so the newest may be of an earlier step."""
    return SyncerStatus.from_json(
        {
            "outerStep": step,
            "versions": [step],
            "finished": False,
            "tokens": 1000 * step,
            "evalLoss": history[-1][1],
            "evalHistory": [
                {"outerStep": s, "tokens": 1000 * s, "evalLoss": loss, "time": 100.0 + s}
                for s, loss in history
            ],
            **extra,
        }
    )


def test_progress_line_names_the_step_of_a_stale_eval_loss() -> None:
    # The demo log's bug: step 3 printed 2.8851, step 2's loss, where the summary has 2.5293.
    before = _evaluated(3, [(1, 3.1), (2, 2.8851)])
    line = progress_line(before, 10.0)
    assert "outer step 3 " in line and "eval loss 2.8851 (step 2)" in line, line
    after = _evaluated(3, [(1, 3.1), (2, 2.8851), (3, 2.5293)])
    # The newest evaluation is a new line even though the outer step did not move.
    assert progress_key(after) != progress_key(before)
    assert "eval loss 2.5293 (step 3)" in progress_line(after, 11.0)


def test_progress_line_shows_n_of_total_tokens_per_second_and_eta() -> None:
    spec = parse_spec({"stopAfter": {"outerSteps": 20}})
    line = progress_line(_evaluated(5, [(5, 2.0)]), 50.0, spec)
    # 5 of 20 in 50 s: 150 s to go at this pace; 5,000 tokens in 50 s.
    assert line.startswith("outer step 5/20  tokens 5,000  "), line
    assert "100 tok/s" in line and "ETA 2m30s" in line, line
    assert duration(3725) == "1h02m" and duration(None) == "-"
    assert eta_seconds(0.0, 10.0) is None


def test_live_view_island_tokens_steps_per_second_and_state() -> None:
    islands = {
        # Pushed six times, no heartbeat figures yet: its merged tokens are what it trained.
        "island-0": {
            "state": "active",
            "pushes": 6,
            "tokens": 0,
            "mergedTokens": 9000,
            "step": 120,
            "stepTime": 0.25,
            "waiting": 0.624,
        },
        # No heartbeat's share yet: unknown, shown as such (never as 0%).
        "island-1": {"state": "dropped", "pushes": 2, "tokens": 4000, "mergedTokens": 1000},
    }
    status = _evaluated(2, [(2, 2.5)], islands=islands)
    spec = parse_spec({"stopAfter": {"outerSteps": 4}})
    text = _render(status_view(spec, status, started=0.0, slowdowns={}, dead={}))
    rows = {line.split()[0]: line.split() for line in text.splitlines() if "island-" in line}
    header = next(line.split() for line in text.splitlines() if line.startswith("island "))
    assert header[:8] == ["island", "state", "step", "steps/s", "pushes", "joins", "tokens", "loss"]
    assert header[8] == "waiting"
    assert rows["island-0"][:7] == ["island-0", "active", "120", "4.00", "6", "0", "9,000"]
    assert rows["island-0"][8] == "62%"  # 0.624 of its wall time waiting for the syncer
    assert rows["island-1"][:7] == ["island-1", "dropped", "0", "-", "2", "0", "4,000"]
    assert rows["island-1"][8] == "-"
    assert "outer step 2/4" in text and "ETA" in text


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
