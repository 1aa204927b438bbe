"""Process-level tests: real syncer and learner processes on loopback."""
