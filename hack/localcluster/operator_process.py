"""`diloco operator` as a local process, for tests and benchmarks (see harness.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diloco_trainer.local import Proc

from .polling import poll_until
from .ports import free_port

DILOCO = str(Path(sys.executable).with_name("diloco"))


class ProcessExited(AssertionError):
    """A process the harness was waiting on exited."""


def standalone_operator_args(namespaces: Sequence[str]) -> list[str]:
    """`diloco` arguments of an operator watching these namespaces (no kopf peering)."""
    args = ["operator", "--standalone"]
    for ns in namespaces:
        args += ["--namespace", ns]
    return args


def with_ports(args: Sequence[str], ports: Mapping[str, int]) -> list[str]:
    """args with each flag of `ports` ("--health-port": 8080) set: replaced where the flag is
    present (its value follows it), appended where not."""
    out = list(args)
    for flag, port in ports.items():
        if flag in out:
            out[out.index(flag) + 1] = str(port)
        else:
            out += [flag, str(port)]
    return out


@dataclass
class OperatorProcess:
    """`diloco ARGS` (an operator) as a process in its own session, logging to `log_file`, with
    free local health and metrics ports set in its arguments."""

    env: Mapping[str, str]
    log_file: Path
    args: list[str] = field(default_factory=list)
    health_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: Proc | None = None
    # Called with the process as soon as it is spawned (a benchmark registers it for cleanup).
    on_spawn: Callable[[Proc], object] | None = field(default=None, repr=False)

    def argv(self) -> list[str]:
        ports = {"--health-port": self.health_port, "--metrics-port": self.metrics_port}
        return [DILOCO, *with_ports(self.args, ports)]

    def start(self, timeout: float = 180.0) -> None:
        """Start it and wait for its liveness endpoint; on failure it is killed again."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            popen = subprocess.Popen(
                self.argv(),
                env=dict(self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.proc = Proc("operator", popen, self.log_file)
        if self.on_spawn is not None:
            self.on_spawn(self.proc)
        try:
            poll_until(self.healthy, timeout=timeout, what="operator liveness endpoint")
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def healthy(self) -> bool:
        """Its /healthz answers 200; raises ProcessExited (with its log tail) once it exited."""
        assert self.proc is not None
        code = self.proc.returncode
        if code is not None:
            raise ProcessExited(f"operator exited with {code}:\n{self.log_text()[-4000:]}")
        try:
            url = f"http://127.0.0.1:{self.health_port}/healthz"
            with urllib.request.urlopen(url, timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20.0) -> None:
        """SIGTERM (a clean shutdown, SIGKILL after `timeout`) or SIGKILL (a crash) to its
        process group."""
        if self.proc is None or not self.proc.alive:
            return
        if sig == signal.SIGKILL:
            self.proc.kill()
            self.proc.wait(timeout=10)
        else:
            self.proc.stop(timeout=timeout)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive

    def metrics(self, timeout: float = 10.0) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode()

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def rss_bytes(self) -> int:
        """Resident memory of the operator process (and its children, if any)."""
        assert self.proc is not None
        pids = [self.proc.pid]
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        if children.exists():
            pids += [int(p) for p in children.read_text().split()]
        return sum(rss_of(pid) for pid in pids)


def rss_of(pid: int) -> int:
    """VmRSS of one process in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
