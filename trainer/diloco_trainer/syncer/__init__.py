"""`diloco syncer`: the CPU service that merges islands' pseudo-gradients into the global model
(the round state machine, the service, its HTTP edge, checkpoints and metrics)."""
