"""The pod environment contract between the operator and the trainer.

The operator puts these variables in pod templates; `diloco run` sets the very same ones for its
local processes, so a local run and a cluster run take one code path. Both sides import this
module; nothing else should spell these names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Identity
JOB_NAME = "DILOCO_JOB_NAME"
ISLAND = "DILOCO_ISLAND"  # island name, e.g. "island-0" or "eu-island-0"
ISLAND_INDEX = "DILOCO_ISLAND_INDEX"  # data shard index of this island across the whole job

# torchrun-compatible variables for DDP inside one island (pod 0 of the StatefulSet is master)
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"

# Where things are
SYNCER_URL = "DILOCO_SYNCER_URL"  # e.g. http://job-syncer:8470 or https://syncer.example:443
# With syncer.shards > 1: a learner's DILOCO_SYNCER_URL lists every shard's URL in shard order,
# comma-separated (api/sharding.py), and each syncer process is told its shard by this (0..N-1).
SYNCER_SHARD = "DILOCO_SYNCER_SHARD"
# This process's bearer credential (api/credentials.py): the job's root token for the syncer, the
# island's own credential for a learner (it may act as that island only).
TOKEN_FILE = "DILOCO_TOKEN_FILE"
CONFIG_FILE = "DILOCO_CONFIG_FILE"  # the JobSpec as JSON or YAML
CA_FILE = "DILOCO_CA_FILE"  # CA bundle learners use to verify an HTTPS syncer
TLS_CERT_FILE = "DILOCO_TLS_CERT_FILE"  # syncer serving certificate (enables HTTPS)
TLS_KEY_FILE = "DILOCO_TLS_KEY_FILE"
STATE_DIR = "DILOCO_STATE_DIR"  # syncer: checkpoints; learner: scratch
SYNCER_PORT = "DILOCO_SYNCER_PORT"
# The port of the syncer's own liveness/readiness listener (edge/probe_listener.py): /healthz and
# /readyz served on a thread of their own, so no flood of the syncer port delays the kubelet's
# probes.
# Unset or 0 (`diloco run`): none, the probes are answered on the syncer port only.
SYNCER_HEALTH_PORT = "DILOCO_SYNCER_HEALTH_PORT"
# The address the syncer listens on: every interface in a pod; loopback in `diloco run`.
SYNCER_HOST = "DILOCO_SYNCER_HOST"
DEVICE = "DILOCO_DEVICE"  # auto | cpu | cuda
# CPUs the process keeps to ("0-7,12"; parse_cpu_list): `diloco run` gives its GPU learners and
# its syncer separate halves of the machine (local/cpu_plan.py, cpu_split).
CPUS = "DILOCO_CPUS"
# `diloco run` only: CPUs its syncer keeps to, the rest going to its learners, on any device (a
# benchmark's learner on cores of its own, as a cluster's syncer pod leaves it).
SYNCER_CPUS = "DILOCO_SYNCER_CPUS"
# `diloco run` only: the pid of the `diloco run` that started this process, which dies with it
# (local/launch.py: the kernel kills it when its parent goes, however the parent went).
RUN_PID = "DILOCO_RUN_PID"
# Test and benchmark knob: multiply this learner's step time (a straggler on purpose).
SLOWDOWN = "DILOCO_SLOWDOWN"
# Benchmark knob (bench/busy_emulated.py): each inner step is this many wall seconds of an
# emulated accelerator instead of a real step (learner/emulated_step.py); unset or 0: real steps.
EMULATE_STEP = "DILOCO_EMULATE_STEP_SECONDS"
# Benchmark knob (bench/hetero.py --pace-step-ms): each real inner step is padded with sleep to
# this many wall seconds (times DILOCO_SLOWDOWN), an accelerator's fixed step on hardware of its
# own: on a host with fewer cores than learners their steps no longer take compute from each
# other's (as long as a step's compute stays under its pace; the learner counts those that do
# not). Unset or 0: steps take what they take.
PACE_STEP = "DILOCO_PACE_STEP_SECONDS"

# Conventional mount points in pods
CONFIG_MOUNT = "/etc/diloco/config"
CONFIG_KEY = "spec.json"
TOKEN_MOUNT = "/etc/diloco/token"
TOKEN_KEY = "token"  # key of the root token Secret; learners get their island's key as this file
# `diloco run`: one credential file per island in this directory beside the root token file.
ISLAND_TOKENS_DIR = "island-tokens"
CA_MOUNT = "/etc/diloco/ca"
TLS_MOUNT = "/etc/diloco/tls"
STATE_MOUNT = "/var/lib/diloco"
DEFAULT_SYNCER_PORT = 8470
DEFAULT_SYNCER_HOST = "0.0.0.0"
DEFAULT_MASTER_PORT = 29500


class ContractError(RuntimeError):
    """A required variable is missing or malformed; the message names it."""


def _require(env: dict[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise ContractError(f"environment variable {name} is required")
    return value


def _int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ContractError(f"environment variable {name}={raw!r} is not an integer") from None


def _seconds(env: dict[str, str], name: str) -> float:
    """A benchmark knob's seconds, in [0, 60]; unset or empty: 0."""
    raw = env.get(name, "") or "0"
    try:
        seconds = float(raw)
    except ValueError:
        raise ContractError(f"{name}={raw!r} is not a number") from None
    if not 0 <= seconds <= 60:
        raise ContractError(f"{name} must be in [0, 60] seconds, got {seconds}")
    return seconds


