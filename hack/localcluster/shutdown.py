"""Stopping a whole cluster: the real node first, then every recorded process; removing its
directory. Above `state` and `nodeteardown` (both of which it uses), so imports go one way."""

from __future__ import annotations

import contextlib
import shutil
import signal

from .errors import info
from .mounts import unmount_all
from .nodeteardown import stop_real_node
from .settings import COMPONENTS, NODE_COMPONENTS
from .state import Cluster


def stop_cluster(c: Cluster) -> None:
    """Stop every recorded process; the watchdog last, so an interrupted stop still leaves it
    to finish the job. Signals are ignored meanwhile (bounded waits)."""
    names = [*reversed(NODE_COMPONENTS), *reversed(COMPONENTS), "watchdog"]
    names += [n for n in c.processes() if n not in names]
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if c.state.get("real_node"):
            # The real node first: its drain needs the API server.
            try:
                stop_real_node(c)
            except Exception as e:
                info(f"WARNING: stopping the real node failed: {e}")
        for name in names:
            try:
                c.stop(name)
            except Exception as e:  # keep going: the other processes must still stop
                info(f"WARNING: stopping {name} failed: {e}")
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def wipe(c: Cluster, keep_logs: bool) -> None:
    """Remove the cluster's directory (its logs kept with keep_logs), never through a mount."""
    if not c.dir.exists():
        return
    # Never delete through a mount (a real node's volumes, container root filesystems).
    left = unmount_all(c.dir)
    if left:
        info(f"WARNING: not removing {c.dir}: still mounted: {', '.join(left[:5])}")
        return
    for entry in c.dir.iterdir():
        if entry.name == ".lock" or (keep_logs and entry.name == "logs"):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if not keep_logs:
        (c.dir / ".lock").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            c.dir.rmdir()
