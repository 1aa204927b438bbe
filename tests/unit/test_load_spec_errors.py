"""A config file the learners and the syncer cannot read names that file (issue 24): pyyaml's
marks said `"<unicode string>"` because the text was parsed, not the file; a file that is not
UTF-8 text ended in a UnicodeDecodeError traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from diloco_trainer.api import contract
from diloco_trainer.api.spec import ConfigError, load_spec

BAD_YAML = "inner:\n  lr: 0.1\n  steps: 5: 6\n"


def test_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text(BAD_YAML)
    with pytest.raises(ConfigError) as caught:
        load_spec(bad)
    message = str(caught.value)
    assert "<unicode string>" not in message
    assert f'in "{bad}", line 3, column 11' in message  # the second colon
    assert message.startswith(f"{bad} is not valid YAML")


def test_binary_file_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    binary = tmp_path / "spec.json"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))
    with pytest.raises(ConfigError) as caught:
        load_spec(binary)
    assert str(caught.value).startswith(f"{binary} is not valid YAML")
    assert str(binary) in str(caught.value).split("\n", 1)[1]  # pyyaml's mark names it too


def run_process(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diloco_trainer.cli", command],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("command", ["syncer", "learner"])
def test_processes_name_the_config_file_and_exit_2(tmp_path: Path, command: str) -> None:
    bad = tmp_path / "spec.yaml"
    bad.write_text(BAD_YAML)
    token = tmp_path / "token"
    token.write_text("t" * 32)
    env = {
        contract.CONFIG_FILE: str(bad),
        contract.TOKEN_FILE: str(token),
        contract.STATE_DIR: str(tmp_path / "state"),
        contract.ISLAND: "island-0",
        contract.SYNCER_URL: "http://127.0.0.1:9",
        contract.DEVICE: "cpu",
    }
    result = run_process(command, env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{bad} is not valid YAML" in result.stderr, result.stderr[-2000:]
    assert f'in "{bad}", line 3' in result.stderr
    assert "<unicode string>" not in result.stderr and "Traceback" not in result.stderr
