"""`diloco learner`: one rank of one island.

An island runs H inner AdamW steps on its data shard between syncs of each parameter fragment, and
talks only to the syncer (rank 0 does; with WORLD_SIZE > 1 the ranks are a DDP group and rank 0
broadcasts what it receives).

The step plan is in step_plan.py, phase alignment in phase_alignment.py, rank 0's side of
syncing (pushes, arrivals, the weights a received fragment leaves) in fragment_sync.py with its
per-fragment bookkeeping in fragment_state.py and the arithmetic in mixing.py, the link to the
syncer (join, pushes, pulls, heartbeats) in syncer_link.py and the device and thread choice in
device.py.

Inner optimizer: one AdamW per process, kept across rounds (DiLoCo: resetting it hurts); receiving
a fragment writes the weights in place and leaves the optimizer state alone, and so does joining the
syncer again in the same process (a syncer that forgot the island).

Restarts: a learner process that restarts simply joins again and takes the current global weights.
Its AdamW state starts fresh (the Decoupled DiLoCo paper keeps stale state; we have none to keep
since learners hold no checkpoint), so it gets the job's linear warm-up (inner.warmupSteps) again
on top of the learning-rate schedule, which continues from outerStep·H (step_plan.rewarm_factor).

DDP: every rank runs the same steps. After each inner step all ranks take part in one all-reduce
(MAX) of a small int tensor: rank 0 fills in which fragments apply now and whether the job finished,
every rank adds its own stop request (SIGTERM). Then rank 0 broadcasts the tensors of each fragment
that applies, in a fixed order. So the collectives are the same on every rank.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
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

from diloco_trainer.api.contract import DEVICE, ContractError, LearnerEnv
from diloco_trainer.api.protocol import SyncerError
from diloco_trainer.api.spec import ConfigError, JobSpec, load_spec
from diloco_trainer.core.fragments import fragment_offsets
from diloco_trainer.core.island_rounds import StepTimeReport
from diloco_trainer.cpus import configure_threads, cpus_here
from diloco_trainer.learner.device import pick_device
from diloco_trainer.learner.device_copies import PULL_APPLY_ENV, apply_pulls_on_device
from diloco_trainer.learner.drain import DrainTrigger, drain, share_steps
from diloco_trainer.learner.emulated_step import EmulatedStep
from diloco_trainer.learner.fragment_sync import FragmentSync
from diloco_trainer.learner.inner_step import InnerStep, check_precision
from diloco_trainer.learner.shards import FragmentShards, local_rows, shard_model
from diloco_trainer.learner.start_together import starts_together, wait_for_peers
from diloco_trainer.learner.step_costs import SyncPathPhases, WindowCosts, wait_hint
from diloco_trainer.learner.step_plan import rewarm_factor, schedule_start
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.learner.syncer_link import SyncerLink
from diloco_trainer.models.data import TokenStream, resume_position
from diloco_trainer.models.parts import build_parts, inner_lr, make_inner_optimizer, set_lr

log = logging.getLogger("diloco.learner")

# Log a progress line every this many inner steps.
LOG_EVERY_STEPS = 20
# The first steps whose times are logged (compute and sleep apart): what a fresh island's probes
# read (core/island_rounds.StepTimeReport).
FIRST_STEPS_LOGGED = 12
# The interpreter's thread switch interval in a learner process (seconds; Python's default 0.005).
TRAINING_SWITCH_INTERVAL = 0.0005


def step_sleep(compute: float, *, slowdown: float, pace: float) -> float:
    """Seconds to sleep after an inner step whose compute took `compute` seconds.

    A deliberate straggler (DILOCO_SLOWDOWN f) sleeps (f − 1) x its compute. A paced step
    (DILOCO_PACE_STEP_SECONDS p, benchmarks) sleeps until the step took f x p: a fixed step time
    that does not move with the host's load, as an accelerator's on hardware of its own; a
    compute longer than that sleeps nothing (0: the caller counts it over the pace).

    >>> step_sleep(0.05, slowdown=3.0, pace=0.0)
    0.1
    >>> round(step_sleep(0.05, slowdown=3.0, pace=0.2), 6), step_sleep(0.7, slowdown=3.0, pace=0.2)
    (0.55, 0.0)
    """
    if pace > 0:
        return max(0.0, slowdown * pace - compute)
    return (slowdown - 1.0) * compute if slowdown > 1 else 0.0


def weights_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in order: DDP ranks of one island must agree on it."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        # fsdp: this rank's rows (each rank of a sharded island has its own digest).
        h.update(local_rows(p).detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Learner:
    """One rank of one island; rank 0 also owns the syncer link (FragmentSync)."""

    def __init__(self, spec: JobSpec, env: LearnerEnv, device: str, stop: threading.Event):
        self.spec = spec
        self.env = env
        self.device = device
        self.stop = stop
        self.rank0 = env.rank == 0
        self.distributed = env.world_size > 1
        self.hinted = False  # wait_hint said once
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
        # fsdp: every rank holds its rows of the parameters (DTensors after fully_shard) and of
        # the fragments' DiLoCo state (shards.py); one rank alone trains unsharded.
        self.sharded = self.distributed and spec.islands.parallelism == "fsdp"
        self.shards: FragmentShards | None = None
        self.train_model: nn.Module = self.model
        if self.sharded:
            shard_model(self.model, world_size=env.world_size, device=self._comm_device())
        elif self.distributed:
            self.train_model = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None
            )
        self.params: dict[str, nn.Parameter] = dict(self.model.named_parameters())
        # One AdamW for the life of the process: its state carries across rounds (applying a
        # merged fragment writes the weights in place and never touches it).
        self.optimizer = make_inner_optimizer(spec, self.model)
        self.step: InnerStep | EmulatedStep = InnerStep(
            spec,
            params=list(self.params.values()),
            train_model=self.train_model,
            loss_fn=self.parts.loss_fn,
            optimizer=self.optimizer,
            device=device,
        )
        if env.emulate_step > 0:  # benchmarks only: bench/busy_emulated.py
            log.info("inner steps emulated: %.3fs of wall time each", env.emulate_step)
            self.step = EmulatedStep(
                list(self.params.values()),
                seconds=env.emulate_step,
                steps_per_round=spec.inner.steps,
                tokens_per_step=spec.inner.tokens_per_step,
            )
        if env.pace_step > 0:  # benchmarks only: bench/hetero.py --pace-step-ms
            log.info(
                "inner steps paced: each padded to %.3fs of wall time", env.pace_step * env.slowdown
            )
        self.layout: list[list[str]] = []
        self.sync: FragmentSync | None = None
        self.link: SyncerLink | None = None
        self.tokens = 0
        self.step_time = 0.0
        # What the heartbeats report: no step time until one clear of warm-up, sent at once
        # then (the syncer sizes a fresh island's round from it: core/island_rounds.py).
        self.reported = StepTimeReport()
        # The first steps' wall times, compute and a deliberate straggler's sleep apart, logged
        # once (what a fresh island's probes read: bench/hetero, issue 47).
        self.first_steps: list[tuple[float, float]] = []
        self.over_pace = 0  # DILOCO_PACE_STEP_SECONDS: steps whose compute outlasted the pace
        self.steps_run = 0
        self.lr_offset = 0
        # When rank 0 drains: at its share of stopAfter (K = M) or its stop target (drain.py).
        self.drain_at = DrainTrigger(share=None, steps_before=0)

    # -- collectives (every rank runs exactly the same sequence) --------------------------------

    def _exchange_start(
        self, fragment_of: dict[str, int] | None, start: tuple[int, int, int]
    ) -> tuple[list[list[str]], int, int, int]:
        """Rank 0 knows the fragment of each parameter (from the syncer), the schedule start,
        the learning-rate schedule offset and the island's merged tokens; share them so every
        rank runs the same steps on the data it would have reached."""
        names = list(self.params)
        owner = [fragment_of.get(n, -1) for n in names] if fragment_of is not None else []
        owner = owner or [-1] * len(names)
        word = torch.tensor([*start, *owner], dtype=torch.int64, device=self._comm_device())
        if self.distributed:
            dist.broadcast(word, src=0)
        first, lr_offset, island_tokens, *owner = word.tolist()
        num = max(owner, default=-1) + 1
        layout = [[n for n, f in zip(names, owner, strict=True) if f == g] for g in range(num)]
        return layout, first, lr_offset, island_tokens

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

    def _apply(self, fragments: Sequence[int], targets: dict[int, dict[str, torch.Tensor]]) -> None:
        """Install each fragment's new weights, computed by rank 0 (FragmentSync), on every
        rank: θ_f ← target_f."""
        with torch.no_grad():
            if not self.distributed:  # one batched copy, not a launch per tensor on a GPU
                got = {n: t for f in fragments for n, t in targets[f].items()}
                # A host receipt may have written the parameters in place already
                # (FragmentState.receive, added_into): nothing to copy for those.
                names = [
                    n
                    for f in fragments
                    for n in self.layout[f]
                    if got[n].data_ptr() != self.params[n].data_ptr()
                ]
                if names:
                    torch._foreach_copy_([self.params[n] for n in names], [got[n] for n in names])
                return
            for f in fragments:
                for name in self.layout[f]:
                    p = self.params[name]
                    if self.rank0:
                        g = targets[f][name].to(device=p.device, dtype=torch.float32)
                    else:
                        g = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                    if self.distributed:
                        dist.broadcast(g, src=0)
                    p.copy_(g)

    def _end_commands(self) -> None:
        """Sharded: rank 0 ends the step's fragment commands, the other ranks run them."""
        if self.shards is None:
            return
        if self.rank0:
            self.shards.done()
        else:
            self.shards.serve()

    def _comm_device(self) -> str:
        return self.device if self.device.startswith("cuda") else "cpu"

    def _finished(self) -> bool:
        return self.link is not None and self.link.finished.is_set()

    # -- the loop -------------------------------------------------------------------------------

    def _inner_step(self) -> tuple[float, int]:
        """One AdamW step on the next microBatches batches; (loss, tokens of the whole island)."""
        lr = inner_lr(self.spec, self.lr_offset + self.steps_run) * rewarm_factor(
            self.steps_run,
            warmup_steps=self.spec.inner.warmup_steps,
            joined_mid_job=self.lr_offset > 0,
        )
        set_lr(self.optimizer, lr)
        assert self.parts.train is not None
        # The pushes made after the step before start just before this step's backward pass
        # (SyncerLink.submit_later: the link's first burst of Python overlaps it).
        hand_over = self.link.start_deferred if self.link is not None else None
        loss, tokens = self.step.run(self.parts.train, before_backward=hand_over)
        self.steps_run += 1
        return loss, tokens * self.env.world_size

    def _timed_step(self) -> tuple[float, int, float]:
        """An inner step (slowed down for a deliberate straggler); (loss, tokens, seconds)."""
        t0 = time.perf_counter()
        loss, tokens = self._inner_step()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        compute = time.perf_counter() - t0
        pause = step_sleep(compute, slowdown=self.env.slowdown, pace=self.env.pace_step)
        if pause > 0:
            time.sleep(pause)  # a deliberate straggler, or a paced step (benchmarks)
        elif self.env.pace_step > 0:
            self.over_pace += 1
        step_time = time.perf_counter() - t0
        if len(self.first_steps) < FIRST_STEPS_LOGGED:
            self.first_steps.append((compute, step_time - compute))
            if len(self.first_steps) == FIRST_STEPS_LOGGED:
                log.info(
                    "first %d steps' seconds (compute + sleep): %s",
                    FIRST_STEPS_LOGGED,
                    " ".join(f"{c:.4f}+{s:.4f}" for c, s in self.first_steps),
                )
        ema = 0.9 * self.step_time + 0.1 * step_time
        self.step_time = ema if self.step_time else step_time
        self.tokens += tokens
        return loss, tokens, step_time

    def run(self) -> int:
        """Join, train until the job finishes or SIGTERM; the exit code."""
        info: Any = None
        try:
            if self.rank0 and not self.stop.is_set():
                client = SyncerClient(
                    self.env.syncer_url,
                    self.env.token,
                    self.env.ca_file,
                    # Each attempt's timeout grows with the body at the rate the spec sets.
                    min_body_bytes_per_second=self.spec.syncer.limits.min_body_bytes_per_second,
                )
                self.link = SyncerLink(
                    client,
                    island=self.env.island,
                    replicas=self.env.world_size,
                    # A sharded island applies merged rows on each rank from the host.
                    stage_on=self.device
                    if self.device.startswith("cuda") and not self.sharded
                    else None,
                    apply_on_device=apply_pulls_on_device(os.environ.get(PULL_APPLY_ENV, "")),
                )
                self.sync = FragmentSync(
                    self.spec, self.env.island, self.link, self.params, self.stop
                )
                info = self.sync.join()
            if not self._start(info):
                return 0
            return self._train()
        finally:
            if self.link is not None:
                self.link.close(leave=self.stop.is_set())

    def _start(self, info: Any) -> bool:
        """Every rank: agree on the layout and schedule, take the global weights; False when
        there is nothing to train (stopped before joining, or the job has finished)."""
        inner_steps = self.spec.inner.steps
        start, fragment_of = (0, 0, 0), None
        if info is not None:
            fragment_of = {n: f for f, names in enumerate(info.fragments) for n in names}
            offsets = fragment_offsets(inner_steps, len(info.fragments))
            first = schedule_start(info.versions, inner_steps, offsets)
            start = (first, info.outer_step, info.island_tokens)
        self.layout, first, outer_step, island_tokens = self._exchange_start(fragment_of, start)
        if not self.layout:  # rank 0 was stopped before it had joined: every rank gets []
            log.info("stopped before joining the syncer")
            return False
        self.lr_offset = outer_step * inner_steps
        self._resume_data(island_tokens)
        island_step_tokens = self.spec.inner.tokens_per_step * self.env.world_size
        self.drain_at = DrainTrigger(
            share=share_steps(self.spec, tokens_per_step=island_step_tokens),
            steps_before=island_tokens // island_step_tokens,
        )
        if self.sharded:
            self.shards = FragmentShards(
                self.params,
                self.layout,
                rank=self.env.rank,
                world_size=self.env.world_size,
                comm_device=self._comm_device(),
                alpha=self.spec.sync.mix_alpha,
            )
        targets = {}
        if self.sync is not None:
            self.sync.offsets = fragment_offsets(inner_steps, len(self.layout))
            self.sync.position = first
            self.sync.shards = self.shards
            targets = self.sync.take_joined()
        self._end_commands()
        # Everyone starts from the global weights.
        apply, finished, stopped = self._control(sorted(targets), self._finished())
        self._apply(apply, targets)
        if finished or stopped:
            log.info("nothing to do: %s", "the job has finished" if finished else "stopped")
            return False
        if self.sync is not None:
            assert self.link is not None
            interval = min(5.0, self.spec.sync.heartbeat_timeout_seconds / 4)
            self.link.submit(self.link.heartbeats(interval))
            if starts_together(info.versions, lock_step=self.sync.fill.lock_step):
                budget = self.spec.sync.heartbeat_timeout_seconds
                wait_for_peers(self.link, budget=budget, stop=self.stop)
        if first:
            log.info("starting at schedule step %d, in phase with the other islands", first)
        return True

    def _hint_waits(self, costs: WindowCosts) -> None:
        """Say once a job what to change when merges keep the island waiting (wait_hint)."""
        if self.hinted or self.sync is None:
            return
        hint = wait_hint(
            costs,
            merge_wait=self.spec.sync.merge_wait,
            overlap_mode=self.spec.sync.overlap_mode,
            tau=self.sync.overlap_fit.tau,
        )
        if hint is not None:
            log.warning("step %d: %s", self.steps_run, hint)
            self.hinted = True

    def _resume_data(self, island_tokens: int) -> None:
        """A learner restarted mid-job goes on with its shard's data where the island's merged
        work ended (the syncer's record, JoinInfo.island_tokens), not from the first batch,
        which the model has already learned from. The steps lost in the restart (not merged)
        are trained again on the same windows. Only the built-in TokenStream can seek: a stream
        of one's own (model.entrypoint) starts where it starts."""
        train = self.parts.train
        if island_tokens <= 0 or not isinstance(train, TokenStream):
            return
        seq_len = self.spec.inner.seq_len
        position = resume_position(island_tokens, seq_len=seq_len, world_size=self.env.world_size)
        train.load_state_dict({"position": position, "tokens_consumed": position * seq_len})
        log.info(
            "data: resuming at window %d of this rank's part (the island's %d merged tokens)",
            position,
            island_tokens,
        )

    def _train(self) -> int:
        """Inner steps until the job finishes or a stop; rank 0 syncs after each."""
        window_tokens, window_start, loss_ema = 0, time.monotonic(), None
        costs, window_cpu = WindowCosts(), time.process_time()
        # The sync path part by part over the job (push and receipt are FragmentSync's).
        phases = self.sync.phases if self.sync is not None else SyncPathPhases()
        while True:
            loss, tokens, step_time = self._timed_step()
            after = time.perf_counter()
            # A progress line covers the wall time from the one before: this step's training and
            # what followed the steps before it (WindowCosts).
            costs.add_step(step_time)
            loss_ema = loss if loss_ema is None else 0.9 * loss_ema + 0.1 * loss
            window_tokens += tokens
            targets: dict[int, dict[str, torch.Tensor]] = {}
            if self.sync is not None:
                assert self.link is not None
                self.sync.step_time = self.step_time
                self.sync.count(tokens, loss, step_time)
                probed = self.reported.add(step_time)
                self.link.report(
                    step=self.sync.position,
                    tokens=self.tokens,
                    loss=loss_ema,
                    step_time=self.reported.value,
                )
                if probed:  # the syncer sizes this island's first round from it: no timer wait
                    self.link.submit(self.link.report_now())
                mark = time.perf_counter()
                phases.add("report", mark - after)
                if self.steps_run % LOG_EVERY_STEPS == 0:
                    now, cpu_now = time.monotonic(), time.process_time()
                    costs.cpu = cpu_now - window_cpu
                    log.info(
                        "step %d loss %.4f tokens %d (%.0f tokens/s); %s",
                        self.sync.position,
                        loss_ema,
                        self.tokens,
                        window_tokens / max(now - window_start, 1e-9),
                        costs.line(),
                    )
                    self._hint_waits(costs)
                    window_tokens, window_start, costs = 0, now, WindowCosts()
                    window_cpu = cpu_now
                    mark, done = time.perf_counter(), mark
                    phases.add("progress", mark - done)
                targets = self._sync_after_step(phases, mark)
            mark = time.perf_counter()
            self._end_commands()
            apply, finished, stopped = self._control(sorted(targets), self._finished())
            done, mark = mark, time.perf_counter()
            phases.add("control", mark - done)
            self._apply(apply, targets)
            phases.add("apply", time.perf_counter() - mark)
            waited = self.sync.take_waited() if self.sync is not None else 0.0
            costs.add_after(time.perf_counter() - after, waited)
            if finished or stopped:
                log.info(
                    "%s after %d steps; weights digest %s%s",
                    "the job has finished: exiting" if finished else "stopping on request",
                    self.steps_run,
                    weights_digest(self.model),
                    self._peak_memory(),
                )
                if self.env.pace_step > 0:
                    log.info(
                        "paced steps: %d of %d over the pace (%.3fs a step: compute took longer)",
                        self.over_pace,
                        self.steps_run,
                        self.env.pace_step * self.env.slowdown,
                    )
                if self.sync is not None:
                    log.info("%s", phases.line(self.steps_run))
                    if self.sync.fill.steps:
                        log.info(
                            "%d fill steps (merge waits filled: step_plan.fills_wait, fills_drift)",
                            self.sync.fill.steps,
                        )
                self._log_copies()
                return 0

    def _sync_after_step(self, phases: SyncPathPhases, began: float) -> dict[int, Any]:
        """Rank 0 after a step: drain when due, else push and collect what the plan says
        (FragmentSync.after_step); the weights to apply. Its time less the pushes, receipts and
        waits in it is the plan's part of the sync path (SyncPathPhases); a drain's, all of
        it, is the drain's."""
        assert self.sync is not None and self.link is not None
        inside = self.sync.phases.seconds
        before = inside["push"] + inside["receipt"] + self.sync.waited
        # K = M: the share counts rounds (a step is H / H_i of inner.steps' units), but
        # not the work a syncer restart took back (FragmentSync.lost_work)
        work = math.floor(self.sync.round_work - self.sync.lost_work + 1e-9)
        split, stop_at = self.link.split_budget, self.link.stop_at
        if self.drain_at.asks_now(work, stop_at, split=split, now=time.monotonic()):
            self.link.submit(self.link.report_now())  # its target, soon (DrainTrigger.asks_now)
        due = self.drain_at.due(work, self.tokens, stop_at, split=split)
        targets = drain(self.sync) if due else self.sync.after_step()
        if due:
            phases.add("drain", time.perf_counter() - began)
            return targets
        counted = inside["push"] + inside["receipt"] + self.sync.waited - before
        phases.add("plan", time.perf_counter() - began - counted)
        return targets

    def _log_copies(self) -> None:
        """Rank 0: the most copies of the model its DiLoCo state held (FragmentSync.held_copies,
        at a push or a receipt), in units of the weights' bytes: ARCHITECTURE.md's memory
        model, as measured by the learner itself."""
        if self.sync is None or not self.sync.peak_copies:
            return
        peak = self.sync.peak_copies
        unit = max(peak.get("weights", 0), 1)
        log.info(
            "held at most %.2f copies of the model's weights: %s",
            sum(peak.values()) / unit,
            ", ".join(f"{k} {v / unit:.2f}" for k, v in peak.items() if v),
        )

    def _peak_memory(self) -> str:
        """'; peak GPU memory N GiB' on CUDA (what a rank needed), else nothing."""
        if not self.device.startswith("cuda"):
            return ""
        return f"; peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"


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
        check_precision(spec.inner.precision, device)
        apply_pulls_on_device(os.environ.get(PULL_APPLY_ENV, ""))  # refused here: exit 2
        configure_threads(device)
    except (ConfigError, ContractError) as err:
        log.error("%s", err)
        return 2
    # The device asked for and the one picked (auto: CUDA when available): a local run may put
    # an island on another device than the rest (diloco run --island-device).
    log.info("device %s (%s=%s)", device, DEVICE, env.device)
    log.info("torch threads: %d, on CPUs %s", torch.get_num_threads(), cpus_here())
    # The training thread shares the interpreter lock with the syncer link's threads (HTTP,
    # decoding, the copies' waits). At Python's default 5 ms switch interval each hand-over can
    # hold the training thread's kernel launches for up to 5 ms while the GPU idles after a
    # step's synchronize; the syncer runs at the same 0.5 ms for the same reason.
    sys.setswitchinterval(TRAINING_SWITCH_INTERVAL)
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
