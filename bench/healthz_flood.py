"""/healthz against connection floods on a live `diloco syncer` (issue 46's done-when: it
answers within 1 s throughout a flood of 4 addresses x 1,000 connections).

Per round: a syncer at the job's default limits (maxConnections 512) with its probe listener
(DILOCO_SYNCER_HEALTH_PORT, as in a pod: syncer/edge/probe_listener.py), then A flood processes,
each opening N idle connections to the syncer port from its own loopback address as fast as it
can and holding them, while the kubelet's probe (a fresh connection per GET /healthz, as it
sends them) runs from an address outside the flood and from one of the flood's own addresses, to
the probe port (where a pod's kubelet probes) and to the syncer port (where the flood is, the
baseline), until every flood has opened its connections and for `--after` probes more. Reported
per port: probes, those not answered 200, and the probe latency's median, 99th percentile and
maximum (connect to answer), against the same probes with no flood in the same run (the floor).
The target is judged on the probe port.

With --churn (the audit of 2026-12-01's probe-port churn, docs/adversaries.md): per round, the
kubelet's probe of the probe port from KUBELET every --interval seconds with no churn (the
floor), then the same while `--addresses` processes, each from its own /24 (127.0.3.9,
127.0.4.9, ..; host 10 the next round, and so on), open connections to the probe port as fast
as they can, never send a byte and keep their newest 200, for --seconds. Reported besides the
probes: the connections the churn opened and the CPU it and the syncer's process used (seconds
per second of churn: on this machine the churners share the syncer's cores).

With --churn --target syncer (the repeat audit's syncer-port churn, audit46, docs/adversaries.md):
the same churn aimed at the syncer port, and instead of the kubelet's probe an island's heartbeat
(island-0 with its own credential, from ISLAND, another /24) on a fresh connection every
--interval seconds, as the floor and under the churn. --send G makes each churning connection
send that byte and nothing more (the one-byte churn); Python escapes are read, so
--send '\x16\x03\x01\x01\x01' sends a TLS handshake record's header and nothing more (a
ClientHello begun, then silence: it passes the deferral and holds a TLS handshake open).

With --churn --tls the syncer serves HTTPS (and its probe listener too) with a self-signed
certificate for 127.0.0.1 the bench makes in its work dir (the openssl CLI, as
tests/e2e/conftest.py's tls_files), and the probes or heartbeats go over HTTPS verified by it,
a fresh connection each, so each pays a full handshake (the churners' bytes are as above: they
never complete one).

    python -m bench.healthz_flood                      # 4 x 1000, 3 rounds
    python -m bench.healthz_flood --addresses 2 --connections 600
    python -m bench.healthz_flood --churn --rounds 2   # 4 churning /24s, 15 s a round
    python -m bench.healthz_flood --churn --target syncer --rounds 1 --seconds 10
    python -m bench.healthz_flood --churn --target syncer --tls --send G
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import functools
import http.client
import json
import os
import select
import ssl
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from diloco_trainer.api import contract, credentials, protocol
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.local import start_syncer, wait_ready, write_job_files

from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    install_signal_cleanup,
    publish,
    track,
    workdir,
)
from hack.localcluster.harness import pick_ports

SPEC = {
    "model": {"preset": "gpt-tiny"},
    "data": {"evalTokens": 1024},  # the start evaluates: a short one
    "islands": {"count": 2},
    "inner": {"steps": 4, "batchSize": 2, "seqLen": 16},
    "sync": {"quorum": 1},
}
# Opens N idle connections from one source address as fast as it can, prints "open" once all
# were attempted, and holds them until its stdin closes.
FLOOD = """
import socket, sys
source, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = []
for _ in range(n):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=20,
                                             source_address=(source, 0)))
    except OSError:
        pass
