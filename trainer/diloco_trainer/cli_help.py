"""What `diloco learner --help` and `diloco syncer --help` say, and the missing-extra check.

Both processes take no options: the operator (and `diloco run`) start them with the environment
of api/contract.py, which is listed here so `--help` tells a user what to set. Torch-free: the
console script imports this module whatever is installed.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap

from diloco_trainer.api import contract as c

# Top-level modules of the [trainer] extra that every trainer command imports.
TRAINER_IMPORTS = ("torch", "safetensors", "aiohttp", "prometheus_client", "numpy")
INSTALL_TRAINER = "pip install 'diloco-operator[trainer]'"
# Top-level modules of the [local] extra, which only `diloco run` imports: its live view and
# summary (always), its plot (with --plot). The trainer image leaves them out.
LOCAL_IMPORTS = ("rich",)
PLOT_IMPORTS = ("matplotlib",)
INSTALL_LOCAL = "pip install 'diloco-operator[local]'"
WIDTH = 88  # help text is wrapped by hand (the raw formatter keeps the table's columns)

_SHARED = [
    (c.CONFIG_FILE, "required", "the job spec (JSON or YAML: a DiLoCoJob or its spec)"),
    (c.TOKEN_FILE, "required", "file holding the bearer credential"),
    (c.JOB_NAME, "local", "the job's name (logs, metrics, checkpoints)"),
]

LEARNER_ENV = [
    (c.ISLAND, "required", "this island's name, e.g. island-0"),
    (c.SYNCER_URL, "required", "the syncer, e.g. http://JOB-syncer:8470"),
    *_SHARED,
    (c.ISLAND_INDEX, "0", "the island's data shard among all of the job's islands"),
    (c.RANK, "0", "DDP rank inside the island (rank 0 talks to the syncer)"),
    (c.WORLD_SIZE, "1", "ranks in the island"),
    (c.MASTER_ADDR, "127.0.0.1", "rank 0's address (DDP rendezvous)"),
    (c.MASTER_PORT, str(c.DEFAULT_MASTER_PORT), "rank 0's port"),
    (c.CA_FILE, "unset", "CA bundle to verify an https:// syncer"),
    (c.DEVICE, "auto", "auto, cpu or cuda"),
    (c.SLOWDOWN, "1", "test knob: multiply this learner's step time"),
    (c.EMULATE_STEP, "0", "benchmark knob: each inner step is N s of an emulated accelerator"),
    (c.PACE_STEP, "0", "benchmark knob: pad each real inner step to N s (x the slowdown)"),
]

SYNCER_ENV = [
    *_SHARED,
    (c.SYNCER_PORT, str(c.DEFAULT_SYNCER_PORT), "port to serve on"),
    (c.SYNCER_HOST, c.DEFAULT_SYNCER_HOST, "address to listen on (diloco run: 127.0.0.1)"),
    (c.STATE_DIR, c.STATE_MOUNT, "checkpoints (resumed from at start), merges.jsonl"),
    (c.TLS_CERT_FILE, "unset", "serving certificate: HTTPS (with the key)"),
    (c.TLS_KEY_FILE, "unset", "its private key"),
]


def env_epilog(entries: list[tuple[str, str, str]], tail: str) -> str:
    """A --help epilog: one line per environment variable (name, default, meaning), then
    `tail`."""
    width = max(len(name) for name, _, _ in entries)
    lines = ["environment (the operator sets all of these; so does `diloco run`):"]
    for name, default, meaning in entries:
        lines.append(f"  {name:<{width}}  {meaning} [{default}]")
    return "\n".join([*lines, "", textwrap.fill(tail, WIDTH)])


LEARNER_EPILOG = env_epilog(
    LEARNER_ENV,
    "Trains one rank of one island: inner steps on its data shard, pseudo-gradients pushed to "
    "the syncer, merged weights pulled. Exits 0 when the job finished, 2 for a bad environment "
    "or spec.",
)
SYNCER_EPILOG = env_epilog(
    SYNCER_ENV,
    "Serves the job's global model over HTTP (/v1/..., /healthz, /readyz, /metrics) and "
    "checkpoints it. Exits 0 after SIGTERM, 1 after a failed merge, 2 for a bad environment or "
    "spec.",
)


RUN_DESCRIPTION = textwrap.fill(
    "Run a DiLoCoJob on this machine: one syncer and islands.count x islands.replicas learner "
    "processes on loopback, started with the commands and environment the operator gives pods. "
    "The job is checked first (as `diloco check` does): a bad manifest, a data source with no "
    "text, or a job that cannot fit this machine's memory is refused before anything starts.",
    WIDTH,
)
RUN_EPILOG = """examples:
  .venv/bin/diloco run                          the built-in demo (examples/local.yaml)
  .venv/bin/diloco run examples/local.yaml      into runs/local-demo/ (resumed if it is there)
  .venv/bin/diloco run examples/local.yaml --fresh   start over (the old folder moved aside)
  .venv/bin/diloco run examples/local.yaml --slow-island 1:3   watch decoupling
  DILOCO_DEVICE=cuda .venv/bin/diloco run job.yaml --island-device 3=cpu   island 3 on the CPU
  .venv/bin/diloco export runs/local-demo -o model.safetensors   the trained weights

