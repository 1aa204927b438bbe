"""The job `diloco run` runs: the built-in demo's spec, a job file read and checked before anything
starts (check/), and the commands it prints made runnable from this shell."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.check import Report, check_job, load_job_file
from diloco_trainer.check.command import print_report

# The built-in job when no CONFIG is given: the spec of examples/local.yaml (keep them in step; a
# test checks they agree). Finishes in about two minutes on two CPU cores.
DEFAULT_JOB_NAME = "local-demo"
DEFAULT_SPEC: dict[str, Any] = {
    "image": "ghcr.io/diloco-operator/diloco-trainer:0.1.0",
    "model": {"preset": "gpt-tiny", "seed": 0},
    "data": {"source": "builtin:stdlib-text", "evalTokens": 8192, "seed": 0},
    "islands": {
        "count": 3,
        "replicas": 1,
        "resources": {
            "requests": {"cpu": "1", "memory": "1Gi"},
            "limits": {"cpu": "1", "memory": "2Gi"},
        },
    },
    "inner": {
        "optimizer": "adamw",
        "lr": 3.0e-3,
        "weightDecay": 0.1,
        "warmupSteps": 20,
        "steps": 50,
        "batchSize": 8,
        "seqLen": 64,
        "gradClip": 1.0,
    },
    "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "sync": {
        "quorum": 2,
        "graceSeconds": "auto",
        "fragments": 2,
        "overlapSteps": 5,
        "compression": "int8",
        "pullCompression": "auto",
        "merge": "tokens",
        "maxStaleness": "auto",
        "mixAlpha": 0.0,
        "errorFeedback": False,
        "heartbeatTimeoutSeconds": 30,
    },
    "stopAfter": {"outerSteps": 20},
    "syncer": {
        "port": 8470,
        "checkpoint": {"everyOuterSteps": 5, "keep": 2},
        "evalEveryOuterSteps": 1,
    },
    "ttlSecondsAfterFinished": 3600,
}


def load_job(config: str | None) -> tuple[str, JobSpec]:
    """The job name and spec from CONFIG (a DiLoCoJob manifest or bare spec, its relative paths
    taken from its folder: check/document.py), or the default."""
    if config is None:
        return DEFAULT_JOB_NAME, parse_spec(DEFAULT_SPEC)
    job = load_job_file(config)
    return job.name, job.spec


def check_before_start(spec: JobSpec, config: str | None) -> Report:
    """`diloco check`'s checks on this machine, printed (what was read from the corpus, the
    token counts, warnings, errors; --quiet leaves the progress out, not these few lines);
    nothing may start unless report.ok."""
    report = check_job(spec)
    where = config or "the built-in demo job"
    print_report(report, prog="diloco run", where=where, out=sys.stdout, err=sys.stderr)
    sys.stdout.flush()
    return report


def runnable(note: str) -> str:
    """`note`'s `diloco` commands as this shell can run them: when `diloco` is not on PATH (a
    virtual environment that is not activated), the console script beside this Python, relative
    to the current directory when it is below it (`.venv/bin/diloco`)."""
    script = Path(sys.executable).parent / "diloco"
    if shutil.which("diloco") is not None or not script.exists():
        return note
    try:
        shown = os.path.relpath(script)
    except ValueError:
        shown = str(script)
    if shown.startswith(".."):
        shown = str(script)
    return note.replace("  diloco ", f"  {shown} ")
