"""The `diloco check` command, and the report printed by it and by `diloco run`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from diloco_trainer.api.spec import ConfigError
from diloco_trainer.check.checks import Report, check_job
from diloco_trainer.check.document import load_job_file

BAD_INPUT = 2  # the exit code of every refusal, as for `diloco run`


def print_report(
    report: Report, *, prog: str, where: str, out: TextIO, err: TextIO, verbose: bool = True
) -> None:
    """Errors first on `err` (each naming the file, then the field), then what was read and the
    warnings on `out`."""
    for problem in report.errors:
        print(f"{prog}: {where}: {problem}", file=err)
    if verbose:
        for line in report.info:
            print(f"  {line}", file=out)
    for warning in report.warnings:
        print(f"warning: {warning}", file=out)


def main(args: argparse.Namespace) -> int:
    """`diloco check CONFIG`: 0 when the job can run (warnings or not), 2 when it cannot."""
    prog = "diloco check"
    try:
        job = load_job_file(args.config)
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return BAD_INPUT
    if args.data is not None:
        job.spec.data.source = str(Path(args.data).resolve())
    where = str(args.config)
    target = "a cluster's pods" if args.cluster else "this machine (as diloco run)"
    print(f"{prog}: {where}: job {job.name}, checked for {target}")
    report = check_job(job.spec, cluster=args.cluster)
    print_report(report, prog=prog, where=where, out=sys.stdout, err=sys.stderr)
    if not report.ok:
        return BAD_INPUT
    print(
        f"{prog}: {where}: ok"
        + (f" ({len(report.warnings)} warning(s))" if report.warnings else "")
    )
    return 0
