"""Mounts under a directory: listing them and taking them down before the directory is removed.

The real node mounts below DIR/node (container root filesystems, pod volumes as tmpfs, the
pods' network namespaces, shm). Removing DIR while one of them is mounted would delete through
it, so `down` unmounts everything below DIR first and refuses to delete what stays mounted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

MNT_DETACH = 2


def unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040 ...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(mountinfo: str) -> list[str]:
    """The mount points listed in a /proc/PID/mountinfo text (field 5), in order."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.append(unescape(fields[4]))
    return points


def under(points: list[str], root: Path) -> list[str]:
    """The mount points at or below root, deepest first (children before parents)."""
    prefix = str(root).rstrip("/")
    inside = {p for p in points if p == prefix or p.startswith(prefix + "/")}
    return sorted(inside, key=lambda p: (p.count("/"), p), reverse=True)


def mounts_under(root: Path) -> list[str]:
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    return under(mount_points(text), root.resolve())


def unmount_all(root: Path, rounds: int = 5) -> list[str]:
    """Detach every mount at or below root (stacked mounts need more than one round); return
    the mount points still there afterwards (empty on success)."""
    if not root.exists():
        return []
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for _ in range(rounds):
        left = mounts_under(root)
        if not left:
            return []
        for point in left:
            if libc.umount2(os.fsencode(point), MNT_DETACH) != 0:
                continue  # reported below if it never goes
    return mounts_under(root)
