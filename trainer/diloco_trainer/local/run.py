"""`diloco run [CONFIG]`: a whole job as local processes on loopback.

One syncer and islands.count × islands.replicas learner ranks, started with exactly the commands and
environment variables the operator gives pods (launch.py, contract.py), so a local run exercises the
cluster code path. The launcher only watches: it polls the syncer's /v1/status, draws progress, and
at the end prints (and optionally writes) a summary and a loss plot.

Failures: a learner that exits early is reported and the run goes on without it. An island whose
processes have all exited is dropped at the syncer (the admin route, as the operator drops an
island whose pods fail), so the quorum stops waiting for it, whether it had joined or not; one
started again (LocalRun.start_island) is re-added. If every learner is gone, or the syncer dies,
the run stops with an error and the tail of the log. Ctrl-C (SIGINT) or SIGTERM stops
every child (SIGTERM to each process group, SIGKILL after a deadline) and exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.live import Live

from diloco_trainer.api.client import SyncerJsonClient
from diloco_trainer.api.contract import (
    DEVICE,
    RUN_PID,
    SYNCER_HOST,
    ContractError,
    island_name,
)
from diloco_trainer.api.documents import SyncerStatus
from diloco_trainer.api.protocol import STATE_ACTIVE, STATE_DROPPED, SyncerError
from diloco_trainer.api.spec import ConfigError, JobSpec
from diloco_trainer.check import Report
from diloco_trainer.local.cpu_plan import cpu_split, process_threads, syncer_cpus_wanted
from diloco_trainer.local.island_devices import (
    devices_to_check,
    island_device,
    parse_island_devices,
)
from diloco_trainer.local.job import (
    check_before_start,
    load_job,
    runnable,
)
from diloco_trainer.local.launch import (
    JobFiles,
    Proc,
    free_port,
    start_learner,
    start_syncer,
    wait_ready,
    write_job_files,
)
from diloco_trainer.local.progress import (
    PROGRESS_SECONDS,
    progress_key,
    progress_line,
    status_view,
    trained_tokens,
)
from diloco_trainer.local.run_folder import (
    PLOT_FILE,
    SUMMARY_FILE,
    SYNCER_DIR,
    Ledger,
    default_folder,
    has_checkpoints,
    move_aside,
)
from diloco_trainer.local.summary import make_summary, summary_table
from diloco_trainer.local.syncer_shards import SyncerShards, start_syncer_shards

POLL_SECONDS = 0.5
LEDGER_SECONDS = 5.0  # the run folder's run.json is brought up to date this often
LOOPBACK = "127.0.0.1"  # where the local syncer listens (DILOCO_SYNCER_HOST)
# One status request: tried for this long (the syncer may be restarting) before the watch loop
# looks at the children to tell whether the syncer died; one attempt is cut at the timeout.
STATUS_DEADLINE_SECONDS = 5.0
STATUS_TIMEOUT_SECONDS = 10.0
# After the syncer says finished, learners get this long to notice and exit on their own.
LEARNER_EXIT_SECONDS = 30.0
# Children get this long to exit after SIGTERM before their process groups are killed.
STOP_SECONDS = 10.0
# After SIGHUP (a closed terminal) each group gets this long before SIGKILL.
HANGUP_STOP_SECONDS = 1.5
# The syncer listens once it has built its model, read its data and evaluated the initial
# weights (or resumed a checkpoint): at gpt-125m on a loaded 2-core machine that took over 120 s.
# The same budget as the operator's startup probe (10 minutes); a syncer that exits before it is
# ready is reported at once, with its log, so the long budget only bounds a hang.
SYNCER_READY_SECONDS = 600.0


class RunError(RuntimeError):
    """The run cannot go on (the syncer died, every learner is gone); the message says why."""


def parse_slow_islands(values: Sequence[str], count: int) -> dict[int, float]:
    """`--slow-island I:FACTOR` options -> {island index: factor}; ValueError names the option."""
    out: dict[int, float] = {}
    for raw in values:
        index_s, sep, factor_s = raw.partition(":")
        try:
            if not sep:
                raise ValueError
            index, factor = int(index_s), float(factor_s)
        except ValueError:
            raise ValueError(f"--slow-island {raw!r}: expected I:FACTOR, e.g. 1:3") from None
        if not 0 <= index < count:
            raise ValueError(f"--slow-island {raw!r}: island must be in [0, {count})")
        if factor < 1:
            raise ValueError(f"--slow-island {raw!r}: FACTOR must be >= 1")
        out[index] = factor
    return out


def island_changes(
    alive: Mapping[str, Sequence[bool]], dropped: set[str]
) -> tuple[list[str], list[str]]:
    """(islands to drop, islands to re-add) at the syncer, from whether each process of each
    island is alive: drop an island none of whose processes is (it will not join or push again),
    re-add a dropped one that has a process again (it was started again)."""
    gone = sorted(i for i, procs in alive.items() if procs and not any(procs) and i not in dropped)
    back = sorted(i for i in dropped if any(alive.get(i, ())))
    return gone, back


@dataclass
class LocalRun:
    """The processes of one local job and the loop that watches them."""

    name: str
    spec: JobSpec
    workdir: Path
    slowdowns: dict[int, float]
    console: Console
    quiet: bool = False
    syncer: Proc | SyncerShards | None = None
    learners: list[Proc] = field(default_factory=list)
    dead: dict[str, int] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)  # islands this run dropped at the syncer
    url: str = ""
    files: JobFiles | None = None
    syncer_cpus: frozenset[int] | None = None  # DILOCO_SYNCER_CPUS (cpu_plan.py)
    # island index -> its device when not the job's (--island-device, island_devices.py)
    devices: dict[int, str] = field(default_factory=dict)
    earlier: Ledger = field(default_factory=Ledger)  # the job's earlier sessions (run_folder.py)
    last_status: SyncerStatus | None = None

    def __post_init__(self) -> None:
        self.earlier = Ledger.load(self.workdir)

    def save_ledger(self, started: float, status: SyncerStatus | None = None) -> None:
        """The earlier sessions plus this one so far, in the run folder."""
        status = status or self.last_status
        pushed, pulled = (status.bytes_in, status.bytes_out) if status else (0, 0)
        self.earlier.plus(time.monotonic() - started, pushed, pulled).save(self.workdir)

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    def start(self) -> None:
        """Start the syncer, wait until it is ready, then start every island."""
        self.start_syncer()
        for i in range(self.spec.islands.count):
            self.start_island(i)

    def _threads(self, role: str = "syncer", own: str | None = None) -> dict[str, str]:
        """A process's threads (a learner's sized by its `own` device), and its CPUs when the
        run splits them (cpu_plan.py); the run that owns it, so it dies with this process
        (launch.py); the syncer on loopback."""
        ranks = sum(self.spec.islands.replicas_of(i) for i in range(self.spec.islands.count))
        cpus = frozenset(os.sched_getaffinity(0))
        threads = process_threads(role, self._device(), ranks, cpus, self.syncer_cpus, own)
        owned = {RUN_PID: str(os.getpid())}
        if role == "syncer":
            owned[SYNCER_HOST] = LOOPBACK
        return {**threads, **owned}

    def _device(self) -> str:
        return os.environ.get(DEVICE) or "cpu"

    def _learner_env(self, index: int) -> dict[str, str]:
        """Threads, and DILOCO_DEVICE from this command's own environment (cpu when unset): e.g.
        DILOCO_DEVICE=cuda runs every local learner on this machine's GPU; an island named by
        --island-device on its own (e.g. 3=cpu: a CPU island beside GPU islands)."""
        device = island_device(index, self._device(), self.devices)
        return {**self._threads("learner", device), DEVICE: device}

    def start_syncer(self, port: int | None = None) -> Proc | SyncerShards:
        """Start (or restart, on the same state dir) the syncer and wait until it is ready."""
        if self.files is None:
            self.files = write_job_files(self.spec, self.workdir)
        if self.spec.syncer.shards > 1:  # one process per shard (local/syncer_shards.py)
            shards = start_syncer_shards(
                self.files,
                shards=self.spec.syncer.shards,
                state_dir=self.workdir / "syncer",
                job_name=self.name,
                log_dir=self.logs,
                extra_env=self._threads(),
                ready_timeout=SYNCER_READY_SECONDS,
            )
            self.syncer, self.url = shards, shards.url
            return shards
        port = port or free_port()
        self.url = f"http://{LOOPBACK}:{port}"
        self.syncer = start_syncer(
            self.files,
            port=port,
            state_dir=self.workdir / "syncer",
            job_name=self.name,
            log_file=self.logs / "syncer.log",
            extra_env=self._threads(),
        )
        wait_ready(self.url, self.files.token, SYNCER_READY_SECONDS, proc=self.syncer)
        return self.syncer

    def start_island(self, index: int) -> list[Proc]:
        """Start every rank of island `index` (again, after it died: it rejoins)."""
        assert self.files is not None, "start the syncer first"
        spec = self.spec
        island = island_name(spec.islands.name_prefix, index)
        master_port = free_port()
        procs = []
        replicas = spec.islands.replicas_of(index)
        for rank in range(replicas):
            proc = start_learner(
                self.files,
                syncer_url=self.url,
                island=island,
                island_index=spec.islands.shard_offset + index,
                log_file=self.logs / f"{island}-rank{rank}.log",
                rank=rank,
                world_size=replicas,
                master_port=master_port,
                slowdown=self.slowdowns.get(index, 1.0),
                job_name=self.name,
                extra_env=self._learner_env(index),
            )
            self.dead.pop(proc.name, None)
            self.learners = [p for p in self.learners if p.name != proc.name] + [proc]
            procs.append(proc)
        return procs

    def _check_children(self, finished: bool) -> bool:
        """Notes learners that exited; raises if the syncer did. True when every learner has
        exited (a failure unless the job finished: the caller re-reads the status to tell)."""
        assert self.syncer is not None
        if not self.syncer.alive:
            tail = "\n".join(self.syncer.log_text().splitlines()[-30:])
            error = self.syncer.error_line()
            raise RunError(
                f"the syncer exited with code {self.syncer.returncode}"
                + (f": {error}" if error else "")
                + f"\nlast lines of {self.syncer.log_file}:\n{tail}"
            )
        for proc in self.learners:
            if not proc.alive and proc.name not in self.dead:
                self.dead[proc.name] = proc.returncode or 0
                if not finished:
                    error = proc.error_line()
                    self.console.print(
                        f"learner {proc.name} exited with code {proc.returncode}"
                        + (f": {error}" if error else "")
                        + f"; going on without it (log: {proc.log_file})",
                        style="yellow",
                        markup=False,
                        highlight=False,
                        soft_wrap=True,
                    )
        return bool(self.learners) and len(self.dead) == len(self.learners)

    async def watch(self, started: float) -> SyncerStatus:
        """Poll the syncer until it reports the job finished; returns its last status."""
        assert self.files is not None
        status: SyncerStatus | None = None
        saved = printed = time.monotonic()
        base: int | None = None  # trained tokens at this session's first status
        since = started  # ... and when it was read: rates and ETAs are this session's
        last_key: tuple[int, int | None] | None = None
        live: Live | None = None
        if not self.quiet and self.console.is_terminal:
            live = Live(console=self.console, refresh_per_second=4, transient=False)
            live.start()
        try:
            async with SyncerJsonClient(
                self.url,
                self.files.token,
                retry_deadline=STATUS_DEADLINE_SECONDS,
                request_timeout=STATUS_TIMEOUT_SECONDS,
            ) as client:
                while True:
                    try:
                        status = await client.status()
                        self.last_status = status
                    except SyncerError as err:
                        # The syncer may be going down; _check_children tells.
                        self.console.print(f"[yellow]status: {err}[/yellow]")
                    if self._check_children(status is not None and status.finished):
                        status = await self._status_if_finished(client, status)
                        if status is None:
                            raise RunError(
                                f"every learner exited before the job finished; logs in {self.logs}"
                            )
                    if status is None:  # no answer yet: nothing to show
                        await asyncio.sleep(POLL_SECONDS)
                        continue
                    if not status.finished:
                        await self._sync_membership(client)
                    if time.monotonic() - saved > LEDGER_SECONDS:
                        saved = time.monotonic()
                        self.save_ledger(started)
                    if base is None:  # a resumed job's earlier tokens: not this session's
                        base, since = trained_tokens(status), time.monotonic()
                    if live is not None:
                        live.update(
                            status_view(
                                self.spec,
                                status,
                                started=since,
                                slowdowns=self.slowdowns,
                                dead=self.dead,
                                base=base,
                            )
                        )
                    elif not self.quiet and (
                        progress_key(status) != last_key
                        or time.monotonic() - printed >= PROGRESS_SECONDS
                    ):
                        last_key, printed = progress_key(status), time.monotonic()
                        elapsed = time.monotonic() - since
                        line = progress_line(status, elapsed, self.spec, base)
                        self.console.print(line, soft_wrap=True, highlight=False, markup=False)
                    if status.finished:
                        return status
                    await asyncio.sleep(POLL_SECONDS)
        finally:
            if live is not None:
                live.stop()

    async def _sync_membership(self, client: SyncerJsonClient) -> None:
        """Drop at the syncer every island whose processes have all exited, re-add one started
        again (island_changes). A failed call is tried again on the next pass."""
        procs: dict[str, list[Proc]] = {}
        for proc in self.learners:  # named ISLAND/rankR (start_island)
            procs.setdefault(proc.name.partition("/")[0], []).append(proc)
        alive = {island: [p.alive for p in group] for island, group in procs.items()}
        gone, back = island_changes(alive, self.dropped)
        try:
            if gone and (await client.status()).finished:
                return  # they exited because the job finished (learners leave on their own)
            for island in gone:
                codes = ", ".join(
                    str(c) for c in sorted({p.returncode or 0 for p in procs[island]})
                )
                reason = f"every process of the island exited (exit codes {codes})"
                await client.set_membership(island, STATE_DROPPED, reason)
                self.dropped.add(island)
                self.console.print(f"[yellow]dropped {island} at the syncer: {reason}[/yellow]")
            for island in back:
                await client.set_membership(island, STATE_ACTIVE, "started again")
                self.dropped.discard(island)
        except SyncerError as err:
            self.console.print(f"[yellow]membership: {err}[/yellow]")

    @staticmethod
    async def _status_if_finished(
        client: SyncerJsonClient, status: SyncerStatus | None
    ) -> SyncerStatus | None:
        """The status that says the job finished, asking again when `status` does not:
        learners exit as soon as they hear it did, possibly just after `status` was read. None
        when the job has not finished (or a syncer that is gone cannot say it has)."""
        if status is not None and status.finished:
            return status
        try:
            status = await client.status()
        except SyncerError:
            return None
        return status if status.finished else None

    def wait_learners(self, timeout: float) -> None:
        """Give learners `timeout` seconds to exit by themselves (they do once finished)."""
        deadline = time.monotonic() + timeout
        while any(p.alive for p in self.learners) and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop_all(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the learners (SIGTERM: they say goodbye to the syncer), then the syncer; SIGKILL
        each process group still there after `timeout` seconds."""
        for group in (self.learners, [self.syncer] if self.syncer else []):
            for p in group:
                p.terminate()
            deadline = time.monotonic() + timeout
            for p in group:
                while p.alive and time.monotonic() < deadline:
                    time.sleep(0.05)
            for p in group:
                p.kill()  # the group: stragglers too
                p.wait()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP (a closed terminal): the run stops every child."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


