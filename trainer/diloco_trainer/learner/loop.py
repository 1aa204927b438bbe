"""`diloco learner`: one rank of one island.

An island runs H inner AdamW steps on its data shard between syncs of each parameter fragment, and
talks only to the syncer (rank 0 does; with WORLD_SIZE > 1 the ranks are a DDP group and rank 0
broadcasts what it receives).

The step schedule is in schedule.py, the link to the syncer (join, pushes, pulls, heartbeats)
in syncer_link.py, rank 0's per-fragment bookkeeping in fragment_state.py and the device and
thread choice in device.py.

Restarts: a learner that restarts simply joins again and takes the current global weights. Its inner
AdamW state starts fresh (the Decoupled DiLoCo paper keeps stale state; we have none to keep since
learners hold no checkpoint), and its learning-rate schedule continues from outerStep·H.

DDP: every rank runs the same steps. After each inner step all ranks take part in one all-reduce
(MAX) of a small int tensor: rank 0 fills in which fragments apply now and whether the job finished,
every rank adds its own stop request (SIGTERM). Then rank 0 broadcasts the tensors of each fragment
that applies, in a fixed order. So the collectives are the same on every rank.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco_trainer.api.contract import ContractError, LearnerEnv
from diloco_trainer.api.documents import JoinInfo
from diloco_trainer.api.protocol import PushMeta, SyncerError
from diloco_trainer.api.spec import ConfigError, JobSpec, load_spec
from diloco_trainer.core import compress
from diloco_trainer.core.fragments import fragment_offsets
from diloco_trainer.learner.device import configure_threads, pick_device
from diloco_trainer.learner.fragment_state import FragmentCounters, FragmentState, InFlight
from diloco_trainer.learner.schedule import plan_step, schedule_start, wait_budget
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.learner.syncer_link import (
    WAIT_SLICE_SECONDS,
    HeldFragment,
    SyncerLink,
    SyncResult,
    encode_delta,
)
from diloco_trainer.models.parts import build_parts, inner_lr, make_inner_optimizer, set_lr

log = logging.getLogger("diloco.learner")

# Log a progress line every this many inner steps.
LOG_EVERY_STEPS = 20


def weights_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in order: DDP ranks of one island must agree on it."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Learner:
    """One rank of one island; rank 0 also owns the SyncerLink."""

    def __init__(self, spec: JobSpec, env: LearnerEnv, device: str, stop: threading.Event):
        self.spec = spec
        self.env = env
        self.device = device
        self.stop = stop
        self.rank0 = env.rank == 0
        self.distributed = env.world_size > 1
        self.parts = build_parts(
            spec,
            shard_index=env.island_index,
            num_shards=spec.total_shards(),
            rank=env.rank,
            world_size=env.world_size,
            device=device,
        )
        if self.parts.train is None:
            raise ConfigError("model.entrypoint returned no train stream (TrainingParts.train)")
        self.model = self.parts.model
        self.model.train()
        self.params: dict[str, nn.Parameter] = dict(self.model.named_parameters())
        self.train_model: nn.Module = self.model
        if self.distributed:
            self.train_model = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None
            )
        self.optimizer = make_inner_optimizer(spec, self.model)
        self.fragments: list[FragmentState] = []
        self.inflight: dict[int, InFlight] = {}
        self.results: dict[int, SyncResult] = {}  # rank 0: arrived results applied this step
        self.round_times: list[float] = []
        self.error_feedback = compress.ErrorFeedback() if spec.sync.error_feedback else None
        self.link: SyncerLink | None = None
        self.tokens = 0

    # -- collectives (every rank runs exactly the same sequence) --------------------------------

    def _exchange_start(
        self, fragment_of: dict[str, int] | None, start: tuple[int, int]
    ) -> tuple[list[list[str]], int, int]:
        """Rank 0 knows the fragment of each parameter (from the syncer), the schedule start and
        the learning-rate schedule offset; share them so every rank runs the same steps."""
        names = list(self.params)
        owner = [fragment_of.get(n, -1) for n in names] if fragment_of is not None else []
        owner = owner or [-1] * len(names)
        word = torch.tensor([*start, *owner], dtype=torch.int64, device=self._comm_device())
        if self.distributed:
            dist.broadcast(word, src=0)
        first, lr_offset, *owner = word.tolist()
        num = max(owner, default=-1) + 1
        layout = [[n for n, f in zip(names, owner, strict=True) if f == g] for g in range(num)]
        return layout, first, lr_offset

    def _control(self, apply: Sequence[int], finished: bool) -> tuple[list[int], bool, bool]:
        """All-reduce(MAX) of [stop, finished, apply mask...]: rank 0's plan, anyone's stop."""
        stop = self.stop.is_set()
        if not self.distributed:
            return list(apply), finished, stop
        word = torch.zeros(2 + len(self.layout), dtype=torch.int64, device=self._comm_device())
        word[0] = int(stop)
        if self.rank0:
            word[1] = int(finished)
            for f in apply:
                word[2 + f] = 1
        dist.all_reduce(word, op=dist.ReduceOp.MAX)
        flags = word.tolist()
        return [f for f in range(len(self.layout)) if flags[2 + f]], bool(flags[1]), bool(flags[0])

    def _apply(self, fragments: Sequence[int], alpha: float) -> None:
        """θ_f ← α·θ_f,local + (1−α)·θ_f,global for each fragment, global from rank 0."""
        with torch.no_grad():
            for f in fragments:
                tensors = self.results[f].pulled.tensors if self.rank0 else {}
                for name in self.layout[f]:
                    p = self.params[name]
                    if self.rank0:
                        g = tensors[name].to(device=p.device, dtype=torch.float32)
                    else:
                        g = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                    if self.distributed:
                        dist.broadcast(g, src=0)
                    if alpha == 0.0:
                        p.copy_(g)
                    else:
                        p.mul_(alpha).add_(g.to(p.dtype), alpha=1.0 - alpha)

    def _comm_device(self) -> str:
        return self.device if self.device.startswith("cuda") else "cpu"

    # -- rank 0: syncer bookkeeping ------------------------------------------------------------

    def _wait(self, future: concurrent.futures.Future[Any], timeout: float) -> bool:
        """Block up to `timeout` for a future; give up early on SIGTERM or a finished job."""
        deadline = time.monotonic() + timeout
        while not future.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.stop.is_set():
                return False
            if self.link is not None and self.link.finished.is_set():
                return False
            concurrent.futures.wait([future], timeout=min(remaining, WAIT_SLICE_SECONDS))
        return True

    def _join(self) -> JoinInfo | None:
        """Rank 0: join and fetch every fragment's global weights (kept as the Δ bases)."""
        assert self.link is not None
        future = self.link.submit(self.link.join(self.stop))
        if not self._wait(future, float("inf")):
            return None
        info = future.result()
        names = set(self.params)
        listed = [n for frag in info.fragments for n in frag]
        if set(listed) != names or len(listed) != len(names):
            missing, extra = names - set(listed), set(listed) - names
            raise ConfigError(
                "the syncer's model does not match this learner's (check model.preset/entrypoint): "
                f"missing {sorted(missing)[:5]}, unknown {sorted(extra)[:5]}"
            )
        pulled_future = self.link.submit(self.link.pull_all(len(info.fragments)))
        if not self._wait(pulled_future, float("inf")):
            return None
        for f, pulled in enumerate(pulled_future.result()):
            self.results[f] = SyncResult(pulled=pulled, outcome="joined", seconds=0.0)
        self.fragments = [FragmentState(names=list(frag)) for frag in info.fragments]
        log.info(
            "joined the syncer at outer step %d: %d fragment(s), versions %s, codec %s, "
            "pull codec %s",
            info.outer_step,
            len(info.fragments),
            info.versions,
            info.codec,
            info.pull_compression,
        )
        return info

    def _take_result(self, f: int, step: int) -> None:
        """Record an arrived fragment as the new base (rank 0, before _apply)."""
        result = self.results[f]
        state = self.fragments[f]
        pulled = result.pulled
        for name in self.layout[f]:
            if tuple(pulled.tensors[name].shape) != tuple(self.params[name].shape):
                raise ValueError(
                    f"fragment {f}: tensor {name} has shape {tuple(pulled.tensors[name].shape)}, "
                    f"the model has {tuple(self.params[name].shape)}"
                )
        # The pulled tensors are ours (fresh from the wire) and never written to: no copy needed.
        state.base = {n: pulled.tensors[n].to(torch.float32) for n in self.layout[f]}
        state.version = pulled.version
        state.counters = FragmentCounters()
        if result.outcome == "joined":
            log.info("fragment %d: took version %d (joined)", f, pulled.version)
        else:
            state.last_sync_seconds = result.seconds
            self.round_times = [*self.round_times[-7:], result.seconds]
            log.info(
                "step %d: fragment %d applied version %d (%s, %.2fs after the push)",
                step,
                f,
                pulled.version,
                result.outcome,
                result.seconds,
            )
        if pulled.finished and self.link is not None:
            self.link.finished.set()

    def _push(self, f: int, step: int) -> None:
        """Compute Δ_f = θ_global − θ_local (fp32, CPU), encode it and push it in the background."""
        assert self.link is not None
        state = self.fragments[f]
        delta = {
            n: state.base[n] - self.params[n].detach().to("cpu", torch.float32)
            for n in self.layout[f]
        }
        codec = self.spec.sync.compression
        encoded = encode_delta(delta, codec, self.error_feedback)
        c = state.counters
        meta = PushMeta(
            island=self.env.island,
            base_version=state.version,
            tokens=c.tokens,
            steps=c.steps,
            loss=c.mean_loss,
            step_time=c.mean_step_time,
            codec=codec,
            sync_time=state.last_sync_seconds,
        )
        old = self.inflight.get(f)
        if old is not None:
            old.future.cancel()
            log.warning("step %d: fragment %d overdue, pushing it again", step, f)
        held = HeldFragment(version=state.version, tensors=state.base)
        future = self.link.submit(self.link.sync_fragment(f, encoded, meta, held))
        self.inflight[f] = InFlight(step=step, started=time.monotonic(), future=future)
        nbytes = sum(t.numel() * t.element_size() for t in encoded.values())
        log.info(
            "step %d: fragment %d pushed (base version %d, %d bytes %s, %d tokens in %d steps)",
            step,
            f,
            state.version,
            nbytes,
            codec,
            c.tokens,
            c.steps,
        )

    def _collect(self, f: int, *, block: float) -> bool:
        """Rank 0: has fragment f's sync finished (waiting up to `block` s)? Stores the result."""
        flight = self.inflight[f]
        if not self._wait(flight.future, block):
            return False
        try:
            self.results[f] = flight.future.result()
        except (concurrent.futures.CancelledError, Exception) as err:
            # The sync task only ends in an exception on a bug or a refused pull (auth): start
            # over from the current global fragment rather than train on alone for ever.
            log.error("fragment %d: sync failed (%s); resyncing", f, err)
            assert self.link is not None
            flight.future = self.link.submit(self.link.resync(f))
            return False
        del self.inflight[f]
        return True

    def _plan_syncs(self, step: int) -> list[int]:
        """Rank 0 after inner step `step`: push what is due, collect what is needed."""
        budget = wait_budget(self.round_times, self.spec.sync.heartbeat_timeout_seconds)
        now = time.monotonic()
        overlap = self.spec.sync.overlap_steps
        abandoned = frozenset(
            f
            for f, fl in self.inflight.items()
            if not fl.future.done() and now - fl.started > budget + overlap * self._step_time
        )
        plan = plan_step(
            step,
            inner_steps=self.spec.inner.steps,
            offsets=self.offsets,
            overlap=overlap,
            pushed_at={f: fl.step for f, fl in self.inflight.items()},
            abandoned=abandoned,
        )
        for f in plan.push:
            self._push(f, step)
        apply = []
        for f in plan.wait:
            started = time.monotonic()
            if self._collect(f, block=budget):
                apply.append(f)
                waited = time.monotonic() - started
                if waited > 0.05:
                    log.info("step %d: waited %.2fs for fragment %d", step, waited, f)
            elif not self.stop.is_set() and not self._finished():
                log.warning(
                    "step %d: fragment %d not merged within %.0fs; training on without it",
                    step,
                    f,
                    budget,
                )
        apply.extend(f for f in plan.poll if self._collect(f, block=0.0))
        for f in apply:
            self._take_result(f, step)
        return sorted(apply)

    def _finished(self) -> bool:
        return self.link is not None and self.link.finished.is_set()

    # -- the loop -------------------------------------------------------------------------------

    def _inner_step(self, schedule_step: int) -> tuple[float, int]:
        set_lr(self.optimizer, inner_lr(self.spec, schedule_step))
        assert self.parts.train is not None
        batch = self.parts.train.next_batch()
        loss = self.parts.loss_fn(self.train_model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.spec.inner.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.inner.grad_clip)
        self.optimizer.step()
        return float(loss.item()), batch.tokens * self.env.world_size

    def run(self) -> int:
        """Join, train until the job finishes or SIGTERM; the exit code."""
        info: JoinInfo | None = None
        fragment_of: dict[str, int] | None = None
        try:
            if self.rank0 and not self.stop.is_set():
                client = SyncerClient(self.env.syncer_url, self.env.token, self.env.ca_file)
                self.link = SyncerLink(client, island=self.env.island, replicas=self.env.world_size)
                info = self._join()
                if info is not None:
                    fragment_of = {n: f for f, names in enumerate(info.fragments) for n in names}
            return self._train(info, fragment_of)
        finally:
            if self.link is not None:
                self.link.close(leave=self.stop.is_set())

    def _train(self, info: JoinInfo | None, fragment_of: dict[str, int] | None) -> int:
        inner_steps = self.spec.inner.steps
        start = (0, 0)
        if info is not None:
            offsets = fragment_offsets(inner_steps, len(info.fragments))
            first = schedule_start(info.versions, inner_steps, offsets)
            start = (first, info.outer_step * inner_steps)
        self.layout, first, lr_offset = self._exchange_start(fragment_of, start)
        if not self.layout:  # rank 0 was stopped before it had joined: every rank gets []
            log.info("stopped before joining the syncer")
            return 0
        self.offsets = fragment_offsets(inner_steps, len(self.layout))
        # Everyone starts from the global weights (overwrite, whatever mixAlpha says).
        joined = list(range(len(self.layout))) if info is not None else []
        apply, finished, stopped = self._control(joined, self._finished())
        if self.rank0:
            for f in apply:
                self._take_result(f, 0)
        self._apply(apply, alpha=0.0)
        self.results.clear()
        if finished or stopped:
            log.info("nothing to do: %s", "the job has finished" if finished else "stopped")
            return 0
        if self.rank0:
            assert self.link is not None
            interval = min(5.0, self.spec.sync.heartbeat_timeout_seconds / 4)
            self.link.submit(self.link.heartbeats(interval))
        self._step_time = 0.0
        window_tokens, window_start, loss_ema = 0, time.monotonic(), None
        # The schedule step (fragments_due); the learning rate counts the steps run instead.
        step = first
        if first:
            log.info("starting at schedule step %d, in phase with the other islands", first)
        while True:
            step += 1
            t0 = time.perf_counter()
            loss, tokens = self._inner_step(lr_offset + step - first - 1)
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            compute = time.perf_counter() - t0
            if self.env.slowdown > 1:
                time.sleep((self.env.slowdown - 1.0) * compute)  # a deliberate straggler
            step_time = time.perf_counter() - t0
            ema = 0.9 * self._step_time + 0.1 * step_time
            self._step_time = ema if self._step_time else step_time
            loss_ema = loss if loss_ema is None else 0.9 * loss_ema + 0.1 * loss
            self.tokens += tokens
            window_tokens += tokens
            apply: list[int] = []
            if self.rank0:
                assert self.link is not None
                for state in self.fragments:
                    state.counters.add(tokens, loss, step_time)
                self.link.progress = {
                    "step": step,
                    "tokens": self.tokens,
                    "loss": loss_ema,
                    "step_time": self._step_time,
                }
                if step % LOG_EVERY_STEPS == 0:
                    now = time.monotonic()
                    log.info(
                        "step %d loss %.4f tokens %d (%.0f tokens/s)",
                        step,
                        loss_ema,
                        self.tokens,
                        window_tokens / max(now - window_start, 1e-9),
                    )
                    window_tokens, window_start = 0, now
                apply = self._plan_syncs(step)
            apply, finished, stopped = self._control(apply, self._finished())
            self._apply(apply, alpha=self.spec.sync.mix_alpha)
            for f in apply:
                self.results.pop(f, None)
            if finished or stopped:
                log.info(
                    "%s after %d steps; weights digest %s",
                    "the job has finished: exiting" if finished else "stopping on request",
                    step - first,
                    weights_digest(self.model),
                )
                return 0


