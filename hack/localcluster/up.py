"""`up`: reuse a healthy cluster or start one, retrying failed starts; the owner watchdog."""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .components import https_ok, resolve_bin_dir, start_components, write_client_files
from .errors import ClusterError, failure_text, info, tail
from .nodes import create_nodes
from .pki import make_node_pki
from .ports import pick_ports, port_is_free
from .processes import SignalGuard, pid_matches, start_ticks
from .realnode import node_ip, preflight, resolve_node_bin_dir, start_real_node
from .settings import (
    COMPONENTS,
    ENTRY_POINT,
    MIN_ATTEMPT_SECONDS,
    NODE_COMPONENTS,
    NODE_NAME,
    PORT_KEYS,
)
from .shutdown import stop_cluster, wipe
from .state import Cluster


def choose_ports(fixed: dict[str, int]) -> dict[str, int]:
    """A port per listener: the fixed ones (non-zero values) as given, the others picked."""
    for p in fixed.values():
        if p and not port_is_free(p):
            raise ClusterError(f"port {p} on 127.0.0.1 is already in use")
    free = iter(pick_ports(len(PORT_KEYS), {p for p in fixed.values() if p}))
    return {k: fixed.get(k) or next(free) for k in PORT_KEYS}


def attempt_up(c: Cluster, args: argparse.Namespace, bin_dir: Path, name: str) -> None:
    """One try at a cluster in c.dir (empty but for logs): fresh ports, PKI and etcd data."""
    c.state = {"name": name, "bin_dir": str(bin_dir), "processes": {}, "created": time.time()}
    c.state["ports"] = choose_ports({"apiserver": args.apiserver_port, "etcd": args.etcd_port})
    c.save()
    write_client_files(c, name)
    if args.real_node:  # before the apiserver starts: its flags and certificate change
        c.state["advertise_address"] = node_ip()
        make_node_pki(c.pki, c.state["advertise_address"])
    start_components(c, bin_dir)
    create_nodes(c, args.nodes)
    if args.real_node:
        start_real_node(c, node_bin_dir(args))


def node_bin_dir(args: argparse.Namespace) -> Path:
    """The real node's bin dir, resolved (and built) once per `up`, before the first attempt."""
    if getattr(args, "node_bin_dir", None) is None:
        args.node_bin_dir = resolve_node_bin_dir()
    return Path(args.node_bin_dir)


def archive_logs(c: Cluster, attempt: int) -> Path:
    """Move the component logs of a failed attempt to DIR/logs/attempt-N/."""
    dest = c.logs / f"attempt-{attempt}"
    dest.mkdir(parents=True, exist_ok=True)
    for log in c.logs.glob("*.log"):
        log.replace(dest / log.name)
    return dest


def cmd_up(args: argparse.Namespace) -> int:
    c = Cluster(Path(args.dir))
    lock_fd = c.lock()
    try:
        return up_locked(c, args)
    finally:
        os.close(lock_fd)


@dataclass
class Attempts:
    """What `up` has tried so far: the cluster of the latest attempt and each failure."""

    cluster: Cluster
    failures: list[str] = field(default_factory=list)  # one line per failed attempt
    last_log: Path | None = None  # the log of the component that failed last
    count: int = 0


def reuse_if_healthy(c: Cluster, args: argparse.Namespace) -> bool:
    """True (exports printed) if c.dir holds a running, healthy cluster; stale state (dead
    processes) is cleaned up."""
    if not c.load():
        return False
    wanted = [*COMPONENTS, *(NODE_COMPONENTS if args.real_node else [])]
    if all(c.running(n) for n in wanted) and c.kubeconfig.exists():
        try:
            ok = https_ok(c.server + "/readyz", c.ssl_context())
        except (OSError, ssl.SSLError):
            ok = False
        if ok:
            info(f"cluster in {c.dir} is already running")
            print_exports(c)
            return True
    info(f"found stale state in {c.dir}; cleaning it up first")
    stop_cluster(c)
    wipe(c, keep_logs=True)
    return False


def up_locked(c: Cluster, args: argparse.Namespace) -> int:
    """`up` with c.dir locked: reuse a healthy cluster, else start one, retrying failed
    starts (each time with new ports, certificates and etcd data) up to args.attempts times."""
    t0 = time.monotonic()
    if reuse_if_healthy(c, args):
        return 0
    c = Cluster(c.dir)
    c.dir.mkdir(parents=True, exist_ok=True)
    bin_dir = resolve_bin_dir()
    if args.real_node:  # what no attempt can fix, before a control plane is started for nothing
        node_bin_dir(args)
        preflight()
    name = args.name or f"diloco-{c.dir.name}"
    deadline = t0 + args.timeout

    signal.signal(signal.SIGINT, SignalGuard.handler)
    signal.signal(signal.SIGTERM, SignalGuard.handler)
    tried = Attempts(c)
    try:
        attempt_until_up(tried, args, bin_dir, name, deadline)
        c = tried.cluster
        if args.owner_pid:
            start_watchdog(c, args.owner_pid)
        c.state["ready_seconds"] = round(time.monotonic() - t0, 1)
        c.state["attempts"] = tried.count
        c.save()
    except BaseException as e:
        code = give_up(tried, e)
        if code is None:
            raise
        return code
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    elapsed = time.monotonic() - t0
    tries = f" (attempt {tried.count})" if tried.count > 1 else ""
    real = f" and real node {NODE_NAME}" if args.real_node else ""
    what = f"{c.server}, {args.nodes} kwok nodes{real}"
    info(f"cluster '{name}' is up in {elapsed:.1f}s{tries}: {what}")
    info(f"logs: {c.logs}   stop: {ENTRY_POINT} down --dir {c.dir}")
    print_exports(c)
    return 0