# The signals that stop a run (its children with it): Ctrl-C, `kill`, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def interrupted_code(err: KeyboardInterrupt) -> int:
    """130 after Ctrl-C or SIGTERM, 129 after SIGHUP (128 + the signal, as a shell reports)."""
    if isinstance(err, Interrupted) and err.signum == signal.SIGHUP:
        return 128 + signal.SIGHUP
    return 130


# After Ctrl-C, tasks still pending get this long to finish cancelling before the loop closes.
CANCEL_SECONDS = 5.0


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on `loop` (bounded by CANCEL_SECONDS) and close it."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=CANCEL_SECONDS))
    loop.close()


@dataclass(frozen=True)
class RunInput:
    """What `diloco run` read: the job, its deliberate stragglers (--slow-island), the islands
    put on another device (--island-device) and the syncer's CPUs (DILOCO_SYNCER_CPUS)."""

    name: str
    spec: JobSpec
    slowdowns: dict[int, float]
    devices: dict[int, str]
    syncer_cpus: frozenset[int] | None


def _read_job(args: argparse.Namespace) -> RunInput | None:
    """The run's input (RunInput); None, with the reason on stderr, when any of it is wrong."""
    try:
        name, spec = load_job(args.config)
        slowdowns = parse_slow_islands(args.slow_island, spec.islands.count)
        devices = parse_island_devices(args.island_device, spec.islands.count)
        syncer_cpus = syncer_cpus_wanted()
        if syncer_cpus is not None:  # refused here, before anything starts
            cpu_split(frozenset(os.sched_getaffinity(0)), "cpu", syncer_cpus)
    except (ConfigError, ValueError, ContractError) as err:
        print(f"diloco run: {err}", file=sys.stderr)
        return None
    return RunInput(name, spec, slowdowns, devices, syncer_cpus)