the run folder (--workdir, default runs/NAME):
  syncer/ (checkpoints: the weights), logs/, summary.json, loss.png, run.json. Run the same
  command again after Ctrl-C (or a closed terminal) and it resumes from the last checkpoint;
  the summary then covers the whole job (every session's time and bytes).

environment:
  DILOCO_DEVICE=cuda        every learner on this machine's GPU (default cpu; docs/learner.md)
  DILOCO_SYNCER_CPUS=6-7    the syncer on these CPUs, the learners on the rest

exit codes:
  0    the job finished (stopAfter reached)
  1    the run failed (the syncer died, every learner exited): the log's tail is printed
  2    bad input: the file, field or option is named; nothing was started
  129  the terminal closed (SIGHUP): every process was stopped
  130  interrupted (Ctrl-C or SIGTERM): every process was stopped
  (a `diloco run` killed outright takes its processes with it: they die with it)"""

CHECK_DESCRIPTION = textwrap.fill(
    "Check a DiLoCoJob before running it: the file is a DiLoCoJob (or its spec) and its fields "
    "are valid; the data source is read as the learners will (files read and skipped, token "
    "counts against data.evalTokens and one round's need); the memory of a learner's step and "
    "of the syncer's evaluation against this machine (or the pods' limits); a model.entrypoint "
    "is called once. Warns on no stop condition and a warm-up longer than the run.",
    WIDTH,
)
CHECK_EPILOG = """examples:
  .venv/bin/diloco check examples/local.yaml
  .venv/bin/diloco check examples/gpt-on-my-text/job.yaml --cluster

exit codes:
  0    the job can run (warnings, if any, are printed)
  2    it cannot: each problem is printed naming the file and the field"""

SAMPLE_DESCRIPTION = textwrap.fill(
    "Generate text from a trained built-in model (model.preset): the newest checkpoint of a run "
    "folder, or a file of `diloco export`. The model's shape and tokenizer come from the job "
    "(the run folder's spec.json, or the export's metadata); each token is drawn from the top-k "
    "of softmax(logits / temperature), greedy at temperature 0. The text goes to stdout, a "
    "header line to stderr; the same seed gives the same text.",
    WIDTH,
)
SAMPLE_EPILOG = """examples:
  .venv/bin/diloco sample runs/local-demo
  .venv/bin/diloco sample runs/local-demo --prompt 'def main(' --tokens 300 --seed 7
  .venv/bin/diloco sample model.safetensors --temperature 0     greedy
  .venv/bin/diloco sample exported/                             a folder of diloco export --job

a subword tokenizer (data.tokenizer) is read from MODEL.tokenizer.json beside an export
(diloco export --config JOB writes it), else data.tokenizer.path, else trained again on the
corpus (type bpe: data.source must be readable here).

exit codes:
  0    the text was written
  2    bad input: no weights in the folder, a model.entrypoint (your own model: sample it with
       your code), a tokenizer that cannot be found, a bad option; the message names it"""

SUBMIT_DESCRIPTION = textwrap.fill(
    "Submit a DiLoCoJob to the cluster of kubectl's context: the job is checked as `diloco check "
    "--cluster` checks it (refused: exit 2, nothing created), its images moved from the "
    "placeholder registry to --registry, the text of --data put into the ConfigMap its pods "
    "mount, and the job applied; then it prints how to watch it and fetch the model.",
    WIDTH,
)
SUBMIT_EPILOG = """examples:
  .venv/bin/diloco submit examples/gpt-on-my-text/job.yaml --registry $REGISTRY --data DIR
  .venv/bin/diloco export --job gpt-on-my-text     waits, copies the model into gpt-on-my-text/
  .venv/bin/diloco sample gpt-on-my-text/

exit codes:
  0    applied
  1    kubectl failed (its message is printed)
  2    refused: the file, field or option is named; nothing was created"""


def missing_trainer_modules() -> list[str]:
    """The [trainer] extra's modules that cannot be imported here."""
    return [name for name in TRAINER_IMPORTS if importlib.util.find_spec(name) is None]


def require_trainer(command: str) -> bool:
    """True when the [trainer] extra is installed; else say so on stderr (naming what is
    missing and how to install it) and return False."""
    missing = missing_trainer_modules()
    if not missing:
        return True
    print(
        f"diloco {command} needs the [trainer] extra ({', '.join(missing)} missing): "
        f"{INSTALL_TRAINER}",
        file=sys.stderr,
    )
    return False


def require_local(command: str, *, plot: bool = False) -> bool:
    """True when the [local] extra's modules `command` needs are installed (matplotlib only
    with `plot`); else say so on stderr in one line (naming what is missing and how to install
    it) and return False."""
    needed = LOCAL_IMPORTS + (PLOT_IMPORTS if plot else ())
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if not missing:
        return True
    print(
        f"diloco {command} needs the [local] extra ({', '.join(missing)} missing): {INSTALL_LOCAL}",
        file=sys.stderr,
    )
    return False


def described(what: str) -> str:
    """A subcommand description, wrapped like the epilog."""
    return textwrap.fill(
        f"{what} It takes no options: it reads the environment below (and the files it names).",
        WIDTH,
    )