print("open", len(held), flush=True)
sys.stdin.read()
"""
# One probe: (the port probed, seconds from connect to answer, its status or the error it met).
Probe = tuple[int, float, int | str]
KUBELET = "127.0.0.1"  # the probe outside the flood; the other from the flood's first address
# The island whose heartbeats --target syncer sends, from a /24 of its own.
ISLAND, ISLAND_SOURCE = "island-0", "127.0.9.1"
# The audit's churn: opens connections to a port as fast as it can from its address, sending
# the bytes given once connected (none: never a byte), keeps the newest 200 open, for the
# seconds given; prints "start", then at the end the connections it opened and the CPU seconds
# it used.
CHURN = """
import collections, socket, sys, time
source, port, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
payload = bytes.fromhex(sys.argv[4]) if len(sys.argv) > 4 else b""
held = collections.deque()
opened = 0
print("start", flush=True)
end = time.monotonic() + secs
while time.monotonic() < end:
    s = socket.socket()
    s.setblocking(False)
    s.bind((source, 0))
    s.connect_ex(("127.0.0.1", port))
    held.append(s)
    opened += 1
    if payload and len(held) > 1:
        try:  # the previous one: connected by now on loopback (if not, it sends nothing)
            held[-2].send(payload)
        except OSError:
            pass
    while len(held) > 200:
        held.popleft().close()
print("done", opened, time.process_time(), flush=True)
"""


def connection(
    port: int, source: str, context: ssl.SSLContext | None
) -> http.client.HTTPConnection:
    """A fresh connection to 127.0.0.1:`port` from `source`: HTTPS verified by `context` when
    given (each then pays a full handshake: no session is resumed)."""
    if context is None:
        return http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    return http.client.HTTPSConnection(
        "127.0.0.1", port, timeout=10, source_address=(source, 0), context=context
    )


def probe(port: int, source: str, context: ssl.SSLContext | None = None) -> Probe:
    """One GET /healthz on a fresh connection from `source` (HTTPS when `context`): (port,
    seconds, status or error)."""
    started = time.perf_counter()
    conn = connection(port, source, context)
    try:
        conn.request("GET", protocol.ROUTE_HEALTHZ)
        status: int | str = conn.getresponse().status
    except OSError as err:
        status = type(err).__name__
    finally:
        conn.close()
    return port, time.perf_counter() - started, status


def heartbeat(
    port: int, token: str, island: str = ISLAND, context: ssl.SSLContext | None = None
) -> Probe:
    """One heartbeat of `island` with its credential `token` on a fresh connection from
    ISLAND_SOURCE (HTTPS when `context`): (port, seconds, status or error)."""
    started = time.perf_counter()
    conn = connection(port, ISLAND_SOURCE, context)
    try:
        conn.request(
            "POST",
            protocol.ROUTE_HEARTBEAT,
            body=json.dumps({"island": island, "step": 1}),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        answer = conn.getresponse()
        answer.read()
        status: int | str = answer.status
    except OSError as err:
        status = type(err).__name__
    finally:
        conn.close()
    return port, time.perf_counter() - started, status


def flood_round(
    port: int,
    addresses: Sequence[str],
    connections: int,
    after: int,
    while_held: Callable[[], None] | None = None,
    probe_ports: Sequence[int] = (),
) -> list[Probe]:
    """Probes from KUBELET and the first flood address, to `port` and each of `probe_ports`,
    while the floods open (to `port`), then `after` more rounds of probes while they hold their
    connections, `while_held` (e.g. an honest round) and one more round of probes."""
    floods = [
        subprocess.Popen(
            [sys.executable, "-c", FLOOD, source, str(port), str(connections)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for source in addresses
    ]
    targets = [(p, s) for p in (*probe_ports, port) for s in (KUBELET, addresses[0])]
    probes: list[Probe] = []
    opened = [False] * len(floods)
    try:
        while not all(opened):
            probes += [probe(p, s) for p, s in targets]
            for i, f in enumerate(floods):
                assert f.stdout is not None
                ready, _, _ = select.select([f.stdout], [], [], 0)
                opened[i] = opened[i] or f.poll() is not None or bool(ready)
        probes += [probe(p, s) for _ in range(after) for p, s in targets]
        if while_held is not None:
            while_held()
            probes += [probe(p, s) for p, s in targets]
    finally:
        for f in floods:
            if f.stdin is not None:
                f.stdin.close()
            f.wait(timeout=60)
    return probes


def cpu_seconds(pid: int) -> float:
    """The CPU (user + system) process `pid` has used so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def paced_probes(
    port: int, seconds: float, interval: float, send: Callable[[int], Probe] | None = None
) -> list[Probe]:
    """The kubelet's probes of `port` from KUBELET (or `send`'s requests), one every
    `interval` seconds (a probe that takes longer delays the next) for `seconds`."""
    probes: list[Probe] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        probes.append(probe(port, KUBELET) if send is None else send(port))
        time.sleep(max(0.0, interval - (time.monotonic() - started)))  # pacing, not a wait
    return probes


