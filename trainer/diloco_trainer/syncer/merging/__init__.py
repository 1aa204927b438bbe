"""The syncer's merging."""
