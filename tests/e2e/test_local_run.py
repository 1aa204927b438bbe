"""`diloco run` as a user runs it: a real `diloco run` process and its children."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.local.job import DEFAULT_JOB_NAME, DEFAULT_SPEC, load_job
from diloco_trainer.local.run import parse_slow_islands

from .conftest import run_to_end, wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DIGEST = re.compile(r"weights digest ([0-9a-f]+)")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "outer_steps",
    "initial_eval_loss",
    "final_eval_loss",
    "tokens",
    "bytes_pushed",
    "bytes_pulled",
    "wall_seconds",
    "islands",
    "eval_history",
}


def small_job(make_spec: Callable[..., JobSpec], **overrides: object) -> JobSpec:
    """Two islands of two DDP ranks each (so the run covers DDP inside an island too)."""
    spec = {
        "islands": {"count": 2, "replicas": 2},
        "inner": {"steps": 5, "batchSize": 4, "seqLen": 32, "lr": 3e-3, "warmupSteps": 5},
        "sync": {"quorum": 2, "fragments": 2, "overlapSteps": 1, "compression": "int8"},
        "stopAfter": {"outerSteps": 4},
        **overrides,
    }
    return make_spec(**spec)


def diloco_run(
    args: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`diloco run ARGS` as its own process group leader, output in cwd/run.log (`env` added
    to this process's environment)."""
    log = (cwd / "run.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "diloco_trainer.cli", "run", *args],
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children in other sessions included), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Field 4 of /proc/PID/stat is the parent; the name (field 2) may hold spaces.
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_local_run_writes_summary_and_plot(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> None:
    config = workdir / "job.json"
    config.write_text(small_job(make_spec).to_json())
    proc = diloco_run(
        [str(config), "--summary", "s.json", "--plot", "loss.png", "--workdir", "run", "--quiet"],
        workdir,
    )
    code = run_to_end(proc)
    log = (workdir / "run.log").read_text()
    assert code == 0, log
    summary = json.loads((workdir / "s.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["islands"] == 2
    assert summary["outer_steps"] >= 4
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["bytes_pushed"] > 0 and summary["bytes_pulled"] > 0
    assert summary["tokens"] > 0
    assert len(summary["eval_history"]) >= 2
    png = (workdir / "loss.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    import matplotlib.image

    image = matplotlib.image.imread(workdir / "loss.png")
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert "logs in" in log
    # Checked first: what was read from the corpus, on the console, before anything started.
    assert "data.source builtin:stdlib-text: read" in log and "data.evalTokens" in log
    assert log.index("data.source builtin:stdlib-text") < log.index("starting the syncer")
    # The headline: bytes moved against what DDP would have moved for the same tokens.
    assert summary["parameters"] > 0
    assert summary["ddp_bytes_per_worker"] > 10 * summary["bytes_per_island"] > 0
    assert "bytes per island vs a DDP worker" in log
    # DDP inside an island: both ranks trained the very same weights, step for step.
    logs = workdir / "run" / "logs"
    for island in ("island-0", "island-1"):
        digests = [
            DIGEST.findall((logs / f"{island}-rank{rank}.log").read_text()) for rank in (0, 1)
        ]
        assert digests[0] and digests[0] == digests[1], (island, digests)


def test_local_run_sigint_stops_every_child(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> None:
    with endless_run(workdir, make_spec) as proc:
        children = descendants(proc.pid)
        assert len(children) >= 5, children  # syncer + 2 islands x 2 ranks
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
    assert code == 130, (workdir / "run.log").read_text()
    left = [pid for pid in children if alive(pid)]
    assert left == [], f"children still alive after Ctrl-C: {left}"


def test_local_run_fails_clearly_when_every_learner_dies(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> None:
    with endless_run(workdir, make_spec) as proc:
        learners = [
            pid
            for pid in descendants(proc.pid)
            if b"learner" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ]
        assert len(learners) == 4, learners  # 2 islands x 2 ranks
        for pid in learners:
            os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=120)
    log = (workdir / "run.log").read_text()
    assert code == 1, log
    assert "every learner exited before the job finished" in " ".join(log.split()), log


@contextlib.contextmanager
def endless_run(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> Iterator[subprocess.Popen[bytes]]:
    """`diloco run` of a job that never finishes by itself, once both islands train; killed
    (SIGKILL to its group) on the way out if the test left it running."""
    config = workdir / "job.json"
    config.write_text(small_job(make_spec, stopAfter={"outerSteps": 100000}).to_json())
    proc = diloco_run([str(config), "--workdir", "run", "--quiet"], workdir)
    try:
        wait_both_joined(workdir / "run" / "logs")
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_both_joined(logs: Path) -> None:
    """Every rank of every island is training once each island's rank 0 has logged its join."""

    def all_joined() -> bool:
        return (
            all(
                "joined the syncer" in (logs / f"island-{i}-rank0.log").read_text()
                for i in range(2)
                if (logs / f"island-{i}-rank0.log").exists()
            )
            and len(list(logs.glob("island-*-rank0.log"))) == 2
        )

    wait_until(all_joined, timeout=300, interval=0.2, what="both islands joined")


def test_local_default_spec_is_the_example_manifest() -> None:
    from diloco_operator.api import parse_job_spec

    manifest = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("diloco.dev/v1alpha1", "DiLoCoJob")
    assert parse_job_spec(manifest["spec"]).image  # what the operator needs to run it
    name, spec = load_job(str(REPO / "examples" / "local.yaml"))
    assert spec == parse_spec(DEFAULT_SPEC)
    assert name == DEFAULT_JOB_NAME
    assert load_job(None) == (DEFAULT_JOB_NAME, spec)


def test_local_parse_slow_islands_names_the_option() -> None:
    assert parse_slow_islands(["1:3", "0:1.5"], 2) == {1: 3.0, 0: 1.5}
    for bad in ("1", "x:3", "2:3", "1:0.5"):
        with pytest.raises(ValueError, match="--slow-island"):
            parse_slow_islands([bad], 2)


def test_local_run_puts_an_island_on_its_own_device(
    workdir: Path, make_spec: Callable[..., JobSpec]
) -> None:
    """`--island-device 1=cpu` beside a job on `auto`: island 1's learner is told cpu, island 0's
    keeps the command's DILOCO_DEVICE, and the mixed job runs to its end (on a machine without
    CUDA both pick the CPU; each learner logs what it was told and what it picked)."""
    config = workdir / "job.json"
    config.write_text(small_job(make_spec, islands={"count": 2, "replicas": 1}).to_json())
    proc = diloco_run(
        [str(config), "--workdir", "run", "--quiet", "--island-device", "1=cpu"],
        workdir,
        env={"DILOCO_DEVICE": "auto"},
    )
    code = run_to_end(proc)
    assert code == 0, (workdir / "run.log").read_text()
    logs = workdir / "run" / "logs"
    picked = "cuda" if "cuda" in _picked_auto() else "cpu"
    island0 = (logs / "island-0-rank0.log").read_text()
    island1 = (logs / "island-1-rank0.log").read_text()
    assert f"device {picked} (DILOCO_DEVICE=auto)" in island0, island0
    assert "device cpu (DILOCO_DEVICE=cpu)" in island1, island1
    summary = json.loads((workdir / "run" / "summary.json").read_text())
    assert summary["outer_steps"] >= 4
    # Both islands' pushes were merged: the CPU island took part, not only started.
    stats = summary["island_stats"]
    assert stats["island-0"]["mergedTokens"] > 0 and stats["island-1"]["mergedTokens"] > 0


def _picked_auto() -> str:
    """What `auto` picks on this machine (learner/device.py)."""
    from diloco_trainer.learner.device import pick_device

    return pick_device("auto")


@pytest.mark.parametrize(
    ("option", "why"),
    [
        ("2=cpu", r"--island-device '2=cpu': island must be in [0, 2)"),
        ("1=gpu", "--island-device '1=gpu': DEVICE must be cpu, cuda, cuda:N or auto"),
    ],
)
def test_local_run_refuses_a_bad_island_device_naming_it(
    workdir: Path, make_spec: Callable[..., JobSpec], option: str, why: str
) -> None:
    config = workdir / "job.json"
    config.write_text(small_job(make_spec).to_json())
    command = ["run", str(config), "--workdir", "run", "--island-device", option]
    result = subprocess.run(
        [sys.executable, "-m", "diloco_trainer.cli", *command],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[0] == f"diloco run: {why}", result.stderr
    assert not (workdir / "run").exists(), "diloco run started something"
