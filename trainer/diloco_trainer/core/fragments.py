"""Streaming fragments: which tensors are synced together, and at which inner step.

The parameters are split into F fragments of about equal bytes (largest tensor first into the
least-filled fragment); fragment f is synced at inner step offset f*H//F within each round of H
steps, so the syncer and the network see one F-th of the model at a time.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence


def split_fragments(sizes: Mapping[str, int], num_fragments: int) -> list[list[str]]:
    """Names grouped into num_fragments bytes-balanced fragments (deterministic).

    Within a fragment, names keep the order of `sizes` (the model's order). Ties in size are broken
    by name and ties in fill by fragment index, so every process computes the same split.
    """
    if num_fragments < 1:
        raise ValueError(f"sync.fragments must be >= 1, got {num_fragments}")
    if num_fragments > len(sizes):
        raise ValueError(
            f"sync.fragments ({num_fragments}) is more than the model's {len(sizes)} tensors"
        )
    for name, size in sizes.items():
        if size < 0:
            raise ValueError(f"tensor {name!r} has negative size {size}")
    heap = [(0, f) for f in range(num_fragments)]  # (bytes so far, fragment index)
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        filled, f = heapq.heappop(heap)
        owner[name] = f
        heapq.heappush(heap, (filled + sizes[name], f))
    fragments: list[list[str]] = [[] for _ in range(num_fragments)]
    for name in sizes:
        fragments[owner[name]].append(name)
    return fragments


def fragment_offsets(inner_steps: int, num_fragments: int) -> list[int]:
    """Sync offset of each fragment within a round: f * H // F."""
    if inner_steps < 1 or num_fragments < 1:
        raise ValueError(
            f"inner.steps ({inner_steps}) and sync.fragments ({num_fragments}) must be >= 1"
        )
    return [f * inner_steps // num_fragments for f in range(num_fragments)]


def fragments_due(step: int, inner_steps: int, offsets: Sequence[int]) -> list[int]:
    """Fragments whose sync point is inner step `step` (counted from 1): step % H == offset % H.

    Offset 0 is due at steps H, 2H, ... (the end of each round, as in plain DiLoCo).
    """
    if inner_steps < 1:
        raise ValueError(f"inner.steps must be >= 1, got {inner_steps}")
    phase = step % inner_steps
    return [f for f, off in enumerate(offsets) if off % inner_steps == phase]
