"""The syncer's storage."""
