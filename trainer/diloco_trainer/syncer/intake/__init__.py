"""The syncer's intake."""
