"""What learners pull: each fragment's encoded body, re-encoded after a merge (publisher), and
the chain of recent updates kept off the heap (update_history).

This face is what the other sub-packages use; the modules inside import each other directly."""

from __future__ import annotations

from diloco_trainer.syncer.serving.publisher import Body, BodyKey, Publisher, PullSnapshot

__all__ = ["Body", "BodyKey", "Publisher", "PullSnapshot"]
