"""A GPU learner's copies of a fragment between the host and its device, kept off the training
thread's clock.

A push's encoded Δ is made on the device and has to reach the host for the wire; a merged
fragment arrives on the host and has to reach the device. Done as plain copies on the training
thread, both waited for the transfer: at gpt-125m (64 MB of int8 out, 256 MB of fp32 in per
fragment, pageable memory) they were most of the 0.03-0.08 s each push and each receipt cost the
H100 run's training thread (bench/log/2026-11-27.md, "learner_overlap in a job on an NVIDIA H100").

- Out: `to_host` queues the copies into pinned host memory on the training thread's stream and
  returns at once, with a `ready` wait that the syncer link's thread calls before it reads them.
- In: `DeviceStager.stage` runs on a worker thread of the link: it copies the pulled fp32
  fragment to the device on a stream of its own, packed into one pinned buffer, and waits for
  that stream there. The training thread then takes tensors that are already on the device
  (`adopt` makes the allocator wait for the training stream's use of them before it reuses
  their memory).
- In, as compressed updates: `DeviceStager.rebuild` sends the int8 updates across (a quarter of
  the fp32 bytes, one copy per update) and applies them on the device to the weights the learner
  already holds there, with the float ops of published.apply_updates; the result comes back to
  pinned host memory by DMA for the checksum and the host base. The link's thread then does no
  per-value work on the host but the CRC.

Why pinned: a copy to the GPU from pageable memory is staged by the driver through buffers of its
own, and it held the training thread's kernel launches meanwhile. On an H200 at gpt-125m, a
fragment's 256 MB copied so back to back made the inner steps 10x slower, from pinned memory 1.3x,
and the rebuild on the device 1.06x (bench.studies.link_interference; bench/log/2026-11-27.md,
"learner_overlap and link_interference on an NVIDIA H200"). In a job the learner went from 0.891x of
the plain loop to 0.949x.

On the CPU all of it is the identity: no copies, nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from diloco_trainer.api.spec import ConfigError
from diloco_trainer.core.published import add_updates

# Where a GPU learner applies pulled compressed updates: "device" (the default: int8 across,
# applied on the GPU, DeviceStager.rebuild) or "host" (applied on the host, then the fp32
# fragment staged: the path before, kept as the benchmark's baseline).
PULL_APPLY_ENV = "DILOCO_PULL_APPLY"


def apply_pulls_on_device(setting: str) -> bool:
    """PULL_APPLY_ENV's rule; ConfigError for a setting it does not know."""
    if setting not in ("", "device", "host"):
        raise ConfigError(f"{PULL_APPLY_ENV}={setting!r}: use device or host")
    return setting != "host"


def _nothing() -> None:
    """The wait for copies that were not queued (host tensors)."""


def to_host(tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Callable[[], None]]:
    """`tensors` on the host, and the wait for them: call it before reading them. Device tensors
    are copied into pinned memory without blocking (the copies run in the device's stream order,
    after the work that made them); host tensors are returned as they are."""
    if not any(t.is_cuda for t in tensors.values()):
        return {k: t.to("cpu") for k, t in tensors.items()}, _nothing
    out = {k: t.to("cpu", non_blocking=True) for k, t in tensors.items()}
    done = torch.cuda.Event()
    done.record()
    return out, done.synchronize


