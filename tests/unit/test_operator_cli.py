"""`diloco operator` and `diloco crd` come from the operator's package (diloco_operator/cli.py),
added to the trainer's `diloco` through the entry-point group diloco.commands."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from diloco_operator import cli as operator_cli
from diloco_operator import crd
from diloco_trainer import cli


def test_operator_cli_commands_are_entry_points_of_the_diloco_script() -> None:
    args = cli.build_parser().parse_args(
        ["operator", "--standalone", "--namespace", "a", "--namespace", "b", "--health-port", "81"]
    )
    assert args.func is operator_cli.run_operator
    assert (args.standalone, args.namespace, args.health_port, args.metrics_port) == (
        True,
        ["a", "b"],
        81,
        9090,
    )
    defaults = cli.build_parser().parse_args(["operator"])
    assert (defaults.standalone, defaults.namespace, defaults.health_port) == (False, [], 8080)
    assert cli.build_parser().parse_args(["crd"]).func is operator_cli.run_crd


def test_operator_cli_crd_writes_the_crd(tmp_path: Path) -> None:
    out = tmp_path / "crd.yaml"
    assert cli.main(["crd", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == crd.build_crd()


def test_operator_cli_operator_names_the_missing_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As in the trainer image: no kopf (None in sys.modules makes its import fail).
    monkeypatch.setitem(sys.modules, "kopf", None)
    monkeypatch.delitem(sys.modules, "diloco_operator.main", raising=False)
    assert cli.main(["operator", "--standalone"]) == operator_cli.MISSING_EXTRA
    err = capsys.readouterr().err
    assert "diloco operator needs the [operator] extra (kopf is missing)" in err
    assert "pip install 'diloco-operator[operator]'" in err