def _init_distributed(env: LearnerEnv, device: str) -> None:
    """DDP inside the island: gloo on CPU, NCCL on CUDA; rank 0's pod is the master."""
    if device == "cuda":
        torch.cuda.set_device(env.rank % torch.cuda.device_count())
    dist.init_process_group(
        backend="nccl" if device.startswith("cuda") else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
    )


def main(args: argparse.Namespace) -> int:
    """`diloco learner`: everything comes from the environment (contract.py)."""
    try:
        env = LearnerEnv.from_env()
    except ContractError as err:
        logging.basicConfig(level=logging.INFO)
        log.error("%s", err)
        return 2
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s {env.island}/{env.rank} %(name)s: %(message)s",
    )
    try:
        spec = load_spec(env.config_file)
        device = pick_device(env.device)
    except (ConfigError, ContractError) as err:
        log.error("%s", err)
        return 2
    configure_threads(device)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("got %s: leaving after this step", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if env.world_size > 1:
        _init_distributed(env, device)
    try:
        learner = Learner(spec, env, device, stop)
        log.info(
            "island %s rank %d/%d on %s with %d thread(s), shard %d of %d, syncer %s",
            env.island,
            env.rank,
            env.world_size,
            device,
            torch.get_num_threads(),
            env.island_index,
            spec.total_shards(),
            env.syncer_url,
        )
        code = learner.run()
    except (ConfigError, SyncerError, ValueError) as err:
        log.error("%s", err)
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    log.info("exiting with code %d", code)
    if env.world_size > 1:
        # Even after destroy_process_group, gloo's worker threads can abort the interpreter's
        # finalisation (std::terminate, exit -6) while a peer rank is still up: CI saw rank 1
        # of a stopped island die that way. Nothing is left to clean up, so skip finalisation.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
