"""A rate-limiting TCP relay for loopback: `python -m bench.harness.relay --listen P ...`.

It stands between learners and the syncer (point DILOCO_SYNCER_URL at it) and makes the path look
like a wide-area link: a token bucket limits the rate, and every chunk is delivered a fixed
one-way latency after the bucket let it through (a link's serialisation delay plus its
propagation delay). All connections through one relay share its bucket(s), like flows sharing a
link. `--duplex shared` puts both directions in one bucket (the aggregate is limited, as when
shaping a loopback interface); `full` gives each direction its own.

With `--stats FILE` the relay rewrites FILE every half second with the bytes it carried each way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 16 * 1024


class TokenBucket:
    """`rate` bytes per second, at most `burst` bytes saved up; take() waits for tokens."""

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"rate ({rate}) and burst ({burst}) must be > 0")
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    async def take(self, n: int) -> None:
        """Wait until n bytes may pass (FIFO among waiters: the lock is fair)."""
        async with self._lock:
            while True:
                self._refill()
                need = min(n, self.burst)  # a chunk larger than the burst passes in pieces
                if self.tokens >= need:
                    self.tokens -= need
                    n -= need
                    if n <= 0:
                        return
                    continue
                await asyncio.sleep((need - self.tokens) / self.rate)


@dataclass
class Shaping:
    """How the relay shapes traffic; rate None = unlimited."""

    rate_bytes: float | None
    latency: float
    duplex: str = "full"
    up: TokenBucket | None = field(default=None, init=False)
    down: TokenBucket | None = field(default=None, init=False)
    carried: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0}, init=False)

    def __post_init__(self) -> None:
        if self.rate_bytes is not None:
            burst = max(CHUNK, self.rate_bytes * 0.005)  # ~5 ms of line rate, like a NIC queue
            self.up = TokenBucket(self.rate_bytes, burst)
            self.down = self.up if self.duplex == "shared" else TokenBucket(self.rate_bytes, burst)


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    bucket: TokenBucket | None,
    latency: float,
    counter: dict[str, int],
    key: str,
) -> None:
    """Copy reader -> writer through the bucket, delivering each chunk `latency` s later."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()
            counter[key] += len(data)
        with contextlib.suppress(OSError):
            if writer.can_write_eof():
                writer.write_eof()

    sender = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(CHUNK)
            if bucket is not None and data:
                await bucket.take(len(data))
            await queue.put((time.monotonic() + latency, data))
            if not data:
                break
        await sender
    except (ConnectionError, OSError):
        sender.cancel()


async def serve(
    listen_port: int, target: tuple[str, int], shaping: Shaping, stats: Path | None
) -> None:
    """Run the relay until cancelled."""

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(*target)
        except OSError:
            c_writer.close()
            return
        await asyncio.gather(
            _pipe(c_reader, t_writer, shaping.up, shaping.latency, shaping.carried, "up"),
            _pipe(t_reader, c_writer, shaping.down, shaping.latency, shaping.carried, "down"),
            return_exceptions=True,
        )
        # Close only when both directions are done: a half-closed side may still be answered.
        for w in (c_writer, t_writer):
            with contextlib.suppress(Exception):
                w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    print(f"relay listening on 127.0.0.1:{listen_port} -> {target[0]}:{target[1]}", flush=True)
    async with server:
        while True:
            await asyncio.sleep(0.5)
            if stats is not None:
                tmp = stats.with_suffix(".tmp")
                tmp.write_text(json.dumps(shaping.carried))
                os.replace(tmp, stats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--listen", type=int, required=True, help="port on 127.0.0.1")
    p.add_argument("--target", required=True, help="HOST:PORT to relay to")
    p.add_argument("--rate-mbit", type=float, default=0, help="Mbit/s (0: unlimited)")
    p.add_argument("--latency-ms", type=float, default=0, help="added one-way latency")
    p.add_argument("--duplex", choices=["full", "shared"], default="full")
    p.add_argument("--stats", type=Path, default=None, help="JSON file of bytes carried")
    args = p.parse_args()
    host, _, port = args.target.rpartition(":")
    if not host or not port.isdigit():
        p.error(f"--target must be HOST:PORT, got {args.target!r}")
    if args.rate_mbit < 0 or args.latency_ms < 0:
        p.error("--rate-mbit and --latency-ms must be >= 0")
    shaping = Shaping(
        rate_bytes=args.rate_mbit * 1e6 / 8 if args.rate_mbit else None,
        latency=args.latency_ms / 1000,
        duplex=args.duplex,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.listen, (host, int(port)), shaping, args.stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
