"""Users' models that the benchmarks train through `model.entrypoint` (held-out work: none of
them is a preset of ours). examples/byo's CharGRU is the other one."""
