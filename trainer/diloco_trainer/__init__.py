"""Decoupled DiLoCo trainer: learners (inner loop) and the syncer (outer loop)."""

__version__ = "0.1.0"
