"""Commands, polling with deadlines, and process identity.

A pid alone does not name a process for good (the kernel reuses pids), so every process this
package starts is recorded with its start time (/proc/PID/stat), and checked against it before
each signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from .errors import ClusterError


class SignalGuard:
    """SIGINT/SIGTERM become KeyboardInterrupt, except inside critical sections.

    A signal that arrives while a component is being spawned and recorded is held until the
    section ends, so that no process is ever started without its pid in state.json.
    """

    critical: ClassVar[int] = 0
    pending: ClassVar[int | None] = None

    @classmethod
    def handler(cls, signum: int, _frame: Any) -> None:
        if cls.critical:
            cls.pending = signum
            return
        # Not an Exception: the polling loops must not swallow it.
        raise KeyboardInterrupt(f"interrupted by signal {signum}")

    @classmethod
    @contextlib.contextmanager
    def deferred(cls) -> Iterator[None]:
        cls.critical += 1
        try:
            yield
        finally:
            cls.critical -= 1
        if not cls.critical and cls.pending is not None:
            signum, cls.pending = cls.pending, None
            raise KeyboardInterrupt(f"interrupted by signal {signum}")


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, check=True, stdin=subprocess.DEVNULL, capture_output=True, text=True, **kw
        )
    except FileNotFoundError as e:
        raise ClusterError(f"command not found: {cmd[0]}") from e
    except subprocess.CalledProcessError as e:
        raise ClusterError(
            f"command failed ({e.returncode}): {' '.join(cmd)}\n{e.stderr.strip()}"
        ) from e


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    component: str | None = None,
    alive: Callable[[], None] | None = None,
    interval: float = 0.25,
) -> None:
    """Poll check() until it returns True; raise ClusterError after timeout seconds."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        if alive is not None:
            alive()
        try:
            if check():
                return
        except Exception as e:  # reported below if the deadline passes
            last_error = f" (last error: {e})"
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"timed out after {timeout:.0f}s waiting for {what}{last_error}",
                component,
                retryable=True,
            )
        time.sleep(interval)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When pid started (clock ticks since boot): with the pid, it names one process for good."""
    fields = proc_stat(pid)
    # Field 22 of /proc/PID/stat; fields[0] is field 3 (the state).
    return int(fields[19]) if fields and len(fields) > 19 else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive for our purposes.
    fields = proc_stat(pid)
    return fields is None or fields[0] != "Z"


def pid_matches(pid: int, exe: str, start: int | None = None, check_exe: bool = True) -> bool:
    """True if pid is alive and is the process we started, not a later one given the same pid.

    With its recorded start time the check is exact; state written by older versions has only
    the executable, compared with argv[0] (unless check_exe is False).
    """
    if not pid_alive(pid):
        return False
    if start is not None:
        now = start_ticks(pid)
        if now is not None:
            return now == start
    if not check_exe:
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return True  # no /proc: trust the pid
    return argv0 == exe


def signal_group(pid: int, sig: int) -> None:
    """Signal pid's process group if pid leads one (every component does), else pid alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def describe_status(code: int) -> str:
    """'exit code 1' or 'killed by signal 15 (SIGTERM)' for a Popen returncode."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown signal"
    return f"killed by signal {-code} ({name})"
