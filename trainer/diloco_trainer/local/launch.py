"""Process helpers shared by `diloco run` and the tests: job files, pod environments, processes.

Every process is `python -m diloco_trainer.cli syncer|learner` in its own process group (so a kill
reaches its children too, e.g. DDP workers), with stdout and stderr in a log file, and its
environment built from the names in contract.py: a local run takes the same code path as a pod.

A process whose environment names its owner (DILOCO_RUN_PID, which `diloco run` sets) dies with
that owner: on Linux the kernel sends it SIGKILL when its parent exits (PR_SET_PDEATHSIG), so a
`diloco run` killed with SIGKILL, or one whose terminal closed, leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from diloco_trainer.api import contract, credentials
from diloco_trainer.api.spec import JobSpec

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def port_candidates(range_file: Path = EPHEMERAL_RANGE_FILE) -> list[range]:
    """Port ranges to pick from: 10000-65535 minus the kernel's ephemeral range.

    Outgoing connections take their local port from the ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range, usually 32768-60999), so a port chosen there
    could be grabbed by any connection between our check and the component's bind.
    """
    low, high = 32768, 60999
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, range_file.read_text().split())
    ranges = [range(10000, min(low, 65536)), range(max(high + 1, 10000), 65536)]
    ranges = [r for r in ranges if len(r) > 0]
    return ranges or [range(10000, 65536)]


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago, outside the ephemeral range.

    The kernel's own choice (bind to port 0) lies in the ephemeral range, where another
    process's outgoing connection can take it before the syncer or torch's rendezvous binds
    it: two local runs side by side on a busy machine lost a rendezvous port that way
    (EADDRINUSE). A random port outside that range is taken only by a deliberate bind.
    """
    rng = random.SystemRandom()
    ranges = port_candidates()
    weights = [len(r) for r in ranges]
    for _ in range(1000):
        port = rng.choice(rng.choices(ranges, weights)[0])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class JobFiles:
    """The files a job's processes read: the spec as JSON and the bearer token."""

    config_file: Path
    token_file: Path
    token: str


def write_job_files(spec: JobSpec, workdir: Path, token: str | None = None) -> JobFiles:
    """Write spec.json and a token file (mode 0600) into workdir; a random token when none."""
    workdir.mkdir(parents=True, exist_ok=True)
    token = token or secrets.token_urlsafe(32)
    config_file = workdir / contract.CONFIG_KEY
    config_file.write_text(spec.to_json())
    token_file = workdir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    return JobFiles(config_file=config_file, token_file=token_file, token=token)


def island_token_file(files: JobFiles, island: str) -> Path:
    """The file holding `island`'s own credential, derived from the job's root token (as the
    operator mounts it in an island's pods): a learner can act as its island only."""
    path = files.token_file.parent / contract.ISLAND_TOKENS_DIR / island
    path.parent.mkdir(mode=0o700, exist_ok=True)
    staged = path.with_name(f".{island}.{os.getpid()}")
    staged.write_text(credentials.island_token(files.token, island))
    staged.chmod(0o600)
    staged.replace(path)  # ranks of one island write the same file: never a half-written one
    return path


def syncer_env(
    files: JobFiles,
    *,
    port: int,
    state_dir: Path,
    job_name: str,
    tls_cert_file: Path | None = None,
    tls_key_file: Path | None = None,
    shard: int | None = None,
) -> dict[str, str]:
    """The syncer's contract variables (add them to os.environ when starting it); `shard`: which
    of syncer.shards it is (None: the one syncer of the job)."""
    env = {
        contract.JOB_NAME: job_name,
        contract.SYNCER_PORT: str(port),
        contract.TOKEN_FILE: str(files.token_file),
        contract.CONFIG_FILE: str(files.config_file),
        contract.STATE_DIR: str(state_dir),
    }
    if shard is not None:
        env[contract.SYNCER_SHARD] = str(shard)
    if tls_cert_file and tls_key_file:
        env[contract.TLS_CERT_FILE] = str(tls_cert_file)
        env[contract.TLS_KEY_FILE] = str(tls_key_file)
    return env


def learner_env(
    files: JobFiles,
    *,
    syncer_url: str,
    island: str,
    island_index: int,
    rank: int,
    world_size: int,
    master_port: int,
    slowdown: float = 1.0,
    job_name: str = "local",
    ca_file: Path | None = None,
    device: str = "cpu",
) -> dict[str, str]:
    """A learner rank's contract variables (add them to os.environ when starting it)."""
    env = {
        contract.JOB_NAME: job_name,
        contract.ISLAND: island,
        contract.ISLAND_INDEX: str(island_index),
        contract.RANK: str(rank),
        contract.WORLD_SIZE: str(world_size),
        contract.MASTER_ADDR: "127.0.0.1",
        contract.MASTER_PORT: str(master_port),
        contract.SYNCER_URL: syncer_url,
        contract.TOKEN_FILE: str(island_token_file(files, island)),
        contract.CONFIG_FILE: str(files.config_file),
        contract.DEVICE: device,
        contract.SLOWDOWN: str(slowdown),
    }
    if ca_file:
        env[contract.CA_FILE] = str(ca_file)
    return env


