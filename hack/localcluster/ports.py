"""Free loopback ports for the components, leased machine-wide so that clusters started side by
side never pick the same one before either has bound it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import ClusterError
from .settings import PORT_LEASE_FILE, PORT_LEASE_SECONDS

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_candidates(range_file: Path = EPHEMERAL_RANGE_FILE) -> list[range]:
    """Port ranges to pick from: 10000-65535 minus the kernel's ephemeral range.

    Outgoing connections take their local port from the ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range, usually 32768-60999), so a port chosen there
    could be grabbed by any connection between our check and the component's bind.
    The trainer's `diloco run` follows the same rule (diloco_trainer.local.launch); this
    copy stays here because the local-cluster command line imports only the standard library
    (tests/unit/test_localcluster_cli.py).
    """
    low, high = 32768, 60999
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, range_file.read_text().split())
    ranges = [range(10000, min(low, 65536)), range(max(high + 1, 10000), 65536)]
    ranges = [r for r in ranges if len(r) > 0]
    return ranges or [range(10000, 65536)]


def pick_ports(count: int, taken: set[int]) -> list[int]:
    """`count` distinct free loopback ports, none of them chosen by another local-cluster
    in the last PORT_LEASE_SECONDS (a machine-wide lease file, so that two clusters started
    side by side cannot pick the same port before either has bound it)."""
    rng = random.SystemRandom()
    ranges = port_candidates()
    weights = [len(r) for r in ranges]
    with port_leases() as leases:
        ports: list[int] = []
        for _ in range(5000):
            if len(ports) == count:
                break
            p = rng.choice(rng.choices(ranges, weights)[0])
            if p in taken or p in ports or str(p) in leases or not port_is_free(p):
                continue
            ports.append(p)
        else:
            raise ClusterError("could not find free loopback ports")
        now = time.time()
        leases.update({str(p): now for p in ports})
    return ports


def lease_file() -> Path:
    return Path(os.environ.get("DILOCO_K8S_PORT_LEASES") or PORT_LEASE_FILE)


def fresh_leases(raw: object, now: float) -> dict[str, float]:
    """The leases of a parsed lease file that have not expired (anything malformed dropped)."""
    cutoff = now - PORT_LEASE_SECONDS
    return {
        k: v
        for k, v in (raw.items() if isinstance(raw, dict) else [])
        if isinstance(v, (int, float)) and v > cutoff
    }


@contextlib.contextmanager
def port_leases() -> Iterator[dict[str, float]]:
    """The machine-wide {port: time chosen} map, locked while the caller edits it."""
    try:
        fd = os.open(lease_file(), os.O_CREAT | os.O_RDWR, 0o666)
    except OSError:  # e.g. a read-only /tmp: go without leases
        yield {}
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            leases = json.loads(os.read(fd, 1 << 20) or b"{}")
        except ValueError:  # a torn write from a killed process: start over
            leases = {}
        fresh = fresh_leases(leases, time.time())
        yield fresh
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(fresh, sort_keys=True).encode())
    finally:
        os.close(fd)
