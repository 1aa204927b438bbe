"""The syncer's state."""
