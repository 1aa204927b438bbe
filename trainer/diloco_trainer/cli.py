"""The `diloco` console script.

Subcommands import their modules lazily: the operator image has no torch, and `diloco operator`
must start without it. The trainer's own commands are here; other packages of the distribution
add theirs through the entry-point group COMMANDS (the operator: `diloco operator`, `diloco crd`,
in diloco_operator/cli.py), so the trainer imports nothing of them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from diloco_trainer import __version__
from diloco_trainer.cli_help import (
    CHECK_DESCRIPTION,
    CHECK_EPILOG,
    LEARNER_EPILOG,
    RUN_DESCRIPTION,
    RUN_EPILOG,
    SAMPLE_DESCRIPTION,
    SAMPLE_EPILOG,
    SUBMIT_DESCRIPTION,
    SUBMIT_EPILOG,
    SYNCER_EPILOG,
    described,
    require_local,
    require_trainer,
)

# The exit code of a command whose extra is not installed (as for a bad config).
MISSING_EXTRA = 2
# Entry points of this group add subcommands: each names a function that takes the
# subparsers of `diloco` and adds its own (pyproject.toml's [project.entry-points]).
COMMANDS = "diloco.commands"


def _cmd_run(args: argparse.Namespace) -> int:
    if not require_trainer("run") or not require_local("run", plot=bool(args.plot)):
        return MISSING_EXTRA
    from diloco_trainer.local.run import main as run_main

    return run_main(args)


def _cmd_check(args: argparse.Namespace) -> int:
    if not require_trainer("check"):
        return MISSING_EXTRA
    from diloco_trainer.check.command import main as check_main

    return check_main(args)


def _cmd_learner(args: argparse.Namespace) -> int:
    if not require_trainer("learner"):
        return MISSING_EXTRA
    from diloco_trainer.learner.loop import main as learner_main

    return learner_main(args)


def _cmd_syncer(args: argparse.Namespace) -> int:
    if not require_trainer("syncer"):
        return MISSING_EXTRA
    from diloco_trainer.syncer.service import main as syncer_main

    return syncer_main(args)


def _cmd_export(args: argparse.Namespace) -> int:
    if args.job is not None:  # from the cluster: kubectl, no torch needed here
        from diloco_trainer.cluster_path import export_job, kubectl_missing

        if args.source is not None:
            print("diloco export: --job NAME takes no SOURCE", file=sys.stderr)
            return MISSING_EXTRA
        return MISSING_EXTRA if kubectl_missing("diloco export") else export_job(args)
    if args.source is None or args.output is None:
        print("diloco export: SOURCE and -o FILE are needed (or --job NAME)", file=sys.stderr)
        return MISSING_EXTRA
    if not require_trainer("export"):
        return MISSING_EXTRA
    from diloco_trainer.export import main as export_main

    return export_main(args)


def _cmd_sample(args: argparse.Namespace) -> int:
    if not require_trainer("sample"):
        return MISSING_EXTRA
    from diloco_trainer.sample import main as sample_main

    return sample_main(args)


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`diloco run`."""
    run = sub.add_parser(
        "run",
        help="run a job locally: a syncer and M islands as processes on loopback",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "config",
        nargs="?",
        default=None,
        help="DiLoCoJob manifest or its spec (YAML); relative paths in it are taken from its "
        "folder (default: the built-in demo, examples/local.yaml)",
    )
    run.add_argument(
        "--summary",
        metavar="FILE",
        help="write the JSON summary to FILE (default: DIR/summary.json)",
    )
    run.add_argument(
        "--plot",
        metavar="FILE",
        help="write the PNG of eval loss to FILE (default: DIR/loss.png, with matplotlib)",
    )
    run.add_argument(
        "--workdir",
        metavar="DIR",
        help="the run folder: weights (the syncer's checkpoints), logs, summary, plot (default: "
        "runs/NAME, NAME the job's metadata.name); a folder with checkpoints is resumed",
    )
    run.add_argument(
        "--fresh",
        action="store_true",
        help="start over: move an existing run folder aside (DIR.previous-DATE) instead of "
        "resuming from it",
    )
    run.add_argument(
        "--slow-island",
        action="append",
        default=[],
        metavar="I:FACTOR",
        help="slow island I down by FACTOR (e.g. 1:3), to watch decoupling",
    )
    run.add_argument(
        "--island-device",
        action="append",
        default=[],
        metavar="I=DEVICE",
        help="run island I on DEVICE (cpu, cuda, cuda:N or auto) instead of DILOCO_DEVICE, "
        "e.g. 3=cpu: a CPU island beside GPU islands (repeat for more islands)",
    )
    run.add_argument(
        "--quiet", action="store_true", help="no progress (the check's lines and summary stay)"
    )
    run.set_defaults(func=_cmd_run)


