"""The [local] extra (rich, matplotlib): only `diloco run` needs it, and without it `diloco run`
says so in one line and exits 2, while the pod image's commands (learner, syncer, check) import
neither. The packages are made unimportable (sys.modules entries of None), not uninstalled."""

from __future__ import annotations

import subprocess
import sys

import pytest
from diloco_trainer import cli, cli_help

LOCAL_MODULES = ("rich", "matplotlib")


def test_run_without_the_local_extra_names_it_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in LOCAL_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    assert cli_help.missing_trainer_modules() == []  # the [trainer] extra is whole without them
    for argv, missing in ((["run"], "rich"), (["run", "--plot", "x.png"], "rich, matplotlib")):
        assert cli.main(argv) == cli.MISSING_EXTRA == 2
        err = capsys.readouterr().err
        assert err == (
            f"diloco run needs the [local] extra ({missing} missing): "
            "pip install 'diloco-operator[local]'\n"
        )


def test_run_needs_matplotlib_only_for_its_plot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli_help.require_local("run")
    assert not cli_help.require_local("run", plot=True)


def test_pod_commands_import_neither_rich_nor_matplotlib() -> None:
    # What `diloco learner`, `diloco syncer`, `diloco check` and `diloco sample` import, in a
    # process where the [local] extra's packages cannot be imported (as in the trainer image,
    # which leaves it out).
    code = (
        "import sys\n"
        f"for name in {LOCAL_MODULES!r}: sys.modules[name] = None\n"
        "import diloco_trainer.learner.loop, diloco_trainer.syncer.service\n"
        "import diloco_trainer.check.command, diloco_trainer.export, diloco_trainer.sample\n"
        "import diloco_trainer.local\n"
        "from diloco_trainer.cli_help import require_trainer\n"
        "assert require_trainer('learner')\n"
        "print('imported without the [local] extra')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "imported without the [local] extra" in result.stdout