def island_device_problems(spec: JobSpec, devices: Mapping[int, str]) -> list[str]:
    """What a learner on each --island-device would refuse at start (the device is not on
    this machine, inner.precision fp16 off CUDA), each naming the option: checked before
    anything starts, as the job's own device is (check_before_start)."""
    from diloco_trainer.check.checks import local_device
    from diloco_trainer.check.start_rules import device_problems

    return [
        f"{named}: {problem}"
        for device, named in devices_to_check(local_device(), devices)
        for problem in device_problems(spec, device)
    ]


def _say(console: Console, text: str, style: str | None = None) -> None:
    """A line on the console as it is (no markup), unless the console is gone (a closed
    terminal after SIGHUP)."""
    with contextlib.suppress(OSError, ValueError):
        console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def resume_note(args: argparse.Namespace, workdir: Path) -> str:
    """How to go on from the last checkpoint: the same command (its run folder resumes)."""
    config = f" {args.config}" if args.config else ""
    folder = f" --workdir {shown(workdir)}" if args.workdir else ""
    return runnable(
        f"resume from the last checkpoint with:\n  diloco run{config}{folder}\n"
        f"(the run folder {shown(workdir)} keeps it; --fresh starts over)"
    )


def main(args: argparse.Namespace) -> int:
    """`diloco run`: exit 0 when the job finished, 1 on failure, 2 on bad input, 130 on Ctrl-C
    or SIGTERM, 129 on SIGHUP."""
    # In a pipe or a log file, lines are not cut at rich's default 80 columns.
    console = Console(stderr=False, soft_wrap=not sys.stdout.isatty())
    read = _read_job(args)
    if read is None:
        return 2
    name, spec = read.name, read.spec
    console.print(f"diloco run: job {name}, {spec.islands.count} island(s); checking it first")
    report = check_before_start(spec, args.config)
    if not report.ok:
        return 2
    problems = island_device_problems(spec, read.devices)
    for problem in problems:
        print(f"diloco run: {problem}", file=sys.stderr)
    if problems:
        return 2
    workdir = _run_folder(args, name, console)
    run = LocalRun(
        name,
        spec,
        workdir,
        read.slowdowns,
        console,
        quiet=args.quiet,
        syncer_cpus=read.syncer_cpus,
        devices=read.devices,
    )
    # Ctrl-C, SIGTERM and SIGHUP (a closed terminal, a dropped SSH session) raise
    # KeyboardInterrupt wherever the main thread is (children are in their own process groups,
    # so a terminal's signals reach only this process). Not asyncio.run's Ctrl-C, which only
    # cancels the watch task: a cancellation that anything on the way absorbs leaves the run
    # going, and once (a CI run under load) `diloco run` sat through 120 s after SIGINT with
    # every child training on. For the same reason the children are stopped before the event
    # loop is cleaned up. A SIGKILL cannot be caught: the kernel kills the children then
    # (launch.die_with).
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_interrupted)
    started = time.monotonic()
    loop = asyncio.new_event_loop()
    try:
        console.print(f"diloco run: starting the syncer and the islands; logs in {run.logs}")
        run.start()
        status = loop.run_until_complete(run.watch(started))
        run.wait_learners(LEARNER_EXIT_SECONDS)
    except KeyboardInterrupt as err:
        # A second Ctrl-C must not cut the stop short and leave children training; the
        # children are stopped first (after SIGHUP the console may be gone).
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _say(console, f"interrupted: stopping every process (logs in {run.logs})")
        # After SIGHUP nobody watches: the children get a short while to leave on their own.
        hangup = interrupted_code(err) == 128 + signal.SIGHUP
        run.stop_all(HANGUP_STOP_SECONDS if hangup else STOP_SECONDS)
        run.save_ledger(started)
        _say(console, resume_note(args, workdir))
        return interrupted_code(err)
    except (RunError, TimeoutError, RuntimeError) as err:
        run.stop_all()
        _say(console, f"diloco run failed: {err}", style="red")
        return 1
    finally:
        run.stop_all()  # whatever else went wrong (a console gone: OSError), no child is left
        _close_loop(loop)
    run.save_ledger(started, status)
    _results(run, status, time.monotonic() - started, report, args)
    return 0


