"""`diloco run`'s summary (bytes against DDP) and its loss plot (labels, wall-time panel)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import matplotlib.image
import pytest
from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.local.job import DEFAULT_SPEC, runnable
from diloco_trainer.local.plot import loss_label, plot_eval_history
from diloco_trainer.local.summary import (
    against_ddp,
    ddp_bytes_per_worker,
    make_summary,
    summary_table,
)
from rich.console import Console


def test_summary_bytes_against_ddp() -> None:
    spec = parse_spec(DEFAULT_SPEC)  # 3 islands of one rank, 8 x 64 tokens a step
    # 1,000 steps per worker; a ring all-reduce sends and receives 2 x 2/3 of the fp32
    # gradients a step.
    tokens = 1000 * 3 * 8 * 64
    assert ddp_bytes_per_worker(spec, tokens, 1_000) == 2 * 1000 * 2 * 2 / 3 * 1_000 * 4
    status = SyncerStatus.from_json(
        {
            "outerStep": 20,
            "versions": [20],
            "finished": True,
            "tokens": tokens,
            "bytesIn": 30_000,
            "bytesOut": 60_000,
        }
    )
    summary = make_summary(
        status, spec=spec, wall_seconds=12.0, workdir=Path("w"), parameters=1_000
    )
    assert summary["bytes_per_island"] == 30_000
    assert summary["ddp_bytes_per_worker"] == round(2 * 1000 * 2 * 2 / 3 * 1_000 * 4)
    assert against_ddp(summary) == "29.3 KiB vs 10.2 MiB (356x fewer)"
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(summary_table(summary))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "bytes per island vs a DDP worker" in out and "356x fewer" in out
    unknown = make_summary(status, spec=spec, wall_seconds=1.0, workdir=Path("w"))
    assert against_ddp(unknown) == "-"


def test_plot_label_follows_the_tokenizer() -> None:
    assert loss_label("bytes (256 tokens)") == "eval loss (nats/byte)"
    assert loss_label("bpe (4096 tokens)") == "eval loss (nats/token, bpe (4096 tokens))"
    assert loss_label(None) == "eval loss (the model's loss_fn)"


def test_plot_has_a_wall_time_panel(tmp_path: Path) -> None:
    history = [
        {"outerStep": s, "tokens": 1000 * s, "evalLoss": 3.0 - 0.1 * s, "time": 50.0 + 7 * s}
        for s in range(5)
    ]
    one = plot_eval_history(history[:1], tmp_path / "one.png")
    two = plot_eval_history(history, tmp_path / "two.png", tokenizer="bpe (512 tokens)")
    # Two panels side by side: twice as wide as the single one.
    width_one = matplotlib.image.imread(one).shape[1]
    width_two = matplotlib.image.imread(two).shape[1]
    assert width_two == 2 * width_one


def test_printed_export_command_runs_without_an_activated_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    note = "final weights: ckpt (syncer checkpoint); extract them with\n  diloco export ckpt -o m"
    script = Path(sys.executable).parent / "diloco"
    assert script.is_file()  # the console script of this environment
    monkeypatch.setenv("PATH", str(tmp_path))  # not activated: no diloco on PATH
    monkeypatch.chdir(script.parents[2])  # the folder holding .venv
    assert runnable(note).endswith(f"\n  {script.parent.parent.name}/bin/diloco export ckpt -o m")
    (tmp_path / "diloco").write_text("#!/bin/sh\n")
    (tmp_path / "diloco").chmod(0o755)
    assert runnable(note) == note  # on PATH: as written
