"""The team's data loader.

- Training text: the lines of every *.txt file under `data.source`, a directory on a volume the
  learner pods mount (a PVC in a cluster). Its bytes are cut into one contiguous shard per island
  and, within it, one part per DDP rank, so islands and ranks never train on the same bytes; each
  part is drawn from in random windows by a generator seeded per island and rank.
- Evaluation text: a pinned held-out set shipped inside this package (heldout/*.txt). The syncer
  evaluates the global weights but does not mount the training volume, and a pinned eval set keeps
  losses comparable across data refreshes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diloco_trainer.parts import Batch
from torch import Tensor

HELDOUT_DIR = Path(__file__).parent / "heldout"


def read_text(root: str | Path) -> Tensor:
    """The non-empty lines of every *.txt under root (sorted by path), joined, as bytes."""
    files = sorted(Path(root).rglob("*.txt"))
    if not files:
        raise ValueError(f"data.source: no *.txt files under {str(root)!r}")
    lines = [ln for f in files for ln in f.read_bytes().splitlines() if ln.strip()]
    return torch.frombuffer(bytearray(b"\n".join(lines)), dtype=torch.uint8)


def part_of(data: Tensor, index: int, count: int) -> Tensor:
    """The index-th of `count` equal contiguous parts of data."""
    size = data.numel() // count
    return data[index * size : (index + 1) * size]


def _rows(data: Tensor, starts: Tensor, seq_len: int) -> Tensor:
    return data[starts[:, None] + torch.arange(seq_len + 1)].long()  # (B, T+1)


class RandomWindows:
    """The train stream: `next_batch()` is all a learner calls, once per inner step."""

    def __init__(
        self, data: Tensor, *, batch_size: int, seq_len: int, seed: int, device: str
    ) -> None:
        if data.numel() < seq_len + 2:
            raise ValueError(f"data.source: a part of {data.numel()} bytes is too small")
        self.data, self.batch_size, self.seq_len, self.device = data, batch_size, seq_len, device
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> Batch:
        high = self.data.numel() - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        rows = _rows(self.data, starts, self.seq_len)
        return Batch(
            inputs=rows[:, :-1].to(self.device),
            targets=rows[:, 1:].to(self.device),
            tokens=self.batch_size * self.seq_len,
        )


def eval_set(*, tokens: int, batch_size: int, seq_len: int, device: str) -> list[Batch]:
    """Fixed, evenly spaced windows of the held-out set (no randomness): every process scores
    the same text."""
    data = read_text(HELDOUT_DIR)
    count = max(1, tokens // seq_len)
    starts = torch.linspace(0, data.numel() - seq_len - 1, count).long()
    rows = _rows(data, starts, seq_len)
    return [
        Batch(chunk[:, :-1].to(device), chunk[:, 1:].to(device), chunk.shape[0] * seq_len)
        for chunk in rows.split(batch_size)
    ]
