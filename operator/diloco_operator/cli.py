"""`diloco operator` and `diloco crd`: the operator's subcommands of the `diloco` console script.

The trainer's CLI imports nothing of the operator: it adds every command an installed package
declares in the entry-point group `diloco.commands` (pyproject.toml), and these two are the
operator's. Each is a function that adds its parser to `diloco`'s subcommands; the parser's
`func` imports what it runs only when run (the trainer image has no kopf, and `diloco --help`
must not need it).
"""

from __future__ import annotations

import argparse
import sys
from typing import TypeAlias

# The exit code of a command whose extra is not installed (as the trainer's commands do).
MISSING_EXTRA = 2

# What `add_subparsers` returns (argparse's own name for it; generic only to type checkers).
SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_operator_command(sub: SubParsers) -> None:
    """`diloco operator`: the Kubernetes operator (the chart passes these flags)."""
    op = sub.add_parser("operator", help="run the Kubernetes operator (wraps kopf run)")
    op.add_argument("--namespace", action="append", default=[], help="watch only these")
    op.add_argument("--standalone", action="store_true", help="no peering (single replica)")
    op.add_argument("--health-port", type=int, default=8080, help="liveness/readiness port")
    op.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port")
    op.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    try:
        from diloco_operator.main import main as operator_main
    except ImportError as err:
        print(
            f"diloco operator needs the [operator] extra ({err.name} is missing): "
            "pip install 'diloco-operator[operator]'",
            file=sys.stderr,
        )
        return MISSING_EXTRA
    return operator_main(args)


def add_crd_command(sub: SubParsers) -> None:
    """`diloco crd`: the DiLoCoJob CRD, rendered from the API models (`make crd`)."""
    crd = sub.add_parser("crd", help="print the DiLoCoJob CRD generated from the API models")
    crd.add_argument("--output", "-o", metavar="FILE", help="write to FILE instead of stdout")
    crd.set_defaults(func=run_crd)


def run_crd(args: argparse.Namespace) -> int:
    from diloco_operator.crd import main as crd_main

    return crd_main(args)
