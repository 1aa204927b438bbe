"""The syncer's serving."""
