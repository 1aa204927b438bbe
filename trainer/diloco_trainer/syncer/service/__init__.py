"""The syncer as a service: the parts built at start-up (startup), one job's Syncer holding them
(service), the two sequences that cross them (a push: push.py; a merge: service.py), the island
calls, the background evaluations and checkpoints (jobs) and the status document.

This face is what the other sub-packages use; the modules inside import each other directly."""

from __future__ import annotations

from diloco_trainer.syncer.service.service import Syncer, main

__all__ = ["Syncer", "main"]
