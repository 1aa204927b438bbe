"""Start our trainer on loopback: a syncer and M single-rank islands, as `diloco run` would.

Processes are started with diloco_trainer.local.launch (the same commands and contract environment
as pods), but the benchmark keeps hold of them: it can point an island at a relay instead of the
syncer, slow one down, kill one with SIGKILL and start it again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_trainer.api import contract
from diloco_trainer.api.contract import island_name
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local import (
    JobFiles,
    Proc,
    free_port,
    start_learner,
    start_syncer,
    wait_ready,
    write_job_files,
)

from bench.harness.common import track

# One intra-op thread per process: M learners and the syncer share a few cores, as peers do.
THREADS_ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class OursRun:
    """One job of ours: the syncer, its learners, and their status."""

    spec: JobSpec
    workdir: Path
    slowdowns: dict[int, float] = field(default_factory=dict)
    # island index -> URL the island uses to reach the syncer (e.g. a relay); default: direct.
    route: Callable[[int, str], str] | None = None
    job_name: str = "bench"
    files: JobFiles | None = None
    syncer: Proc | None = None
    learners: dict[int, Proc] = field(default_factory=dict)
    port: int = 0
    restarts: dict[int, int] = field(default_factory=dict)
    # Added to every learner's environment (e.g. DILOCO_EMULATE_STEP_SECONDS).
    learner_env: dict[str, str] = field(default_factory=dict)
    # island index -> added to that island's environment on top of learner_env (e.g. each
    # island's own emulated step time: bench/hetero --emulate-step-ms).
    island_env: dict[int, dict[str, str]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the syncer, wait until it is ready, then every island."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.files = write_job_files(self.spec, self.workdir)
        self.port = self.pick_port()
        self.syncer = track(
            start_syncer(
                self.files,
                port=self.port,
                state_dir=self.workdir / "syncer",
                job_name=self.job_name,
                log_file=self.workdir / "syncer.log",
                extra_env=THREADS_ENV,
            )
        )
        wait_ready(self.url, self.files.token, 120, proc=self.syncer)
        for i in range(self.spec.islands.count):
            self.start_island(i)

    def pick_port(self) -> int:
        """The syncer's port: one free on loopback."""
        return free_port()

    def island_url(self, i: int) -> str:
        return self.route(i, self.url) if self.route else self.url

    def start_island(self, i: int) -> Proc:
        """Start (or restart) island i's single learner rank."""
        assert self.files is not None
        name = island_name(self.spec.islands.name_prefix, i)
        n = self.restarts.get(i, 0)
        proc = track(
            start_learner(
                self.files,
                syncer_url=self.island_url(i),
                island=name,
                island_index=i,
                log_file=self.workdir / f"{name}.{n}.log",
                master_port=free_port(),
                slowdown=self.slowdowns.get(i, 1.0),
                job_name=self.job_name,
                extra_env={**THREADS_ENV, **self.learner_env, **self.island_env.get(i, {})},
            )
        )
        self.learners[i] = proc
        return proc

    def kill_island(self, i: int) -> None:
        """SIGKILL island i's learner (a crash, as far as the syncer can tell)."""
        proc = self.learners[i]
        proc.kill()
        proc.wait()
        self.restarts[i] = self.restarts.get(i, 0) + 1

    def status(self) -> dict[str, Any]:
        """The syncer's /v1/status document."""
        assert self.files is not None
        req = urllib.request.Request(
            self.url + "/v1/status", headers={"Authorization": f"Bearer {self.files.token}"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def check_alive(self) -> None:
        """Raise with the log tail when the syncer died."""
        assert self.syncer is not None
        if not self.syncer.alive:
            raise RuntimeError(
                f"syncer exited with {self.syncer.returncode}:\n" + self.syncer.log_text()[-3000:]
            )

    def wait_finished(
        self,
        timeout: float,
        on_status: Callable[[dict], None] | None = None,
        until: Callable[[dict], bool] | None = None,
    ) -> dict:
        """Poll the status until the job finished, or until `until(status)` holds (the job
        still running: the caller stops it); returns the last status."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            st = self.status()
            if on_status is not None:
                on_status(st)
            if st.get("finished") and st.get("evalLoss") is not None:
                return st
            if until is not None and until(st):
                return st
            if all(not p.alive for p in self.learners.values()):
                raise RuntimeError(
                    "every learner exited before the job finished:\n"
                    + "\n".join(p.log_text()[-1500:] for p in self.learners.values())
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"job not finished after {timeout:.0f}s (status {st})")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop every process (learners first)."""
        for proc in self.learners.values():
            proc.stop(timeout=10)
        if self.syncer is not None:
            self.syncer.stop(timeout=10)


@dataclass
class HookedRun(OursRun):
    """OursRun whose syncer is a study's own child process (`python -m MODULE --syncer-child`:
    the product's syncer with the study's read-only recording hooks installed), told where to
    write its records by the environment variable `records_env`."""

    module: str = ""
    records_env: str = ""
    records: Path = Path("records.jsonl")

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.files = write_job_files(self.spec, self.workdir)
        self.port = self.pick_port()
        env = {
            **os.environ,
            **THREADS_ENV,
            contract.JOB_NAME: self.job_name,
            contract.SYNCER_PORT: str(self.port),
            contract.TOKEN_FILE: str(self.files.token_file),
            contract.CONFIG_FILE: str(self.files.config_file),
            contract.STATE_DIR: str(self.workdir / "syncer"),
            self.records_env: str(self.records),
            "PYTHONUNBUFFERED": "1",
        }
        log = self.workdir / "syncer.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", self.module, "--syncer-child"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.syncer = track(Proc("syncer", popen, log))
        wait_ready(self.url, self.files.token, 120, proc=self.syncer)
        for i in range(self.spec.islands.count):
            self.start_island(i)