def attempt_until_up(
    tried: Attempts, args: argparse.Namespace, bin_dir: Path, name: str, deadline: float
) -> None:
    """Attempt after attempt until one succeeds; raise the last failure once no retry is left
    (attempts used up, too little time left, or a failure no retry can fix)."""
    while True:
        tried.count += 1
        c = tried.cluster = Cluster(tried.cluster.dir, deadline=deadline)
        if tried.count > 1:
            info(f"attempt {tried.count} of {args.attempts}: new ports, certificates and data")
        try:
            attempt_up(c, args, bin_dir, name)
            return
        except Exception as e:
            tried.failures.append(f"attempt {tried.count}: {failure_text(e)}")
            info(f"ERROR: {failure_text(e)}")
            stop_cluster(c)
            c.state_path.unlink(missing_ok=True)
            archived = archive_logs(c, tried.count)
            component = getattr(e, "component", None)
            tried.last_log = archived / f"{component}.log" if component else None
            if tried.last_log is not None:
                info(f"last lines of {tried.last_log}:\n{tail(tried.last_log)}")
            retryable = e.retryable if isinstance(e, ClusterError) else True
            left = deadline - time.monotonic()
            if not retryable or tried.count >= args.attempts or left < MIN_ATTEMPT_SECONDS:
                raise
            wipe(c, keep_logs=True)


def give_up(tried: Attempts, e: BaseException) -> int | None:
    """Stop what was started; the exit code, or None when `e` must propagate."""
    c = tried.cluster
    if isinstance(e, KeyboardInterrupt):
        info(f"ERROR: {failure_text(e)}; stopping what was started")
    stop_cluster(c)
    c.state_path.unlink(missing_ok=True)
    if isinstance(e, KeyboardInterrupt):
        return 130
    if not isinstance(e, Exception):
        return None
    # The summary comes last, so that the tail of the output says it all.
    info(f"ERROR: up failed after {tried.count} attempt(s):\n  " + "\n  ".join(tried.failures))
    if tried.last_log is not None:
        info(f"last lines of {tried.last_log}:\n{tail(tried.last_log, 25)}")
    info(f"logs of every attempt: {c.logs}/attempt-*/")
    return 1


def print_exports(c: Cluster) -> None:
    print(f'export PATH="{c.state["bin_dir"]}:$PATH"')
    print(f"export KUBECONFIG={c.kubeconfig}")
    sys.stdout.flush()


def watchdog_argv(c: Cluster, owner_pid: int) -> list[str]:
    return [
        sys.executable,
        str(ENTRY_POINT),
        "_watchdog",
        "--dir",
        str(c.dir),
        "--owner-pid",
        str(owner_pid),
        # With its start time, a later process given the same pid is not taken for the owner.
        "--owner-start",
        str(start_ticks(owner_pid) or 0),
        # The processes to stop, handed over up front: the directory may be gone by then.
        "--processes",
        json.dumps(c.processes(), sort_keys=True),
    ]


def start_watchdog(c: Cluster, owner_pid: int) -> None:
    """A detached process that tears the cluster down when owner_pid exits."""
    c.start("watchdog", watchdog_argv(c, owner_pid))


def cmd_watchdog(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    c = Cluster(Path(args.dir))
    snapshot = json.loads(args.processes)
    while pid_matches(args.owner_pid, "", args.owner_start or None, check_exe=False):
        time.sleep(1.0)
    print(f"owner pid {args.owner_pid} exited; tearing the cluster down", flush=True)
    lock_fd = c.lock() if c.dir.exists() else None
    try:
        if c.dir.exists() and c.load():
            if c.processes().get("watchdog", {}).get("pid") != os.getpid():
                return 0  # `down` already ran, or a newer cluster took over this dir
            c.processes().pop("watchdog", None)
            stop_cluster(c)
            wipe(c, keep_logs=False)
        else:
            # No state: `down` already ran or the directory was removed under us. Stop
            # whatever of the snapshot still runs (pid_matches guards against pid reuse).
            c.state = {"processes": snapshot}
            c.persist = False
            c.processes().pop("watchdog", None)
            stop_cluster(c)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    return 0
