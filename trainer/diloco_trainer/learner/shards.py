"""FSDP inside an island (islands.parallelism fsdp): sharding the model, and every rank's shards
of each fragment's DiLoCo state.

With FSDP2 (`fully_shard` on each transformer block, then on the root, as torchtitan does) every
parameter is a DTensor split on dim 0 across the island's ranks, and so are its gradient and its
AdamW state. The DiLoCo state is split the same way: each rank keeps, per fragment, its rows of
the global weights it pulled (the Δ base, fp32 on the CPU) and of its weights at the last push.
Rank 0 alone talks to the syncer, and the syncer still sees whole fragments (the protocol is
unchanged), so rank 0 materialises one fragment at a time:

- a push: every rank computes its rows of Δ_f = θ_global − θ_local, rank 0 gathers them into the
  whole Δ_f, encodes it and drops it;
- an arrival: rank 0 scatters the merged fragment's rows; every rank mixes its rows with the
  overlap rule (mixing.received_weights: element-wise, so it works on rows) and writes them
  into its shard of the parameters.

Pulls are of full fragments: a compressed pull is a chain of updates applied to the whole
fragment the learner holds, which no rank keeps here.

Rank 0's FragmentSync runs the protocol; whenever it needs the other ranks it broadcasts a
command (push f, receive f, joined f) and every other rank, waiting in `serve`, runs the same
collective; `done` ends a step's commands. The order of collectives is therefore rank 0's, on
every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from diloco_trainer.learner.mixing import pseudo_gradient, received_weights

Weights = dict[str, Tensor]

DONE, PUSH, RECEIVE, JOINED = 0, 1, 2, 3


def shard_model(model: nn.Module, *, world_size: int, device: str) -> None:
    """FSDP2 in place: each transformer block (a `blocks` ModuleList, as the built-in GPT has)
    is its own unit, so only one block's full weights exist at a time; the root holds the rest."""
    mesh = init_device_mesh(device.split(":", 1)[0], (world_size,))
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        for block in blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def local_rows(p: Tensor) -> Tensor:
    """This rank's rows of a parameter (the whole tensor when it is not sharded)."""
    return p.to_local() if isinstance(p, DTensor) else p