def _results(
    run: LocalRun,
    status: SyncerStatus,
    wall_seconds: float,
    report: Report,
    args: argparse.Namespace,
) -> None:
    """The end of a finished run: the summary (shown and written), the plot, where the logs and
    the weights are, all in the run folder unless --summary or --plot say otherwise."""
    console, spec, workdir = run.console, run.spec, run.workdir
    summary = make_summary(
        status,
        spec=spec,
        wall_seconds=wall_seconds,
        workdir=workdir,
        parameters=report.parameters,
        earlier=run.earlier,
    )
    console.print(summary_table(summary))
    summary_file = Path(args.summary) if args.summary else workdir / SUMMARY_FILE
    summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    _say(console, f"summary written to {summary_file}")
    plot_file = Path(args.plot) if args.plot else workdir / PLOT_FILE
    if args.plot or plot_available():
        from diloco_trainer.local.plot import plot_eval_history

        plot_eval_history(
            summary["eval_history"],
            plot_file,
            title=f"{run.name}: eval loss",
            tokenizer=None if spec.model.entrypoint else report.tokenizer,
        )
        _say(console, f"loss plot written to {plot_file}")
    _say(console, f"logs in {run.logs}")
    from diloco_trainer.export import final_weights_note

    if final_weights_note(workdir / SYNCER_DIR) is not None:  # the syncer left a checkpoint
        _say(
            console,
            runnable(
                f"final weights: the syncer's last checkpoint in {workdir / SYNCER_DIR}; write "
                f"them as one safetensors file with\n  diloco export {shown(workdir)} -o "
                "model.safetensors"
            ),
        )


def plot_available() -> bool:
    """Whether matplotlib (the [local] extra's plot) is installed: the default plot is skipped
    without it (an explicit --plot is refused at start instead: cli_help.require_local)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def shown(path: Path) -> str:
    """`path` relative to the current directory when it is below it (runs/NAME), else whole."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _run_folder(args: argparse.Namespace, name: str, console: Console) -> Path:
    """The job's folder: --workdir, else runs/NAME; moved aside first with --fresh. Says
    whether the run resumes from a checkpoint there."""
    folder = Path(args.workdir) if args.workdir else default_folder(name)
    if args.fresh:
        aside = move_aside(folder)
        if aside is not None:
            _say(console, f"diloco run: --fresh: the previous run folder is now {aside}")
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    if has_checkpoints(folder):
        _say(
            console,
            f"diloco run: resuming from the checkpoints in {shown(folder)} (--fresh starts over)",
        )
    else:
        _say(console, f"diloco run: run folder {shown(folder)} (weights, logs, summary, plot)")
    return folder
