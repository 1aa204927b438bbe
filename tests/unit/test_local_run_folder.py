"""Issue 48: a run's results in one folder (runs/NAME), summaries over the whole job when it was
resumed, progress that counts the learners' tokens in a pipe, the export of a run folder with
what loading it needs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.export import find_spec, job_metadata, run_folder_state_dir
from diloco_trainer.local.job import DEFAULT_SPEC
from diloco_trainer.local.progress import eta, progress_line, trained_tokens
from diloco_trainer.local.run import resume_note
from diloco_trainer.local.run_folder import Ledger, default_folder, has_checkpoints, move_aside
from diloco_trainer.local.summary import make_summary


def _status(
    tokens: int, islands: dict[str, int], outer_step: int = 0, **extra: object
) -> SyncerStatus:
    return SyncerStatus.from_json(
        {
            "outerStep": outer_step,
            "versions": [outer_step],
            "finished": False,
            "tokens": tokens,
            "islands": {
                name: {"state": "active", "tokens": n, "step": n // 512}
                for name, n in islands.items()
            },
            **extra,
        }
    )


def test_the_default_folder_is_runs_name_and_fresh_moves_it_aside(tmp_path: Path) -> None:
    assert default_folder("local-demo") == Path("runs/local-demo")
    folder = tmp_path / "runs" / "demo"
    assert move_aside(folder) is None
    (folder / "syncer" / "checkpoints" / "ckpt-000000005").mkdir(parents=True)
    assert has_checkpoints(folder)
    aside = move_aside(folder)
    assert aside is not None and aside.name.startswith("demo.previous-") and not folder.exists()
    assert has_checkpoints(aside)


def test_a_resumed_jobs_summary_counts_every_session(tmp_path: Path) -> None:
    """The audit: a resumed run reported 913,890 tok/s and '831x fewer' bytes than DDP, its
    rates over the resumed part only (the syncer's byte counters start again at a restart)."""
    spec = parse_spec(DEFAULT_SPEC)
    Ledger().plus(100.0, 30_000, 60_000).save(tmp_path)  # the first session, interrupted
    earlier = Ledger.load(tmp_path)
    assert earlier == Ledger(
        sessions=1, wall_seconds=100.0, bytes_pushed=30_000, bytes_pulled=60_000
    )
    final = _status(1_000_000, {}, outer_step=20, bytesIn=3_000, bytesOut=6_000)
    summary = make_summary(
        final, spec=spec, wall_seconds=10.0, workdir=tmp_path, parameters=1_000, earlier=earlier
    )
    assert summary["wall_seconds"] == 110.0 and summary["session_seconds"] == 10.0
    assert summary["sessions"] == 2
    assert (summary["bytes_pushed"], summary["bytes_pulled"]) == (33_000, 66_000)
    assert summary["bytes_per_island"] == round(99_000 / 3)
    assert Ledger.load(tmp_path / "nowhere") == Ledger()


def test_progress_in_a_pipe_counts_the_learners_tokens_before_any_merge() -> None:
    """The audit: 'outer step 0/2 tokens 0 ... 0 tok/s' for a minute while learners trained."""
    spec = parse_spec(DEFAULT_SPEC)  # 20 rounds of 3 x 50 x 512 tokens
    early = _status(0, {"island-0": 51_200, "island-1": 51_200, "island-2": 25_600})
    assert trained_tokens(early) == 128_000
    line = progress_line(early, 10.0, spec)
    assert line.startswith("outer step 0/20  tokens 128,000 (0 merged)"), line
    assert "12,800 tok/s" in line, line
    # 128,000 of 1,536,000 tokens in 10 s: 110 s to go, not "-" until the first merge.
    assert "ETA 1m50s" in line, line
    # A resumed session: its rate and ETA are its own (base: the tokens when it began).
    resumed = _status(800_000, {"island-0": 300_000, "island-1": 300_000, "island-2": 300_000})
    assert "10,000 tok/s" in progress_line(resumed, 10.0, spec, base=800_000)
    left = eta(spec, resumed, 10.0, base=800_000)
    assert left is not None and round(left) == round((1_536_000 - 900_000) / 10_000)


def test_the_interrupt_message_says_how_to_resume() -> None:
    args = argparse.Namespace(config="examples/local.yaml", workdir=None)
    note = resume_note(args, Path.cwd() / "runs" / "local-demo")
    assert "resume from the last checkpoint with:" in note
    assert "diloco run examples/local.yaml\n" in note and "runs/local-demo" in note
    args.workdir = "elsewhere"
    assert "--workdir elsewhere" in resume_note(args, Path.cwd() / "elsewhere")


def test_export_reads_a_run_folder_and_records_what_loading_needs(tmp_path: Path) -> None:
    folder = tmp_path / "runs" / "local-demo"
    spec = parse_spec(DEFAULT_SPEC)
    (folder / "syncer").mkdir(parents=True)
    (folder / "spec.json").write_text(spec.to_json())
    assert run_folder_state_dir(folder) == folder / "syncer"
    assert run_folder_state_dir(folder / "syncer") == folder / "syncer"
    assert find_spec(folder / "syncer" / "checkpoints" / "ckpt-000000001") == folder / "spec.json"
    meta = job_metadata(folder / "spec.json")
    assert (meta["preset"], meta["seqLen"], meta["tokenizer"]) == ("gpt-tiny", "64", "bytes")
    assert json.loads(meta["spec"])["model"]["preset"] == "gpt-tiny"
