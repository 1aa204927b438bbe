"""The syncer's edge: the HTTP routes and their limits (connections, bodies, push slots), who a
request speaks for, the shard a request belongs to, and the process that serves them.

This face is what the other sub-packages use; the modules inside import each other directly."""

from __future__ import annotations

from diloco_trainer.syncer.edge import server
from diloco_trainer.syncer.edge.shard_scope import ShardScope

__all__ = ["ShardScope", "server"]
