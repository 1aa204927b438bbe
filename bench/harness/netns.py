"""A network namespace whose loopback is rate-limited with tc tbf, for peers we cannot relay.

torchft's gloo ring connects replicas to each other directly, on addresses they exchange through
a store, so no relay can be put in its path. Run inside a namespace of its own, every byte it sends
(gloo, store, lighthouse) crosses that namespace's loopback, and a token-bucket filter there limits
all of it together. The kernel here has no netem, so no latency can be added this way.
Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def unavailable_reason() -> str | None:
    """Why shaped namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    name = f"dlbench-probe-{os.getpid()}"
    made = _run("ip", "netns", "add", name)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        tbf = _run(
            "ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
            "rate", "1mbit", "burst", "16kb", "limit", "64kb",
        )  # fmt: skip
        if tbf.returncode != 0:
            return f"tc tbf unavailable: {tbf.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", name)
    return None


@contextlib.contextmanager
def shaped_namespace(tag: str, rate_mbit: float | None) -> Iterator[list[str]]:
    """A fresh namespace with loopback up (MTU 1500, like a real link) and, when rate_mbit is set,
    a tbf qdisc limiting it. Yields the command prefix that runs a program inside it; the
    namespace is deleted afterwards (with whatever still runs in it losing its network)."""
    name = f"dlbench-{tag}-{os.getpid()}"
    made = _run("ip", "netns", "add", name)
    if made.returncode != 0:
        raise RuntimeError(f"ip netns add {name}: {made.stderr.strip()}")
    try:
        for cmd in (
            ["ip", "link", "set", "lo", "mtu", "1500"],
            ["ip", "link", "set", "lo", "up"],
        ):
            r = _run("ip", "netns", "exec", name, *cmd)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} in {name}: {r.stderr.strip()}")
        if rate_mbit:
            rate_bytes = rate_mbit * 1e6 / 8
            burst = max(16 * 1024, int(rate_bytes * 0.005))  # ~5 ms of line rate
            limit = max(64 * 1024, int(rate_bytes * 0.25))  # a 250 ms queue, then drops
            r = _run(
                "ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                "rate", f"{int(rate_mbit * 1e6)}bit", "burst", str(burst), "limit", str(limit),
            )  # fmt: skip
            if r.returncode != 0:
                raise RuntimeError(f"tc tbf in {name}: {r.stderr.strip()}")
        yield ["ip", "netns", "exec", name]
    finally:
        _run("ip", "netns", "del", name)