class FragmentShards:
    """One rank's rows of every fragment's base and at-push weights, and the collectives that
    move whole fragments between rank 0 and the others."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        layout: list[list[str]],
        *,
        rank: int,
        world_size: int,
        comm_device: str,
        alpha: float = 0.0,
    ) -> None:
        self.params = params
        self.alpha = alpha  # sync.mixAlpha: the same on every rank (it comes from the spec)
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.comm_device = comm_device
        self.base: dict[int, Weights] = {}  # fp32 CPU rows of θ_global per fragment
        self.at_push: dict[int, Weights | None] = {}
        # Rows of dim 0 each rank holds, per parameter (FSDP2 splits like torch.chunk; read
        # from the ranks themselves rather than assumed).
        self.rows = self._all_rows()

    def _all_rows(self) -> dict[str, list[int]]:
        names = list(self.params)
        mine = [local_rows(self.params[n]).shape[0] for n in names]
        mine_t = torch.tensor(mine, dtype=torch.int64, device=self.comm_device)
        everyone = [torch.empty_like(mine_t) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine_t)
        table = torch.stack(everyone).cpu()  # (world, params)
        rows = {}
        for i, n in enumerate(names):
            per_rank = table[:, i].tolist()
            if sum(per_rank) != self.params[n].shape[0]:
                raise ValueError(f"parameter {n}: shards of {per_rank} rows do not add up")
            rows[n] = per_rank
        return rows

    # -- rank 0: commands ------------------------------------------------------------------------

    def _command(self, cmd: int, fragment: int) -> None:
        word = torch.tensor([cmd, fragment], dtype=torch.int64, device=self.comm_device)
        dist.broadcast(word, src=0)

    def gather_pseudo_gradient(self, f: int) -> Weights:
        """Rank 0: the whole Δ_f, gathered from every rank's rows (each keeps its at-push rows)."""
        self._command(PUSH, f)
        return self._push(f)

    def receive(self, f: int, merged: Weights) -> None:
        """Rank 0: hand the merged fragment's rows out; every rank installs its own."""
        self._command(RECEIVE, f)
        self._receive(f, merged)

    def joined(self, f: int, merged: Weights) -> None:
        """Rank 0: every rank takes its rows of the global fragment (joining: overwrite)."""
        self._command(JOINED, f)
        self._joined(f, merged)

    def done(self) -> None:
        """Rank 0: no more commands this step."""
        self._command(DONE, -1)

    # -- the other ranks ---------------------------------------------------------------------------

    def serve(self) -> None:
        """Ranks > 0: run rank 0's commands until it says done."""
        while True:
            word = torch.empty(2, dtype=torch.int64, device=self.comm_device)
            dist.broadcast(word, src=0)
            cmd, f = word.tolist()
            if cmd == DONE:
                return
            if cmd == PUSH:
                self._push(f)
            elif cmd == RECEIVE:
                self._receive(f, None)
            elif cmd == JOINED:
                self._joined(f, None)
            else:
                raise ValueError(f"unknown shard command {cmd}")

    # -- every rank ------------------------------------------------------------------------------

    def _local(self, f: int) -> Weights:
        """This rank's rows of fragment f now, as fp32 CPU copies."""
        return {
            n: local_rows(self.params[n]).detach().to("cpu", torch.float32, copy=True)
            for n in self.layout[f]
        }

    def _push(self, f: int) -> Weights:
        local = self._local(f)
        delta = pseudo_gradient(self.base[f], local)
        self.at_push[f] = local
        return self._gather(f, delta)

    def _receive(self, f: int, merged: Weights | None) -> None:
        rows = self._scatter(f, merged)
        target = received_weights(rows, self._local(f), self.at_push.get(f), self.alpha)
        self._install(f, target)
        self.base[f] = rows
        self.at_push[f] = None

    def _joined(self, f: int, merged: Weights | None) -> None:
        rows = self._scatter(f, merged)
        self._install(f, rows)
        self.base[f] = rows
        self.at_push[f] = None

    def _install(self, f: int, rows: Weights) -> None:
        with torch.no_grad():
            for n in self.layout[f]:
                shard = local_rows(self.params[n])
                shard.copy_(rows[n].to(device=shard.device, dtype=shard.dtype))

    # -- collectives on one fragment ------------------------------------------------------------

    def _padded_rows(self, name: str) -> int:
        return max(self.rows[name])

    def _gather(self, f: int, rows: Weights) -> Weights:
        """Every rank's rows of fragment f → the whole tensors on rank 0 ({} elsewhere)."""
        out: Weights = {}
        for n in self.layout[f]:
            full_shape = tuple(self.params[n].shape)
            width = self._padded_rows(n)
            buf = torch.zeros((width, *full_shape[1:]), dtype=torch.float32)
            mine = rows[n]
            buf[: mine.shape[0]] = mine
            buf = buf.to(self.comm_device)
            parts = (
                [torch.empty_like(buf) for _ in range(self.world_size)] if self.rank == 0 else None
            )
            dist.gather(buf, gather_list=parts, dst=0)
            if parts is not None:
                out[n] = torch.cat(
                    [p[:k].cpu() for p, k in zip(parts, self.rows[n], strict=True)]
                ).reshape(full_shape)
        return out

    def _scatter(self, f: int, full: Weights | None) -> Weights:
        """Rank 0's whole tensors of fragment f → each rank's rows (fp32, CPU)."""
        out: Weights = {}
        for n in self.layout[f]:
            full_shape = tuple(self.params[n].shape)
            width = self._padded_rows(n)
            buf = torch.empty(
                (width, *full_shape[1:]), dtype=torch.float32, device=self.comm_device
            )
            parts = None
            if self.rank == 0:
                assert full is not None, "rank 0 scatters the fragment it received"
                t = full[n].to(torch.float32)
                parts, start = [], 0
                for k in self.rows[n]:
                    part = torch.zeros((width, *full_shape[1:]), dtype=torch.float32)
                    part[:k] = t[start : start + k]
                    parts.append(part.to(self.comm_device))
                    start += k
            dist.scatter(buf, scatter_list=parts, src=0)
            out[n] = buf[: self.rows[n][self.rank]].cpu()
        return out
