"""One cluster directory: state.json, pid files, logs, its lock, and the processes it records."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from .errors import ClusterError, info, tail
from .processes import (
    SignalGuard,
    describe_status,
    pid_matches,
    signal_group,
    start_ticks,
)
from .settings import COMPONENTS, NODE_COMPONENTS, STATE_FILE


class Cluster:
    def __init__(self, directory: Path, deadline: float | None = None):
        self.dir = directory.resolve()
        self.deadline = deadline  # time.monotonic() by which `up` must be done
        self.pki = self.dir / "pki"
        self.logs = self.dir / "logs"
        self.pids = self.dir / "pids"
        self.state_path = self.dir / STATE_FILE
        self.state: dict[str, Any] = {}
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.started_at: dict[str, float] = {}  # monotonic start time of each child
        self.persist = True  # False: never write state.json / pid files

    # -- persistence
    def load(self) -> bool:
        try:
            self.state = json.loads(self.state_path.read_text())
            return True
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:
            raise ClusterError(f"cannot read {self.state_path}: {e}") from e

    def save(self) -> None:
        if not self.persist:
            return
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.state_path)

    def lock(self) -> int:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info(f"another local-cluster command is working on {self.dir}; waiting...")
            fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.state['ports']['apiserver']}"

    # -- processes
    def processes(self) -> dict[str, dict[str, Any]]:
        return self.state.get("processes", {})

    def running(self, name: str) -> bool:
        p = self.processes().get(name)
        return bool(p) and pid_matches(p["pid"], p["exe"], p.get("start"))

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pids.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{name}.log"
        with SignalGuard.deferred(), open(log_path, "ab") as log:
            log.write(
                f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode()
            )
            log.flush()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                env=env,
                # Its own process group (pgid == pid): `down` signals exactly this group.
                start_new_session=True,
                close_fds=True,
            )
            self.children[name] = proc
            self.started_at[name] = time.monotonic()
            record = {"pid": proc.pid, "exe": argv[0], "start": start_ticks(proc.pid)}
            self.state.setdefault("processes", {})[name] = record
            (self.pids / f"{name}.pid").write_text(f"{proc.pid}\n")
            self.save()

    def check_alive(self) -> None:
        """Raise ClusterError naming the first started component that is no longer running.

        For our own children the exit status decides (exact: an unreaped pid cannot be reused
        and /proc is not consulted); the pid check covers processes of an earlier command.
        """
        for name in [*COMPONENTS, *NODE_COMPONENTS]:
            child = self.children.get(name)
            if child is not None:
                dead = child.poll() is not None
            else:
                dead = name in self.processes() and not self.running(name)
            if dead:
                raise ClusterError(self.describe_death(name), name, retryable=True)

    def describe_death(self, name: str) -> str:
        """'etcd died 3.1s after it was started (killed by signal 15 (SIGTERM))' and the like."""
        child = self.children.get(name)
        since = ""
        if name in self.started_at:
            since = f" {time.monotonic() - self.started_at[name]:.1f}s after it was started"
        how = "not started by this command"
        if child is not None and child.poll() is not None:
            how = describe_status(child.returncode)
        hint = ""
        if "address already in use" in tail(self.logs / f"{name}.log", 60):
            hint = "; its log says a port was taken (another process bound it first)"
        return f"{name} died{since} ({how}){hint}"

    def stop(self, name: str, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL, to the process group of one recorded process.

        Each signal goes out only after checking that the pid still names the process that
        was started (pid and start time), so a reused pid is never signalled.
        """
        p = self.processes().get(name)
        if not p:
            return
        pid, exe, start = p["pid"], p["exe"], p.get("start")

        def ours() -> bool:
            return pid != os.getpid() and pid_matches(pid, exe, start)

        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if not ours():
                break
            signal_group(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                # Reap it if it is our child (it is when `up` fails half-way).
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                if not ours():
                    break
                time.sleep(0.1)
        if ours():
            info(f"WARNING: could not stop {name} (pid {pid})")
        self.processes().pop(name, None)
        # The directory may be gone already (e.g. a test runner rotated its temp dirs).
        if self.persist:
            with contextlib.suppress(OSError):
                (self.pids / f"{name}.pid").unlink(missing_ok=True)
                self.save()

    # -- API access with the admin client certificate
    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def api(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, context=self.ssl_context(), timeout=timeout) as resp:
            raw = resp.read()
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")