@dataclass(frozen=True)
class LearnerEnv:
    """What a learner process reads from its environment."""

    job_name: str
    island: str
    island_index: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    syncer_url: str
    token: str
    config_file: Path
    ca_file: Path | None
    device: str
    slowdown: float
    emulate_step: float = 0.0
    pace_step: float = 0.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> LearnerEnv:
        env = dict(os.environ if env is None else env)
        slowdown_raw = env.get(SLOWDOWN, "") or "1"
        try:
            slowdown = float(slowdown_raw)
        except ValueError:
            raise ContractError(f"{SLOWDOWN}={slowdown_raw!r} is not a number") from None
        if slowdown < 1:
            raise ContractError(f"{SLOWDOWN} must be >= 1, got {slowdown}")
        emulate_step = _seconds(env, EMULATE_STEP)
        pace_step = _seconds(env, PACE_STEP)
        if emulate_step and pace_step:
            raise ContractError(f"{PACE_STEP} paces real steps; {EMULATE_STEP} has its own pace")
        rank = _int(env, RANK, 0)
        world_size = _int(env, WORLD_SIZE, 1)
        if not 0 <= rank < world_size:
            raise ContractError(f"{RANK}={rank} must be in [0, {WORLD_SIZE}={world_size})")
        if emulate_step and world_size > 1:
            raise ContractError(f"{EMULATE_STEP} emulates single-rank islands ({WORLD_SIZE}=1)")
        ca = env.get(CA_FILE, "")
        return cls(
            job_name=env.get(JOB_NAME, "local"),
            island=_require(env, ISLAND),
            island_index=_int(env, ISLAND_INDEX, 0),
            rank=rank,
            world_size=world_size,
            master_addr=env.get(MASTER_ADDR, "127.0.0.1"),
            master_port=_int(env, MASTER_PORT, DEFAULT_MASTER_PORT),
            syncer_url=_require(env, SYNCER_URL).rstrip("/"),
            token=read_token(Path(_require(env, TOKEN_FILE))),
            config_file=Path(_require(env, CONFIG_FILE)),
            ca_file=Path(ca) if ca else None,
            device=env.get(DEVICE, "auto") or "auto",
            slowdown=slowdown,
            emulate_step=emulate_step,
            pace_step=pace_step,
        )

    @classmethod
    def offline(
        cls, *, device: str = "cpu", rank: int = 0, world_size: int = 1, job_name: str = "offline"
    ) -> LearnerEnv:
        """The environment of a learner that never talks to a syncer: benchmarks and tests that
        drive its inner steps, pushes and arrivals directly (the syncer address is unroutable)."""
        return cls(
            job_name=job_name,
            island="island-0",
            island_index=0,
            rank=rank,
            world_size=world_size,
            master_addr="127.0.0.1",
            master_port=1,
            syncer_url="http://127.0.0.1:1",
            token=job_name,
            config_file=Path("unused"),
            ca_file=None,
            device=device,
            slowdown=1.0,
        )


@dataclass(frozen=True)
class SyncerEnv:
    """What the syncer process reads from its environment."""

    job_name: str
    port: int
    token: str
    config_file: Path
    state_dir: Path
    tls_cert_file: Path | None
    tls_key_file: Path | None
    shard: int = 0  # which of syncer.shards this process is (api/sharding.py)
    host: str = DEFAULT_SYNCER_HOST  # the address it listens on
    health_port: int = 0  # its probe listener's port (SYNCER_HEALTH_PORT); 0: none

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SyncerEnv:
        env = dict(os.environ if env is None else env)
        cert, key = env.get(TLS_CERT_FILE, ""), env.get(TLS_KEY_FILE, "")
        if bool(cert) != bool(key):
            raise ContractError(f"{TLS_CERT_FILE} and {TLS_KEY_FILE} must be set together")
        return cls(
            job_name=env.get(JOB_NAME, "local"),
            port=_int(env, SYNCER_PORT, DEFAULT_SYNCER_PORT),
            token=read_token(Path(_require(env, TOKEN_FILE))),
            config_file=Path(_require(env, CONFIG_FILE)),
            state_dir=Path(env.get(STATE_DIR, "") or STATE_MOUNT),
            tls_cert_file=Path(cert) if cert else None,
            tls_key_file=Path(key) if key else None,
            shard=_int(env, SYNCER_SHARD, 0),
            host=env.get(SYNCER_HOST, "") or DEFAULT_SYNCER_HOST,
            health_port=_int(env, SYNCER_HEALTH_PORT, 0),
        )


def health_port_of(port: int) -> int:
    """The port of a syncer pod's probe listener (SYNCER_HEALTH_PORT): the one after its syncer
    port, or the one before the last port (no CRD field: a pod has its ports to itself)."""
    return port + 1 if port < 65535 else port - 1


def read_token(path: Path) -> str:
    """Read a bearer token file, refusing an empty one."""
    try:
        token = path.read_text().strip()
    except OSError as err:
        raise ContractError(f"cannot read token file {path}: {err.strerror}") from None
    if not token:
        raise ContractError(f"token file {path} is empty")
    return token


def island_name(prefix: str, index: int) -> str:
    """The name of island `index`: 'island-3', or 'eu-island-3' with a prefix."""
    return f"{prefix}-island-{index}" if prefix else f"island-{index}"


def parse_cpu_list(text: str, name: str = CPUS) -> frozenset[int]:
    """ "0-3,8" -> {0, 1, 2, 3, 8}; ContractError naming the variable (`name`) when it is not
    such a list."""
    out: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError
            out.update(range(first, last + 1))
    except ValueError:
        raise ContractError(f"{name}={text!r} is not a CPU list such as 0-3,8") from None
    if not out:
        raise ContractError(f"{name}={text!r} names no CPU")
    return frozenset(out)


def format_cpu_list(cpus: frozenset[int]) -> str:
    """{0, 1, 2, 3, 8} -> "0-3,8" (parse_cpu_list's inverse)."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
