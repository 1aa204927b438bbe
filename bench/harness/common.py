"""What every benchmark shares: machine facts, git revision, ratios, tables, the log, processes.

Every figure a benchmark reports is a ratio against a baseline measured in the same run, because
the machines these run on are shared and noisy; the absolute numbers are printed too, for context.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime as dt
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_trainer.local import Proc

from bench.harness.flags import add_shared_flags
from hack.localcluster import harness

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = BENCH_DIR.parent
# Every run appends its dated section to the log, one file a day (bench/log/README.md); the
# one-page summary, bench/RESULTS.md, is updated by hand from it.
LOG_DIR = BENCH_DIR / "log"

RESULTS_HEADER = """# Benchmark results of {day} (log)

Appended by the scripts in `bench/` (see bench/README.md and bench/log/README.md): one section per
run, newest last, each with the command, the git revision and the machine it ran on. Every figure
is a ratio against a baseline measured in the same run; absolute numbers are given for context
only. The load average says how contended the (shared) machine was while the run took place. The
latest figures of each product benchmark are copied by hand into bench/RESULTS.md.
"""


def log_path(day: dt.date | None = None) -> Path:
    """The log file a run started on `day` (default: today, UTC) appends to: bench/log/DAY.md."""
    day = day or dt.datetime.now(dt.UTC).date()
    return LOG_DIR / f"{day.isoformat()}.md"


@dataclass(frozen=True)
class Machine:
    """The facts about the machine that a reader needs to judge a figure."""

    cpu_model: str
    cores: int
    usable_cores: int
    ram_gib: float
    torch: str
    python: str
    kernel: str

    def describe(self) -> str:
        """One line for the run's log section."""
        return (
            f"{self.cpu_model}, {self.usable_cores} usable of {self.cores} cores, "
            f"{self.ram_gib:.1f} GiB RAM, torch {self.torch}, Python {self.python}, "
            f"Linux {self.kernel}"
        )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def machine_info() -> Machine:
    """Cores, RAM, CPU model and library versions of this machine."""
    import torch

    cores = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cores
    return Machine(
        cpu_model=_cpu_model(),
        cores=cores,
        usable_cores=usable,
        ram_gib=_ram_gib(),
        torch=torch.__version__,
        python=platform.python_version(),
        kernel=platform.release(),
    )


CODE_PATHS = ("trainer", "operator", "bench", "crds", "hack")


