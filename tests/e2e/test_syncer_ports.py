"""A syncer whose port or probe port is taken says so in one line and exits 1, no traceback."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from diloco_trainer.api import contract
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local.launch import free_port, start_syncer, write_job_files

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("taken", ["port", "probe port"])
def test_a_taken_port_is_named_and_exits_1(
    tmp_path: Path, make_spec: Callable[..., JobSpec], taken: str
) -> None:
    port, probe_port = free_port(), free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", port if taken == "port" else probe_port))
        holder.listen()
        files = write_job_files(make_spec(), tmp_path)
        proc = start_syncer(
            files,
            port=port,
            state_dir=tmp_path / "state",
            job_name="ports",
            log_file=tmp_path / "syncer.log",
            extra_env={contract.SYNCER_HEALTH_PORT: str(probe_port)},
        )
        code = proc.wait(timeout=120)
    log = proc.log_text()
    assert code == 1, log
    assert "Traceback" not in log, log
    busy = port if taken == "port" else probe_port
    assert "diloco syncer: cannot listen on " in log and f":{busy}" in log, log
    assert ("DILOCO_SYNCER_HEALTH_PORT" in log) == (taken == "probe port"), log
