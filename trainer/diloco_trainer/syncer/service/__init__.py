"""The syncer's service."""
