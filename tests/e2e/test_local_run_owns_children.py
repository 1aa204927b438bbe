"""`diloco run` owns its children (issue 48): they go with it however it goes (SIGHUP of a closed
terminal, SIGKILL), its syncer listens on loopback only, and a child that fails says why on the
run's console, not only in its log.

The children are found by the marker `diloco run` puts in their environment (DILOCO_RUN_PID, its
own pid), which a process keeps after its parent is gone, so an orphan is found too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from diloco_trainer.api.spec import JobSpec

from .conftest import wait_until

pytestmark = pytest.mark.e2e

GONE_WITHIN_SECONDS = 5.0
RUN_OPTIONS = ("--workdir", "run", "--quiet")


def small_job(make_spec: Callable[..., JobSpec], **overrides: object) -> JobSpec:
    """Two islands of one rank; endless unless told otherwise."""
    spec = {
        "islands": {"count": 2},
        "inner": {"steps": 5, "batchSize": 4, "seqLen": 32},
        "sync": {"quorum": 2, "fragments": 2, "overlapSteps": 1},
        "stopAfter": {"outerSteps": 100000},
        **overrides,
    }
    return make_spec(**spec)


def owned_by(run_pid: int) -> list[int]:
    """Live processes whose environment says `diloco run` pid `run_pid` started them."""
    marker = f"DILOCO_RUN_PID={run_pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


@contextlib.contextmanager
def running(
    workdir: Path, make_spec: Callable[..., JobSpec], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`diloco run` of an endless job in its own session, its output in workdir/run.log; its
    children SIGKILLed on the way out if the test left any."""
    config = workdir / "job.json"
    config.write_text(small_job(make_spec).to_json())
    log = (workdir / "run.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco_trainer.cli", "run", str(config), *RUN_OPTIONS],
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        yield proc
    finally:
        for pid in owned_by(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_training(workdir: Path, run_pid: int) -> list[int]:
    """The run's children once both islands have joined the syncer."""
    logs = workdir / "run" / "logs"

    def joined() -> bool:
        return all(
            (logs / f"island-{i}-rank0.log").exists()
            and "joined the syncer" in (logs / f"island-{i}-rank0.log").read_text()
            for i in range(2)
        )

    wait_until(joined, timeout=300, interval=0.2, what="both islands joined")
    children = owned_by(run_pid)
    assert len(children) >= 3, children  # the syncer and two learners
    return children


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids of `pids` still alive after `seconds` (an empty list once all are gone)."""

    def alive() -> list[int]:
        return [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]

    with contextlib.suppress(AssertionError):  # timed out: the caller names who is left
        wait_until(lambda: not alive(), timeout=seconds, interval=0.1, what="the children gone")
    return alive()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sighup_of_diloco_run_leaves_no_process(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> None:
    with running(workdir, make_spec) as proc:
        children = wait_training(workdir, proc.pid)
        os.killpg(proc.pid, signal.SIGHUP)  # the terminal closed: its process group hears it
        code = proc.wait(timeout=60)
        left = gone_within(children, GONE_WITHIN_SECONDS)
    log = (workdir / "run.log").read_text()
    assert left == [], f"children alive after SIGHUP: {left}\n{log}"
    assert code == 129, log
    assert "resume from the last checkpoint with:" in log, log


def test_sigkill_of_diloco_run_leaves_no_process(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> None:
    with running(workdir, make_spec) as proc:
        children = wait_training(workdir, proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # nothing of diloco run runs after this
        proc.wait(timeout=30)
        left = gone_within(children, GONE_WITHIN_SECONDS)
    assert left == [], f"children alive {GONE_WITHIN_SECONDS}s after SIGKILL: {left}"


def listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                address, _, hex_port = fields[1].rpartition(":")
                if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


def test_the_local_syncer_listens_on_loopback_only(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> None:
    with running(workdir, make_spec) as proc:
        wait_training(workdir, proc.pid)
        syncer_log = (workdir / "run" / "logs" / "syncer.log").read_text()
        port = int(re.search(r"serving http on port (\d+)", syncer_log).group(1))  # type: ignore[union-attr]
        addresses = listening(port)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    # 127.0.0.1, and nothing else: twice, its two accept lanes (syncer/edge/sockets.AcceptLanes)
    assert addresses == ["0100007F"] * 2, addresses


def test_a_learner_that_fails_says_why_on_the_console(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> None:
    # A setting `diloco check` does not read (a learner's own environment knob): the learners
    # refuse it at start, after the syncer is up.
    with running(workdir, make_spec, env={"DILOCO_PULL_APPLY": "sideways"}) as proc:
        code = proc.wait(timeout=300)
    log = " ".join((workdir / "run.log").read_text().split())
    assert code == 1, log
    assert "learner island-0/rank0 exited with code 2: " in log, log
    assert "DILOCO_PULL_APPLY='sideways': use device or host" in log, log
