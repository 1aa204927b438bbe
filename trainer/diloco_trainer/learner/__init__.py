"""`diloco learner`: one rank of one island (the inner loop, DDP inside the island, the link to the
syncer). `loop.main` is the entry point."""