def churn_round(
    port: int,
    syncer_pid: int,
    churners: int,
    seconds: float,
    interval: float,
    host: int,
    send: Callable[[int], Probe] | None = None,
    payload: str = "",
) -> tuple[list[Probe], int, float, float]:
    """Probes from KUBELET (or `send`'s requests) while `churners` processes churn connections
    to `port` for `seconds` from 127.0.3.`host`, 127.0.4.`host`, .., each sending `payload`
    (the probes stop a second before the churn does): (probes, connections the churn opened,
    the churn's CPU seconds and the syncer's over the same time). `payload`'s characters are
    sent as the bytes of their code points (latin-1: "\x16" is one byte)."""
    extra = [payload.encode("latin-1").hex()] if payload else []
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHURN, f"127.0.{3 + i}.{host}", str(port), str(seconds), *extra],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(churners)
    ]
    try:
        for c in procs:  # every churner is churning before the first probe
            assert c.stdout is not None and c.stdout.readline() == "start\n"
        syncer_before = cpu_seconds(syncer_pid)
        probes = paced_probes(port, seconds - 1.0, interval, send)
        opened, cpu = 0, 0.0
        for c in procs:
            assert c.stdout is not None
            _, n, used = c.stdout.readline().split()
            opened, cpu = opened + int(n), cpu + float(used)
        return probes, opened, cpu, cpu_seconds(syncer_pid) - syncer_before
    finally:
        for c in procs:
            c.kill()
            c.wait(timeout=30)


