"""A learner told to stop (SIGTERM, as Kubernetes does) while it still waits for an unreachable
syncer exits 0 on every rank, promptly and without a traceback. A bench run once logged a
confusing `sync.fragments (0) must be >= 1` error on this path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local import launch

from .conftest import wait_until

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("world_size", [1, 2])
def test_learner_sigterm_before_join_exits_cleanly(
    make_spec: Callable[..., JobSpec], workdir: Path, world_size: int
) -> None:
    files = launch.write_job_files(make_spec(), workdir)
    # Nobody listens on this port: rank 0 keeps retrying its join.
    url = f"http://127.0.0.1:{launch.free_port()}"
    master_port = launch.free_port()
    ranks = [
        launch.start_learner(
            files,
            syncer_url=url,
            island="island-0",
            island_index=0,
            rank=rank,
            world_size=world_size,
            master_port=master_port,
            log_file=workdir / f"rank{rank}.log",
            extra_env={"OMP_NUM_THREADS": "1"},
        )
        for rank in range(world_size)
    ]
    try:
        rank0 = ranks[0]
        wait_until(
            lambda: "syncer unreachable" in rank0.log_text(),
            timeout=120,
            what="rank 0 retrying its join",
        )
        for proc in ranks:
            proc.terminate()
        codes = [proc.wait(timeout=60) for proc in ranks]
    finally:
        for proc in ranks:
            proc.stop(timeout=5)
    logs = "\n".join(f"--- {p.name}\n{p.log_text()}" for p in ranks)
    assert codes == [0] * world_size, logs
    assert "Traceback" not in logs, logs
    assert "must be >= 1" not in logs, logs
    assert "stopped before joining the syncer" in rank0.log_text(), logs
