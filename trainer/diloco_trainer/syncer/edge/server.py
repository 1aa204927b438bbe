"""The `diloco syncer` process: the pod environment and job spec, TLS, the aiohttp server and the
exit code (0 after SIGTERM, 1 after a failed merge, 2 for a bad environment or config).

Shutdown (SIGTERM/SIGINT): long-polls are answered (304) at once, the server stops accepting
requests (within SHUTDOWN_TIMEOUT seconds), a running merge completes and a checkpoint of what was
merged since the last one is written (STOP_TIMEOUT): a stop loses only the open rounds, whose
pushes the learners make again. What a crash can lose is what happened since the last checkpoint
(at most syncer.checkpoint.everyOuterSteps outer steps; merged fragments are published before that
checkpoint is written): islands that pushed into the lost rounds notice the syncer's older
versions (a 409 with code "ahead", or versions in status/join) and continue from them.

The server runs under syncer.limits (limits.py: header and body timeouts; connections.py: a
connection cap); with DILOCO_SYNCER_HEALTH_PORT set (a pod's), /healthz and /readyz are also
served on that port by a thread of their own (probe_listener.py), where no flood of the syncer
port delays them. A
state dir whose checkpoints are all corrupt is a bad config (exit 2, see startup.py).

service.main runs it with the Syncer class; taking that as an argument keeps this module (and
http.py) free of an import of the service, which imports them.
"""

from __future__ import annotations

import logging
import ssl
import sys
from pathlib import Path
from typing import Protocol

from diloco_trainer.api.contract import ContractError, SyncerEnv
from diloco_trainer.api.spec import ConfigError, JobSpec, load_spec
from diloco_trainer.syncer.edge.http import SHUTDOWN_TIMEOUT, SyncerService, build_app, ssl_context
from diloco_trainer.syncer.edge.limits import PROBE_KEY, HttpLimits, ListenError, serve
from diloco_trainer.syncer.edge.probe_listener import HealthListener
from diloco_trainer.syncer.edge.shard_scope import check_shard, wrong_shard_middleware

log = logging.getLogger("diloco.syncer")

# The interpreter's thread switch interval in a syncer process (seconds; Python's default: 0.005).
LOOP_SWITCH_INTERVAL = 0.0005


class SyncerFactory(Protocol):
    """Builds the syncer of a job (service.Syncer); ConfigError when its state dir does not fit
    the spec."""

    def __call__(
        self,
        spec: JobSpec,
        *,
        job_name: str,
        state_dir: Path,
        config_file: Path | None = None,
        shard: int = 0,
    ) -> SyncerService: ...


def run(make_syncer: SyncerFactory) -> int:
    """Serve the job in $DILOCO_CONFIG_FILE until SIGTERM; returns the exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        env = SyncerEnv.from_env()
        spec = load_spec(env.config_file)
        check_shard(spec, env.shard)
    except (ContractError, ConfigError) as err:
        print(f"diloco syncer: {err}", file=sys.stderr)
        return 2
    try:
        tls = ssl_context(env)
    except (OSError, ssl.SSLError) as err:
        print(f"diloco syncer: cannot load TLS certificate or key: {err}", file=sys.stderr)
        return 2
    try:
        syncer = make_syncer(
            spec,
            job_name=env.job_name,
            state_dir=env.state_dir,
            config_file=env.config_file,
            shard=env.shard,
        )
    except ConfigError as err:
        print(f"diloco syncer: {err}", file=sys.stderr)
        return 2
    log.info(
        "syncer for job %s serving %s on port %d at outer step %d",
        env.job_name,
        "https" if tls else "http",
        env.port,
        syncer.outer_step,
    )
    # The event loop shares the interpreter lock with the worker threads that merge, spill and
    # free (their Python between torch calls). At the default 5 ms switch interval each loop
    # iteration that waited for the lock lost up to 5 ms to them: the long-polls a merge woke
    # resumed 30-50 ms after it was pullable at gpt-125m. At 0.5 ms they resume within 1 ms
    # (bench/log/2026-11-26.md, "syncer_scale — 2026-11-26 23:08").
    sys.setswitchinterval(LOOP_SWITCH_INTERVAL)
    limits = HttpLimits.from_spec(spec)
    app = build_app(syncer, env.token, limits)
    if spec.syncer.shards > 1:  # requests for other shards' fragments: 421 (shard_scope.py)
        app.middlewares.append(wrong_shard_middleware(env.shard, spec.syncer.shards))
        log.info("syncer shard %d of %d", env.shard, spec.syncer.shards)
    probes = None
    if env.health_port:  # the probes on a listener of their own (probe_listener.py)
        probes = HealthListener(app[PROBE_KEY], env.host, env.health_port, ssl_context=tls)
        log.info("probes (/healthz, /readyz) also served on port %d", env.health_port)
    try:
        serve(
            app,
            host=env.host,
            port=env.port,
            limits=limits,
            ssl_context=tls,
            shutdown_timeout=SHUTDOWN_TIMEOUT,
            probes=probes,
        )
    except ListenError as err:
        print(f"diloco syncer: {err}", file=sys.stderr)
        return 1
    if syncer.failure:
        log.error("syncer stopped after a failure: %s", syncer.failure)
        return 1
    log.info("syncer stopped")
    return 0