def git_revision(repo: Path = REPO_ROOT) -> str:
    """Short commit hash, with '+dirty' when tracked code the benchmarks run differs from it."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


# What a recorded command says in place of a path outside the repository (command_line): the
# run's scratch folder, the file a section went to, anything else under a scratch folder.
RUN_DIR = "RUN_DIR"
RESULTS_FILE = "RESULTS_FILE"


def portable_args(args: Sequence[str], *, repo: Path = REPO_ROOT) -> list[str]:
    """`args` as a log may record them: a path inside `repo` relative to it, the value of
    --workdir outside it RUN_DIR, of --results RESULTS_FILE, any other absolute path outside it
    RUN_DIR/<its name>.

    Why: a log is read on other machines, and the project speaks of itself only (a scratch
    folder of the machine that ran it names nothing a reader has).

    >>> portable_args(["--workdir", "/tmp/a/b", "--seeds", "0", "--results=/x/r.md"],
    ...               repo=Path("/r"))
    ['--workdir', 'RUN_DIR', '--seeds', '0', '--results=RESULTS_FILE']
    >>> portable_args(["--results", "/r/bench/log/x.md", "--runs", "/tmp/w/s0", "/tmp/w/s1"],
    ...               repo=Path("/r"))
    ['--results', 'bench/log/x.md', '--runs', 'RUN_DIR/s0', 'RUN_DIR/s1']
    """
    out: list[str] = []
    option = ""
    for arg in args:
        name, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if arg.startswith("--") and not eq:
            option = arg
            out.append(arg)
            continue
        out.append(f"{name}={_portable(value, name, repo)}" if eq else _portable(arg, option, repo))
    return out


def _portable(value: str, option: str, repo: Path) -> str:
    if not value.startswith("/"):
        return value
    path = Path(value)
    if path == repo or repo in path.parents:
        return str(path.relative_to(repo))
    if option == "--workdir":
        return RUN_DIR
    if option == "--results":
        return RESULTS_FILE
    return f"{RUN_DIR}/{path.name}"


def command_line() -> str:
    """The command that reproduces this run, its paths as portable_args gives them."""
    script = Path(sys.argv[0]).resolve()
    try:  # bench/studies/ablation.py -> bench.studies.ablation
        module = ".".join(script.relative_to(REPO_ROOT).with_suffix("").parts)
    except ValueError:
        module = f"bench.{script.stem}"
    return shlex.join(["python", "-m", module, *portable_args(sys.argv[1:])])


def ratio(value: float, baseline: float) -> float:
    """value / baseline; a zero or missing baseline has no ratio (NaN), never a crash."""
    if baseline == 0 or baseline != baseline:
        return float("nan")
    return value / baseline


def fmt_ratio(r: float, digits: int = 3) -> str:
    """A ratio as '0.987x' ('n/a' when undefined)."""
    return "n/a" if r != r else f"{r:.{digits}f}x"


def fmt_bytes(n: float) -> str:
    """A byte count in binary units: '1.50 MiB'."""
    if n != n:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_pct(x: float, digits: int = 1) -> str:
    """A fraction as a percentage: 0.953 -> '95.3%'."""
    return "n/a" if x != x else f"{100 * x:.{digits}f}%"


def verdict(met: bool) -> str:
    """How a target reads in a table."""
    return "met" if met else "MISSED"


@dataclass
class Table:
    """A result table: printed with rich on the terminal, written as Markdown to the log."""

    title: str
    columns: Sequence[str]
    rows: list[Sequence[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.title!r}: {len(cells)} cells for {len(self.columns)}")
        self.rows.append([str(c) for c in cells])

    def to_markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        rule = "|" + "|".join("---" for _ in self.columns) + "|"
        body = ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join([f"**{self.title}**", "", head, rule, *body])

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table as RichTable

        t = RichTable(title=self.title)
        for c in self.columns:
            t.add_column(c)
        for r in self.rows:
            t.add_row(*r)
        # Wide enough for the tables even when stdout is a pipe (rich would assume 80 columns).
        Console(width=max(140, shutil.get_terminal_size().columns)).print(t)


class LoadMonitor:
    """Samples the 1-minute load average during a run, to say how contended the machine was.

    It also notes the git revision when the run starts (the code that ran, even if the tree
    moves on while a long benchmark is running).
    """

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="load-monitor")
        self.started = time.time()
        self.ended = self.started
        self.revision = "unknown"

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> LoadMonitor:
        self.started = time.time()
        self.revision = git_revision()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.ended = time.time()

    def describe(self) -> str:
        if not self.samples:
            return "load average not sampled"
        mean = sum(self.samples) / len(self.samples)
        return f"1-min load average during the run: mean {mean:.1f}, max {max(self.samples):.1f}"


@dataclass
class Report:
    """Everything one benchmark run appends to the log (bench/log/DAY.md)."""

    script: str
    summary: str
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)

    def to_markdown(
        self, *, command: str, revision: str, machine: Machine, load: str, base: Path = BENCH_DIR
    ) -> str:
        when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        parts = [
            f"## {self.script} — {when}",
            "",
            self.summary,
            "",
            f"- Command: `{command}`",
            f"- Revision: `{revision}`",
            f"- Machine: {machine.describe()}",
            f"- Load: {load}",
            "",
        ]
        for table in self.tables:
            parts += [table.to_markdown(), ""]
        for plot in self.plots:
            rel = os.path.relpath(plot, base)
            parts += [f"![{plot.stem}]({rel})", ""]
        if self.notes:
            parts += ["Notes:", ""]
            parts += [f"- {n}" for n in self.notes]
            parts.append("")
        return "\n".join(parts)


def append_results(
    report: Report, *, load: LoadMonitor, path: Path | None = None, command: str | None = None
) -> str:
    """Print the report's tables and append its section (never replacing earlier runs) to `path`
    (default: today's log file, bench/log/DAY.md)."""
    path = path or log_path()
    for table in report.tables:
        table.print()
    for note in report.notes:
        print(f"note: {note}")
    text = report.to_markdown(
        command=command or command_line(),
        revision=load.revision,
        machine=machine_info(),
        load=load.describe(),
        base=path.parent,
    )
    if not path.exists() or not path.read_text().strip():
        path.parent.mkdir(parents=True, exist_ok=True)
        day = dt.datetime.now(dt.UTC).date().isoformat()
        path.write_text(RESULTS_HEADER.format(day=day) + "\n")
    with path.open("a") as f:
        f.write("\n" + text)
    print(f"appended to {path}")
    return text


def publish(report: Report, args: argparse.Namespace, load: LoadMonitor) -> int:
    """The end of a benchmark's main: its tables, notes and plots printed, and with recording
    on (no --no-record) its section appended to --results (default: today's log file).
    Returns the exit code."""
    if not args.no_record:
        append_results(report, load=load, path=args.results)
        return 0
    for table in report.tables:
        table.print()
    for note in report.notes:
        print(f"note: {note}")
    for plot in report.plots:
        print(f"plot: {plot}")
    return 0


def plot_file(args: argparse.Namespace, name: str) -> Path:
    """Where a run's plot goes: plots/ beside the results file (bench/log/plots/ by default), or a
    temp file with --no-record (so a trial run never overwrites a recorded plot)."""
    if args.no_record:
        import tempfile

        return Path(tempfile.gettempdir()) / f"bench-{name}.png"
    # One file per run, so an earlier run's section keeps showing its own plot.
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M")
    return Path(args.results).resolve().parent / "plots" / f"{name}-{stamp}.png"


def training_spec(
    args: argparse.Namespace,
    *,
    sync: Mapping[str, Any],
    syncer: Mapping[str, Any],
    eval_tokens: int,
) -> Any:
    """The tiny job the throughput benchmarks train (bandwidth, decoupling, goodput): the same
    model, data, islands and inner loop; each benchmark says how it syncs and evaluates."""
    from diloco_trainer.api.spec import parse_spec

    return parse_spec(
        {
            "model": {"preset": args.preset, "seed": 0},
            "data": {"evalTokens": eval_tokens},
            "islands": {"count": args.islands},
            "inner": {
                "lr": 3e-3,
                "warmupSteps": 10,
                "steps": args.inner_steps,
                "batchSize": args.batch_size,
                "seqLen": args.seq_len,
            },
            "sync": dict(sync),
            "syncer": dict(syncer),
        }
    )


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def base_parser(description: str, **shared: Any) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark has, and the shared flags of
    bench/harness/flags.py named by `shared` (flag name -> this benchmark's default)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--results",
        type=Path,
        default=log_path(),
        help="Markdown file the run's section is appended to (default: today's log file, "
        "bench/log/YYYY-MM-DD.md; bench/RESULTS.md is updated by hand from the log)",
    )
    p.add_argument("--no-record", action="store_true", help="print only; do not append")
    p.add_argument(
        "--workdir", type=Path, default=None, help="logs and scratch files (default: a temp dir)"
    )
    add_shared_flags(p, **shared)
    return p


@contextlib.contextmanager
def workdir(path: Path | None, prefix: str) -> Iterator[Path]:
    """The given directory (kept), or a temporary one removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix=f"bench-{prefix}-") as tmp:
        yield Path(tmp)


# --- processes ---------------------------------------------------------------------------------

_LIVE: list[Proc] = []


def _kill_all() -> None:
    for proc in list(_LIVE):
        proc.kill()


atexit.register(_kill_all)


def _on_signal(signum: int, _frame: object) -> None:
    _kill_all()
    sys.exit(128 + signum)


def install_signal_cleanup() -> None:
    """Kill every child started by start_module on Ctrl-C or SIGTERM too (atexit covers exits)."""
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def start_module(
    name: str,
    module: str,
    args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    log_file: Path,
    prefix: Sequence[str] = (),
) -> Proc:
    """Start `python -m MODULE ARGS` in its own process group, output to `log_file`.

    `prefix` goes before the interpreter (e.g. `ip netns exec NS`). Every process started here
    is killed (whole group) when the benchmark exits, however it exits.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # The bench package is imported by module path from the repository root.
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as out:
        popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *args],
            env=full_env,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    proc = Proc(name, popen, log_file)
    _LIVE.append(proc)
    return proc


