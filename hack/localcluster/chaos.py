"""Faults injected into a running local cluster with a real node, for the chaos suite
(tests/node/test_chaos.py, bench/chaos.py): a component stopped and started again with the very
command line and environment it ran with (kept in state.json, so `down` stops the new process),
a pod's processes found and signalled from the host (the node is this machine), a pod's network
cut in its own network namespace, and a small filesystem to fill under a volume.

Standard library only, like the rest of the command line's package; root, as the real node is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .realnode import host_tool
from .state import Cluster


@dataclass(frozen=True)
class Stopped:
    """A component's command line and environment, to start it again as it was."""

    name: str
    argv: list[str]
    env: dict[str, str]


def _read_nul(path: Path) -> list[str]:
    return [part for part in path.read_bytes().decode(errors="replace").split("\0") if part]


def stop_component(cluster_dir: Path, name: str) -> Stopped:
    """Stop one recorded component (SIGTERM, then SIGKILL: Cluster.stop) after reading how it
    was started from /proc."""
    c = Cluster(cluster_dir)
    lock = c.lock()  # state.json is the cluster's: no other command writes it meanwhile
    try:
        c.load()
        record = c.processes().get(name)
        if not record:
            raise RuntimeError(f"{name} is not a running component of {cluster_dir}")
        proc = Path("/proc") / str(record["pid"])
        argv = _read_nul(proc / "cmdline")
        env = dict(item.split("=", 1) for item in _read_nul(proc / "environ") if "=" in item)
        c.stop(name)
    finally:
        os.close(lock)
    return Stopped(name, argv, env)


def start_component(cluster_dir: Path, stopped: Stopped) -> None:
    """Start a component stopped by stop_component again, recorded in state.json."""
    c = Cluster(cluster_dir)
    lock = c.lock()
    try:
        c.load()
        c.start(stopped.name, stopped.argv, env=stopped.env)
    finally:
        os.close(lock)


def component_pid(cluster_dir: Path, name: str) -> int:
    c = Cluster(cluster_dir)
    c.load()
    return int(c.processes()[name]["pid"])


def pod_pids(pod_uid: str) -> list[int]:
    """Processes of a pod, by its UID in their cgroup path (cgroupfs: pod<uid>, systemd:
    pod<uid with underscores>), the pause container's included."""
    marks = (f"pod{pod_uid}", f"pod{pod_uid.replace('-', '_')}")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroups = (entry / "cgroup").read_text()
        except OSError:
            continue
        if any(mark in cgroups for mark in marks):
            found.append(int(entry.name))
    return sorted(found)


def pod_main_pid(pod_uid: str, command_word: str) -> int:
    """The pod's process whose command line holds `command_word` (e.g. 'syncer'), not pause."""
    for pid in pod_pids(pod_uid):
        try:
            argv = _read_nul(Path("/proc") / str(pid) / "cmdline")
        except OSError:
            continue
        if any(command_word in a for a in argv) and not any(a.endswith("pause") for a in argv):
            return pid
    raise RuntimeError(f"no process of pod {pod_uid} runs {command_word!r}")


def kill_pod_process(pod_uid: str, command_word: str) -> int:
    """SIGKILL the pod's main process from the host (as the kernel's OOM killer would); its
    pid."""
    pid = pod_main_pid(pod_uid, command_word)
    os.kill(pid, signal.SIGKILL)
    return pid


# Everything but loopback, both ways: the pod keeps running, its packets go nowhere.
_CUT_RULES = (["INPUT", "!", "-i", "lo"], ["OUTPUT", "!", "-o", "lo"])


def cut_pod_network(pid: int, *, cut: bool) -> None:
    """Cut (or restore) the network of the pod `pid` runs in, inside its own network namespace
    (iptables DROP rules there, through `ip netns`), the host's and the other pods' untouched."""
    ip, iptables = host_tool("ip"), host_tool("iptables")
    name = f"diloco-chaos-{pid}"
    subprocess.run([ip, "netns", "attach", name, str(pid)], check=True, capture_output=True)
    try:
        for chain, *match in _CUT_RULES:
            action = "-I" if cut else "-D"
            subprocess.run(
                [ip, "netns", "exec", name, iptables, "-w", action, chain, *match, "-j", "DROP"],
                check=True,
                capture_output=True,
                text=True,
            )
    finally:
        subprocess.run([ip, "netns", "delete", name], check=False, capture_output=True)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def mount_small_fs(path: Path, *, size_mb: int, uid: int) -> None:
    """A tmpfs of `size_mb` MiB at `path` owned by `uid` (mount(2) through libc: no program
    needed): a volume a test can fill without filling the machine's disk."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_mb}m,mode=0755,uid={uid},gid={uid}".encode()
    if _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", 0, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


def unmount(path: Path) -> None:
    """Detach the filesystem at `path` (MNT_DETACH: even while a pod still has it open)."""
    _libc().umount2(str(path).encode(), 2)


def fill(path: Path, name: str = "chaos-filler") -> Path:
    """Write zeros into `path`/name until the filesystem is full; the filler's path."""
    filler = path / name
    block = b"\0" * (1 << 20)
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(block)
                f.flush()
    except OSError:
        pass  # ENOSPC: full, which is the point
    return filler