class DeviceStager:
    """Copies pulled fragments to a GPU on a stream of its own (one per learner)."""

    def __init__(self, device: str) -> None:
        # "cuda" alone means the calling thread's current device, and the worker threads that
        # stage do not share the training thread's: name the index now.
        named = torch.device(device)
        index = named.index if named.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self.stream = torch.cuda.Stream(self.device)

    def stage(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """`tensors` as fp32 on the device, the copies finished. Blocks: call it off the
        training thread. They cross packed into pinned memory (crossed_to): copied straight from
        pageable memory, the driver staged them through its own buffers and held the training
        thread's launches meanwhile; a gpt-125m fragment copied so, back to back, made an H200's
        inner steps 10x slower, from pinned memory 1.3x (bench.studies.link_interference)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            crossed = crossed_to(tensors, self.device, pin=True)
            out = {n: t.to(torch.float32) for n, t in crossed.items()}
        self.stream.synchronize()
        return out

    def rebuild(
        self, held: Mapping[str, Tensor], updates: Sequence[Mapping[str, Tensor]], codec: str
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """θ_pub after `updates` (encoded, on the host, already checked: published.check_updates)
        from `held` (fp32 on this device, never written to), computed on the device on the
        stager's stream: (the weights on the device, the same in pinned host memory), every copy
        finished. Blocks: call it off the training thread."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            # `held` was made on the training thread's stream: read it after that work.
            self.stream.wait_stream(torch.cuda.default_stream(self.device))
            out = rebuilt_on(held, updates, codec, self.device, pin=True)
        self.stream.synchronize()
        return out


def rebuilt_on(
    held: Mapping[str, Tensor],
    updates: Sequence[Mapping[str, Tensor]],
    codec: str,
    device: torch.device,
    *,
    pin: bool,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """DeviceStager.rebuild's work, queued on the current stream without waiting for it (the
    CPU runs it too, for the tests): the updates cross to `device`, are added there to a copy of
    `held` (published.add_updates: apply_updates' float ops), and the result is copied back to
    the host (pinned memory with `pin`). (on `device`, on the host)"""
    crossed = [crossed_to(u, device, pin=pin) for u in updates]
    flat, out = flat_views(held, device)
    torch._foreach_copy_(list(out.values()), [held[n] for n in out])
    add_updates(out, crossed, codec)
    host_flat, host = flat_views(held, torch.device("cpu"), pin=pin)
    host_flat.copy_(flat, non_blocking=pin)
    return out, host


def crossed_to(
    tensors: Mapping[str, Tensor], device: torch.device, *, pin: bool
) -> dict[str, Tensor]:
    """Host tensors on `device`, the same dtypes and shapes, the copies queued on the current
    stream: they are packed into one host buffer (pinned with `pin`, so that its copy is a plain
    DMA the driver need not stage through buffers of its own), which crosses in one copy, and
    they become views of its copy. (A pulled body's ~150 tensors were as many copies.)"""
    layout, at = {}, 0
    for n, t in tensors.items():
        layout[n] = at
        at += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    packed = torch.empty(at, dtype=torch.uint8, pin_memory=pin)
    names = [n for n, t in tensors.items() if t.numel()]
    torch._foreach_copy_(
        [_view(packed, layout[n], tensors[n]) for n in names],
        [tensors[n] for n in names],
    )
    there = packed.to(device, non_blocking=pin, copy=True)
    return {n: _view(there, layout[n], t) for n, t in tensors.items()}


# Byte alignment of each tensor in crossed_to's buffer: any dtype's, and a GPU's vector loads'.
_ALIGN = 64


def _view(buffer: Tensor, offset: int, like: Tensor) -> Tensor:
    """The bytes of uint8 `buffer` from `offset` as a contiguous tensor of `like`'s dtype and
    shape."""
    nbytes = like.numel() * like.element_size()
    return buffer[offset : offset + nbytes].view(like.dtype).view(like.shape)


def flat_views(
    like: Mapping[str, Tensor], device: torch.device, *, pin: bool = False
) -> tuple[Tensor, dict[str, Tensor]]:
    """One fp32 buffer on `device` (pinned host memory with `pin`) and views of it shaped like
    `like`'s tensors, in their order: a fragment copied or moved as one piece."""
    total = sum(t.numel() for t in like.values())
    flat = torch.empty(total, dtype=torch.float32, device=device, pin_memory=pin)
    views, at = {}, 0
    for n, t in like.items():
        views[n] = flat[at : at + t.numel()].view(t.shape)
        at += t.numel()
    return flat, views


def adopt(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Staged tensors taken into the training thread's stream: their memory, allocated on the
    stager's stream, is not reused there before this stream's work on them is done."""
    out = dict(tensors)
    for t in out.values():
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
    return out


def snapshot(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """fp32 copies of `tensors` on their device, never aliases of them, made by one batched
    copy into one buffer (a fragment's ~75 tensors were ~75 launches of a GPU learner's training
    thread at each push). The copies are views of that buffer: non-overlapping, so safetensors
    stores them as they are."""
    if not tensors:
        return {}
    first = next(iter(tensors.values()))
    _, out = flat_views(tensors, first.device)
    torch._foreach_copy_(list(out.values()), [t.detach() for t in tensors.values()])
    return out