def track(proc: Proc) -> Proc:
    """Have a process started elsewhere (local.launch) killed when the benchmark exits."""
    _LIVE.append(proc)
    return proc


def wait_all(procs: Sequence[Proc], timeout: float) -> None:
    """Wait for every process to exit 0 within `timeout` seconds; else kill all and raise."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            left = max(0.1, deadline - time.monotonic())
            code = proc.wait(left)
            if code != 0:
                raise RuntimeError(
                    f"{proc.name} exited with {code}; log tail:\n{proc.log_text()[-3000:]}"
                )
    except subprocess.TimeoutExpired:
        raise TimeoutError(
            f"processes still running after {timeout:.0f}s: "
            + ", ".join(p.name for p in procs if p.alive)
        ) from None
    finally:
        for proc in procs:
            proc.kill()


def poll_until(
    predicate: Callable[[], bool], *, timeout: float, interval: float = 0.2, what: str
) -> None:
    """Poll `predicate()` until true or raise TimeoutError naming `what` (the harness's
    poll_until, which the cluster tests use too)."""
    harness.poll_until(predicate, timeout=timeout, interval=interval, what=what)


def ring_allreduce_bytes(payload_bytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of `payload_bytes`: 2(N-1)/N of the payload."""
    if world_size <= 1:
        return 0.0
    return 2 * (world_size - 1) / world_size * payload_bytes
