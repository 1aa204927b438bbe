"""`diloco run` with `syncer.shards: N`: N syncer processes, shard i on its own port with its own
state dir (api/sharding.shard_state_dir), seen by the run as one syncer: SyncerShards has the
surface of a Proc (alive, returncode, log, terminate/kill/wait) and the comma-joined URL that the
learners route by and the JSON client reads as one syncer (api/client.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from diloco_trainer.api.sharding import join_urls, shard_state_dir
from diloco_trainer.local.launch import JobFiles, Proc, free_port, start_syncer, wait_ready


@dataclass
class SyncerShards:
    """The N syncer processes of one local job (shard i: procs[i], ports[i])."""

    files: JobFiles
    state_dir: Path
    job_name: str
    log_dir: Path
    ports: list[int]
    extra_env: Mapping[str, str] = field(default_factory=dict)
    ready_timeout: float = 60.0
    procs: list[Proc] = field(default_factory=list)
    name: str = "syncer"

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    @property
    def url(self) -> str:
        """Every shard's URL, in shard order (DILOCO_SYNCER_URL of a learner)."""
        return join_urls(self.urls)

    def state_dir_of(self, shard: int) -> Path:
        return shard_state_dir(self.state_dir, shard, len(self.ports))

    def start(self, shard: int) -> Proc:
        """Start (or restart, on its port and state dir) shard `shard`; wait until it is ready."""
        proc = start_syncer(
            self.files,
            port=self.ports[shard],
            state_dir=self.state_dir_of(shard),
            job_name=self.job_name,
            log_file=self.log_dir / f"syncer-{shard}.log",
            extra_env=self.extra_env,
            shard=shard,
        )
        if shard < len(self.procs):
            self.procs[shard] = proc
        else:
            self.procs.append(proc)
        wait_ready(self.urls[shard], self.files.token, self.ready_timeout, proc=proc)
        return proc

    def _first_dead(self) -> Proc | None:
        return next((p for p in self.procs if not p.alive), None)

    @property
    def alive(self) -> bool:
        return self._first_dead() is None

    @property
    def returncode(self) -> int | None:
        dead = self._first_dead()
        return None if dead is None else dead.returncode

    @property
    def log_file(self) -> Path:
        dead = self._first_dead()
        return (dead or self.procs[0]).log_file

    def log_text(self) -> str:
        """The log of the first shard that exited (else shard 0's)."""
        dead = self._first_dead()
        return (dead or self.procs[0]).log_text()

    def error_line(self) -> str | None:
        """The last error line of the first shard that exited (else shard 0's)."""
        dead = self._first_dead()
        return (dead or self.procs[0]).error_line()

    def terminate(self) -> None:
        for p in self.procs:
            p.terminate()

    def kill(self) -> None:
        for p in self.procs:
            p.kill()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for every shard; the first non-zero exit code (0 when all exited cleanly)."""
        codes = [p.wait(timeout) for p in self.procs]
        return next((c for c in codes if c), 0)


def start_syncer_shards(
    files: JobFiles,
    *,
    shards: int,
    state_dir: Path,
    job_name: str,
    log_dir: Path,
    extra_env: Mapping[str, str] | None = None,
    ready_timeout: float = 60.0,
) -> SyncerShards:
    """Start the job's `shards` syncer processes, each on a free port, and wait until each is
    ready."""
    ports: list[int] = []
    while len(ports) < shards:  # free a moment ago, and not another shard's
        port = free_port()
        if port not in ports:
            ports.append(port)
    group = SyncerShards(
        files=files,
        state_dir=state_dir,
        job_name=job_name,
        log_dir=log_dir,
        ports=ports,
        extra_env=dict(extra_env or {}),
        ready_timeout=ready_timeout,
    )
    try:
        for shard in range(shards):
            group.start(shard)
    except BaseException:
        for proc in group.procs:  # none is left running when one cannot start
            proc.stop(timeout=5)
        raise
    return group