def summary(probes: list[Probe]) -> tuple[int, int, float, float, float]:
    """(probes, not 200, median, p99, max) with latencies in seconds."""
    seconds = sorted(s for _, s, _ in probes)
    p99 = seconds[min(len(seconds) - 1, round(0.99 * (len(seconds) - 1)))]
    bad = sum(1 for _, _, status in probes if status != 200)
    return len(probes), bad, statistics.median(seconds), p99, seconds[-1]


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--addresses", type=int, default=4, help="flood source addresses (127.0.0.2..)")
    p.add_argument("--connections", type=int, default=1000, help="connections each address opens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--after", type=int, default=10, help="probe rounds once the floods are open")
    p.add_argument("--churn", action="store_true", help="the probe-port churn instead of floods")
    p.add_argument("--seconds", type=float, default=15.0, help="--churn: seconds a round churns")
    p.add_argument("--interval", type=float, default=0.2, help="--churn: seconds between probes")
    p.add_argument(
        "--target",
        choices=["probe", "syncer"],
        default="probe",
        help="--churn: the port churned (syncer: an island's heartbeats measured instead)",
    )
    p.add_argument(
        "--send",
        default="",
        help="--churn: bytes each churning connection sends (Python escapes: '\\x16..')",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="--churn: the syncer serves HTTPS (a self-signed certificate made in the work dir)",
    )
    args = p.parse_args(argv)
    if args.tls and not args.churn:
        p.error("--tls: only with --churn")
    try:
        args.send = codecs.decode(args.send, "unicode_escape")
        args.send.encode("latin-1")
    except (UnicodeError, ValueError) as err:
        p.error(f"--send: not bytes: {err}")
    install_signal_cleanup()
    if args.churn:
        return churn_main(args)
    addresses = [f"127.0.0.{2 + i}" for i in range(args.addresses)]
    table = Table(
        f"/healthz during a flood of {args.addresses} addresses x {args.connections} idle "
        "connections (maxConnections 512)",
        ["round", "flood", "port", "probes", "not 200", "median s", "p99 s", "max s", "max < 1 s"],
    )
    with LoadMonitor() as load, workdir(args.workdir, "healthz-flood") as work:
        files = write_job_files(parse_spec(SPEC), work / "job")
        for r in range(args.rounds):
            proc, port, probe_port = start(files, work, r)
            try:
                calm = [
                    probe(p, s)
                    for _ in range(args.after)
                    for p in (probe_port, port)
                    for s in (KUBELET, addresses[0])
                ]
                flooded = flood_round(
                    port, addresses, args.connections, args.after, probe_ports=[probe_port]
                )
            finally:
                proc.stop(timeout=10)
            for label, probes in (("none (floor)", calm), ("flood", flooded)):
                for name, p in (("probe", probe_port), ("syncer (baseline)", port)):
                    n, bad, med, p99, worst = summary([x for x in probes if x[0] == p])
                    table.add(
                        r,
                        label,
                        name,
                        n,
                        bad,
                        f"{med:.4f}",
                        f"{p99:.4f}",
                        f"{worst:.3f}",
                        "yes" if worst < 1.0 and not bad else "MISSED",
                    )
    report = Report(
        script="healthz_flood",
        summary="the kubelet's probe of a syncer under connection floods, against no flood",
        tables=[table],
        notes=[
            "port: probe = the syncer's probe listener (DILOCO_SYNCER_HEALTH_PORT), where a "
            "pod's kubelet probes and the target is judged; syncer (baseline) = /healthz on the "
            "flooded syncer port itself, as the kubelet probed before the probe listener",
            f"work dir: {Path(args.workdir) if args.workdir else 'temporary'}",
        ],
    )
    return publish(report, args, load)


def make_certificate(work: Path) -> tuple[Path, Path]:
    """A self-signed certificate valid for IP 127.0.0.1 (its own CA) and its key, in `work`
    (the openssl CLI, as tests/e2e/conftest.py's tls_files): (certificate, key)."""
    cert, key = work / "tls.crt", work / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def start(
    files: Any, work: Path, r: int, tls: tuple[Path, Path] | None = None
) -> tuple[Any, int, int]:
    """A syncer with its probe listener for round `r`, serving HTTPS with `tls` (certificate,
    key) when given: (its process, port, probe port)."""
    # Outside the ephemeral range: the last round's floods closed thousands of sockets there,
    # and their ports are not all free yet.
    port, probe_port = pick_ports(2, set())
    proc = track(
        start_syncer(
            files,
            port=port,
            state_dir=work / f"state-{r}",
            job_name="healthz-flood",
            log_file=work / f"syncer-{r}.log",
            extra_env={contract.SYNCER_HEALTH_PORT: str(probe_port)},
            tls_cert_file=tls[0] if tls else None,
            tls_key_file=tls[1] if tls else None,
        )
    )
    try:
        scheme = "https" if tls else "http"
        ca_file = tls[0] if tls else None
        wait_ready(f"{scheme}://127.0.0.1:{port}", files.token, proc=proc, ca_file=ca_file)
    except BaseException:
        proc.stop(timeout=10)
        raise
    return proc, port, probe_port


def join_island(port: int, token: str, ca_file: Path | None = None) -> None:
    """Join ISLAND (the admin's token `token`) so that its heartbeats are answered 200; over
    HTTPS verified by `ca_file` when given."""
    url = f"{'https' if ca_file else 'http'}://127.0.0.1:{port}"

    async def join() -> None:
        async with SyncerClient(url, token, ca_file=ca_file) as client:
            await client.join(ISLAND, 1)

    asyncio.run(join())


