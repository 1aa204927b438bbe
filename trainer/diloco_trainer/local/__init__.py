"""`diloco run`: a whole job as local processes (launch, live progress, summary, plot).

Inside the trainer only the CLI imports this package. Code outside it (hack/'s operator process,
the benchmarks, the tests) starts syncers, learners and other processes through the names below,
its public surface, and never through the modules behind it: the `lint-imports` contracts in
pyproject.toml check both. Importing it loads `launch` and `syncer_shards` only (stdlib and the
torch-free api), not the live view or the plot.
"""

from diloco_trainer.local.launch import (
    JobFiles,
    Proc,
    free_port,
    start_learner,
    start_process,
    start_syncer,
    wait_ready,
    write_job_files,
)
from diloco_trainer.local.syncer_shards import SyncerShards, start_syncer_shards

__all__ = [
    "JobFiles",
    "Proc",
    "SyncerShards",
    "free_port",
    "start_learner",
    "start_process",
    "start_syncer",
    "start_syncer_shards",
    "wait_ready",
    "write_job_files",
]