def _add_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`diloco check`."""
    check = sub.add_parser(
        "check",
        help="check a job before running it: the manifest, its data, memory and model",
        description=CHECK_DESCRIPTION,
        epilog=CHECK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("config", help="DiLoCoJob manifest or its spec (YAML)")
    check.add_argument(
        "--cluster",
        action="store_true",
        help="compare memory with the pods' resources.limits instead of this machine; a "
        "data.source that is a path in the pods is not read here",
    )
    check.add_argument(
        "--data",
        metavar="DIR",
        help="read this local copy of the job's data instead of data.source",
    )
    check.set_defaults(func=_cmd_check)


def _add_processes(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`diloco learner` and `diloco syncer` (configured by their environment)."""
    learner = sub.add_parser(
        "learner",
        help="one learner rank of one island (configured by its environment: see its --help)",
        description=described("One learner rank of one island."),
        epilog=LEARNER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    learner.set_defaults(func=_cmd_learner)

    syncer = sub.add_parser(
        "syncer",
        help="the syncer service (configured by its environment: see its --help)",
        description=described("The syncer of one job."),
        epilog=SYNCER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    syncer.set_defaults(func=_cmd_syncer)


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`diloco export`."""
    export = sub.add_parser(
        "export", help="write a job's global weights as one safetensors file (plain torch loads it)"
    )
    export.add_argument(
        "source",
        nargs="?",
        help="a run folder of diloco run (runs/NAME), a syncer state dir, its checkpoints/ dir or "
        "one ckpt-* dir; or a running syncer's URL (http[s]://HOST:PORT). The file's metadata "
        "records the preset, seqLen and tokenizer (from the run folder's spec.json or --config)",
    )
    export.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="file to write (with --job: the folder to copy the model into, default NAME/)",
    )
    export.add_argument(
        "--job",
        metavar="NAME",
        help="fetch the model of DiLoCoJob NAME from the cluster (kubectl's context): exported in "
        "its syncer pod with the job's spec, copied into -o DIR (default NAME/), which diloco "
        "sample reads",
    )
    export.add_argument("-n", "--namespace", help="with --job: the job's namespace")
    export.add_argument(
        "--wait",
        default="1h",
        metavar="DURATION",
        help="with --job: wait this long for the job to succeed (kubectl wait's --timeout; 0s: "
        "do not wait, export the newest checkpoint now; default 1h)",
    )
    export.add_argument(
        "--token-file", metavar="FILE", help="a URL's bearer token (default $DILOCO_TOKEN_FILE)"
    )
    export.add_argument("--ca-file", metavar="FILE", help="CA to verify an https syncer with")
    export.add_argument(
        "--config",
        metavar="JOB",
        help="the job's manifest: also write its subword tokenizer as OUTPUT.tokenizer.json",
    )
    export.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="float32",
        help="floating-point type of the weights written (default float32)",
    )
    export.set_defaults(func=_cmd_export)


def _cmd_submit(args: argparse.Namespace) -> int:
    if not require_trainer("submit"):
        return MISSING_EXTRA
    from diloco_trainer.cluster_path import kubectl_missing, submit

    return MISSING_EXTRA if kubectl_missing("diloco submit") else submit(args)


def _add_submit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`diloco submit`."""
    submit = sub.add_parser(
        "submit",
        help="check a DiLoCoJob, hand its text to the pods and apply it to the cluster (kubectl)",
        description=SUBMIT_DESCRIPTION,
        epilog=SUBMIT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    submit.add_argument("config", help="DiLoCoJob manifest (YAML)")
    submit.add_argument(
        "--registry",
        metavar="REGISTRY",
        help="where make push-images pushed the images: replaces the placeholder "
        "ghcr.io/diloco-operator in the manifest's images",
    )
    submit.add_argument(
        "--data",
        metavar="DIR",
        help="your text: checked here, and put (its files) into the one ConfigMap the job's pods "
        "mount (created or replaced)",
    )
    submit.add_argument("-n", "--namespace", help="the namespace (default: kubectl's context)")
    submit.set_defaults(func=_cmd_submit)


def _add_sample(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`diloco sample`."""
    sample = sub.add_parser(
        "sample",
        help="generate text from a trained built-in model (a run folder or an export)",
        description=SAMPLE_DESCRIPTION,
        epilog=SAMPLE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sample.add_argument(
        "source",
        help="a run folder of diloco run (runs/NAME), a syncer state dir or ckpt-* dir, or an "
        "export file of diloco export (MODEL.safetensors) or a folder holding one",
    )
    sample.add_argument(
        "--prompt",
        metavar="TEXT",
        help="text to continue (default: the start of a document, a blank line)",
    )
    sample.add_argument(
        "--tokens", type=int, default=200, metavar="N", help="tokens to generate (default 200)"
    )
    sample.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        metavar="T",
        help="softmax temperature; 0 picks the most likely token each time (greedy; default 0.8)",
    )
    sample.add_argument(
        "--top-k",
        type=int,
        default=40,
        metavar="K",
        help="draw only among the K most likely tokens; 0: among all (default 40)",
    )
    sample.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of the draws (default 0)"
    )
    sample.add_argument(
        "--device", default="cpu", help="torch device to run the model on (default cpu)"
    )
    sample.set_defaults(func=_cmd_sample)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco", description="Decoupled DiLoCo training: local runs, pods and the operator."
    )
    parser.add_argument("--version", action="version", version=f"diloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for add in (_add_run, _add_check, _add_processes, _add_export, _add_sample, _add_submit):
        add(sub)
    for command in sorted(entry_points(group=COMMANDS), key=lambda e: e.name):
        command.load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
