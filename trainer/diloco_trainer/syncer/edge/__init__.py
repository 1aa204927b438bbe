"""The syncer's edge."""
