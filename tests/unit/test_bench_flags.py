"""The benchmarks' command line: the shared flags (bench/harness/flags.py) through
common.base_parser, and common.publish, the end of every benchmark's main (print only, or append to
--results)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.harness.common import LoadMonitor, Report, Table, base_parser, publish
from bench.harness.flags import INNER_OPTIMIZER, TRAINING, inner_section


def test_base_parser_shared_flags_take_each_benchmarks_defaults() -> None:
    p = base_parser("probe", **TRAINING, islands=3, seeds=[0, 1], skip_torchft=False)
    args = p.parse_args([])
    assert (args.preset, args.batch_size, args.seq_len) == ("gpt-tiny", 8, 64)
    assert (args.islands, args.seeds, args.skip_torchft) == (3, [0, 1], False)
    assert args.no_record is False and args.workdir is None  # the flags every benchmark has
    args = p.parse_args(["--islands", "5", "--seeds", "3", "4", "--skip-torchft"])
    assert (args.islands, args.seeds, args.skip_torchft) == (5, [3, 4], True)
    assert not hasattr(args, "inner_steps")  # only the flags a benchmark names are added


def test_base_parser_refuses_a_flag_no_benchmark_shares() -> None:
    with pytest.raises(ValueError, match="no shared benchmark flag 'inner_step'"):
        base_parser("probe", inner_step=20)


def test_base_parser_codec_flag_accepts_only_the_codecs() -> None:
    p = base_parser("probe", codec="none")
    assert p.parse_args(["--codec", "int4"]).codec == "int4"
    with pytest.raises(SystemExit):
        p.parse_args(["--codec", "int3"])


def test_inner_section_spells_the_flags_as_the_spec_does() -> None:
    p = base_parser("probe", **TRAINING, **INNER_OPTIMIZER, inner_steps=30)
    section = inner_section(p.parse_args(["--seq-len", "32"]))
    assert section == {"lr": 3e-3, "warmupSteps": 20, "steps": 30, "batchSize": 8, "seqLen": 32}


def _report() -> Report:
    table = Table("losses", ["system", "loss"])
    table.add("ours", "2.9")
    return Report("probe", "A probe.", tables=[table], notes=["a note"])


def _args(results: Path, no_record: bool) -> argparse.Namespace:
    return base_parser("probe").parse_args(
        ["--results", str(results), *(["--no-record"] if no_record else [])]
    )


def test_publish_without_record_prints_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "RESULTS.md"
    assert publish(_report(), _args(results, no_record=True), LoadMonitor()) == 0
    out = capsys.readouterr().out
    assert "ours" in out and "note: a note" in out
    assert not results.exists()


def test_publish_appends_a_section_to_the_results_file_it_is_given(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    assert publish(_report(), _args(results, no_record=False), LoadMonitor()) == 0
    publish(_report(), _args(results, no_record=False), LoadMonitor())
    text = results.read_text()
    assert text.startswith("# Benchmark results")
    assert text.count("## probe — ") == 2  # appended, never replaced
    assert "- a note" in text