def churn_main(args: argparse.Namespace) -> int:
    """--churn: the probe port's answers (or, --target syncer, an island's heartbeats on the
    syncer port) with no churn and under the audit's churn."""
    on_syncer = args.target == "syncer"
    what = (
        f"{ISLAND}'s heartbeats on the syncer port from {ISLAND_SOURCE}"
        if on_syncer
        else f"/healthz on the probe port from {KUBELET}"
    )
    sends = f", each sending {args.send!r}" if args.send else ", silent"
    over_tls = ", over TLS (HTTPS, a handshake each)" if args.tls else ""
    table = Table(
        f"{what}{over_tls}, every {args.interval:g} s for {args.seconds - 1:g} s, with no churn "
        f"and under {args.addresses} churning /24s{sends}",
        [
            *("round", "churn", "requests", "not 200", "failures", "median s", "p99 s", "max s"),
            *("over 1 s", "max ratio", "churn conns/s", "churn CPU s/s", "syncer CPU s/s"),
        ],
    )
    with LoadMonitor() as load, workdir(args.workdir, "healthz-churn") as work:
        files = write_job_files(parse_spec(SPEC), work / "job")
        tls = make_certificate(work) if args.tls else None
        context = ssl.create_default_context(cafile=str(tls[0])) if tls else None
        for r in range(args.rounds):
            proc, port, probe_port = start(files, work, r, tls)
            try:
                send: Callable[[int], Probe] | None = None
                target = probe_port
                if context is not None:
                    send = functools.partial(probe, source=KUBELET, context=context)
                if on_syncer:
                    join_island(port, files.token, tls[0] if tls else None)
                    token = credentials.island_token(files.token, ISLAND)
                    send = functools.partial(heartbeat, token=token, context=context)
                    target = port
                pid = proc.popen.pid
                before = cpu_seconds(pid)
                calm = paced_probes(target, args.seconds - 1.0, args.interval, send)
                calm_cpu = cpu_seconds(pid) - before
                # A host of its own each round: the last round's closed connections hold their
                # source ports in TIME_WAIT for a minute, which slows this round's binds.
                churned, opened, cpu, syncer_cpu = churn_round(
                    *(target, pid, args.addresses, args.seconds, args.interval),
                    host=9 + r,
                    send=send,
                    payload=args.send,
                )
            finally:
                proc.stop(timeout=10)
            floor = summary(calm)[4]
            per_s = args.seconds - 1.0
            for label, probes, extra in (
                ("none (floor)", calm, ("-", "-", f"{calm_cpu / per_s:.2f}")),
                (
                    "churn",
                    churned,
                    (
                        f"{opened / args.seconds:.0f}",
                        f"{cpu / args.seconds:.2f}",
                        f"{syncer_cpu / per_s:.2f}",
                    ),
                ),
            ):
                n, bad, med, p99, worst = summary(probes)
                over = sum(1 for _, s, _ in probes if s > 1.0)
                failures = Counter(str(st) for _, _, st in probes if st != 200)
                told = ", ".join(f"{k} x{v}" for k, v in sorted(failures.items())) or "-"
                table.add(
                    *(r, label, n, bad, told, f"{med:.4f}", f"{p99:.4f}", f"{worst:.3f}", over),
                    *(f"{worst / floor:.1f}x", *extra),
                )
    report = Report(
        script=f"healthz_flood --churn --target {args.target}{' --tls' if args.tls else ''}",
        summary=f"{what} under a connection churn",
        tables=[table],
        notes=[
            "the target (issue 46): no request over 1 s and none failed, on the churn rows",
            "CPU s/s: CPU seconds used per second of the round (the churners' summed; "
            "the machine has 2 cores)",
            f"work dir: {Path(args.workdir) if args.workdir else 'temporary'}",
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
