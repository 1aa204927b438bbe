"""A GPU learner's copies of a fragment between the host and its device, kept off the training
thread's clock.

A push's encoded Δ is made on the device and has to reach the host for the wire; a merged
fragment arrives on the host and has to reach the device. Done as plain copies on the training
thread, both waited for the transfer: at gpt-125m (64 MB of int8 out, 256 MB of fp32 in per
fragment, pageable memory) they were most of the 0.03-0.08 s each push and each receipt cost the
H100 run's training thread (bench/RESULTS.md, "learner_overlap ... in a job on an NVIDIA H100").

- Out: `to_host` queues the copies into pinned host memory on the training thread's stream and
  returns at once, with a `ready` wait that the syncer link's thread calls before it reads them.
- In: `DeviceStager.stage` runs on a worker thread of the link: it copies the pulled fp32
  fragment to the device on a stream of its own and waits for that stream there. The training
  thread then takes tensors that are already on the device (`adopt` makes the allocator wait for
  the training stream's use of them before it reuses their memory).

On the CPU all of it is the identity: no copies, nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor


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
        training thread."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            out = {
                n: t.to(self.device, torch.float32, non_blocking=True) for n, t in tensors.items()
            }
        self.stream.synchronize()
        return out


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
    names = list(tensors)
    first = next(iter(tensors.values()))
    flat = torch.empty(
        sum(t.numel() for t in tensors.values()), dtype=torch.float32, device=first.device
    )
    out, at = {}, 0
    for n in names:
        t = tensors[n]
        out[n] = flat[at : at + t.numel()].view(t.shape)
        at += t.numel()
    torch._foreach_copy_([out[n] for n in names], [tensors[n].detach() for n in names])
    return out