class Proc:
    """A child process in its own process group, logging to `log_file`.

    The group is signalled only while its id cannot belong to anyone else: a group id stays
    reserved while any member lives, but once the leader is reaped and the group is empty the
    kernel may hand the number to a new process, even a new group leader (pid_max is 32768 on
    many machines, and test runs start thousands of processes). So the first time this object
    sees the leader gone it kills whatever is left in the group at once, and never signals the
    group again (a teardown minutes later once killed an unrelated process group this way).
    """

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_file: Path) -> None:
        self.name = name
        self.popen = popen
        self.log_file = log_file
        self._swept = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _observe(self, code: int | None) -> int | None:
        """Called with every exit status read: sweeps the group the first time it is not None."""
        if code is not None and not self._swept:
            self._swept = True
            # Stragglers keep the group id reserved, so this cannot reach a stranger.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        return code

    @property
    def alive(self) -> bool:
        return self._observe(self.popen.poll()) is None

    @property
    def returncode(self) -> int | None:
        return self._observe(self.popen.poll())

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._observe(self.popen.poll()) is not None:
            return  # the leader is gone and its group was swept: the id may be someone else's
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def terminate(self) -> None:
        """SIGTERM to the whole process group (graceful stop)."""
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the whole process group (a crash, as far as the others can tell)."""
        self._signal_group(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the leader to exit; raises subprocess.TimeoutExpired after `timeout`."""
        code = self._observe(self.popen.wait(timeout))
        assert code is not None
        return code

    def stop(self, timeout: float = 10.0) -> int:
        """Terminate, wait up to `timeout`, then kill the group; returns the exit code."""
        self.terminate()
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.wait()

    def log_text(self) -> str:
        """The process's output so far (for test failure messages)."""
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def error_line(self) -> str | None:
        """The last error line of the process's log (last_error_line)."""
        return last_error_line(self.log_text())


# A logged error ("... ERROR island-0/0 name: message"), a traceback's last line ("ValueError:
# message"), or a command's own refusal ("diloco learner: ...").
_ERROR_LINE = re.compile(
    r"( (ERROR|CRITICAL) )|(^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b)|(^diloco \w+: )"
)


def last_error_line(text: str) -> str | None:
    """The last line of a log that says what went wrong, None when none does."""
    for line in reversed(text.splitlines()):
        if _ERROR_LINE.search(line.strip()):
            return line.strip()
    return None


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with(owner: int) -> Callable[[], None] | None:
    """A preexec function binding the child's life to its parent `owner` (this process): the
    kernel SIGKILLs the child when the parent exits; a parent already gone ends it at once.
    None where there is no prctl (not Linux): the owner's signal handlers stop its children."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: nothing to load after the fork
    prctl = libc.prctl

    def bind() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != owner:  # it died between the fork and prctl
            os._exit(1)

    return bind


def start_process(
    name: str,
    command: str,
    env: Mapping[str, str],
    *,
    log_file: Path,
    extra_env: Mapping[str, str] | None = None,
) -> Proc:
    """Start `python -m diloco_trainer.cli COMMAND` in a new session (own process group); with
    DILOCO_RUN_PID in its environment naming this process, it dies with this process."""
    full_env = {**os.environ, **env, **(extra_env or {})}
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    owner = full_env.get(contract.RUN_PID)
    bind = die_with(os.getpid()) if owner == str(os.getpid()) else None
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "diloco_trainer.cli", command],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=bind,  # only prctl and getppid run in the child before exec
        )
    return Proc(name, popen, log_file)


def start_syncer(
    files: JobFiles,
    *,
    port: int,
    state_dir: Path,
    job_name: str,
    log_file: Path,
    tls_cert_file: Path | None = None,
    tls_key_file: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    shard: int | None = None,
) -> Proc:
    """Start `diloco syncer` with the contract environment (as shard `shard` of several)."""
    env = syncer_env(
        files,
        port=port,
        state_dir=state_dir,
        job_name=job_name,
        tls_cert_file=tls_cert_file,
        tls_key_file=tls_key_file,
        shard=shard,
    )
    name = "syncer" if shard is None else f"syncer-{shard}"
    return start_process(name, "syncer", env, log_file=log_file, extra_env=extra_env)


def start_learner(
    files: JobFiles,
    *,
    syncer_url: str,
    island: str,
    island_index: int,
    log_file: Path,
    rank: int = 0,
    world_size: int = 1,
    master_port: int = 0,
    slowdown: float = 1.0,
    job_name: str = "local",
    ca_file: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> Proc:
    """Start one learner rank (`diloco learner`) with the contract environment."""
    env = learner_env(
        files,
        syncer_url=syncer_url,
        island=island,
        island_index=island_index,
        rank=rank,
        world_size=world_size,
        master_port=master_port or contract.DEFAULT_MASTER_PORT,
        slowdown=slowdown,
        job_name=job_name,
        ca_file=ca_file,
    )
    return start_process(
        f"{island}/rank{rank}", "learner", env, log_file=log_file, extra_env=extra_env
    )


def wait_ready(
    url: str,
    token: str,
    timeout: float = 60.0,
    *,
    proc: Proc | None = None,
    ca_file: Path | None = None,
) -> None:
    """Poll the syncer's /readyz until 200, then check the token against /v1/status.

    Raises TimeoutError after `timeout`, or RuntimeError at once when `proc` exits first (with the
    tail of its log) or the token is refused.
    """
    import ssl

    ctx = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    base = url.rstrip("/")
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and not proc.alive:
            error = proc.error_line()
            raise RuntimeError(
                f"{proc.name} exited with {proc.returncode} before it was ready"
                + (f": {error}" if error else "")
                + f"\nlast lines of {proc.log_file}:\n"
                + proc.log_text()[-3000:]
            )
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=2, context=ctx) as resp:
                if resp.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"syncer at {base} not ready within {timeout}s")
        time.sleep(0.05)
    req = urllib.request.Request(base + "/v1/status", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx):
            pass
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"syncer at {base} refused the token: {err.code}") from None
