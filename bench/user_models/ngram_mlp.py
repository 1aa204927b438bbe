"""A user's model that is not a language model over sequences: a byte n-gram MLP (Bengio et al.,
2003) that reads the previous CONTEXT bytes and predicts the next one.

Its batches have another shape than a preset's: inputs (N, CONTEXT) byte ids and targets (N,)
next bytes, N = batchSize x seqLen examples a step (one predicted byte each, so a step's tokens
match a sequence model's at the same batchSize and seqLen), with its own loss. The text is
examples/byo's corpus and pinned held-out set (data.source names the corpus folder).

    model: {entrypoint: "bench.user_models.ngram_mlp:build"}
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.parts import Batch, TrainingParts
from torch import Tensor, nn

CONTEXT = 8
VOCAB = 256
# examples/byo's pinned held-out text (this repository's, read in place).
HELDOUT_DIR = Path(__file__).resolve().parents[2] / "examples" / "byo" / "diloco_byo" / "heldout"


def read_text(root: str | Path) -> Tensor:
    """The non-empty lines of every *.txt under root (sorted by path), joined, as bytes (as
    examples/byo reads its corpus)."""
    files = sorted(Path(root).rglob("*.txt"))
    if not files:
        raise ValueError(f"data.source: no *.txt files under {str(root)!r}")
    lines = [ln for f in files for ln in f.read_bytes().splitlines() if ln.strip()]
    return torch.frombuffer(bytearray(b"\n".join(lines)), dtype=torch.uint8)


def part_of(data: Tensor, index: int, count: int) -> Tensor:
    """The index-th of `count` equal contiguous parts of data."""
    size = data.numel() // count
    return data[index * size : (index + 1) * size]


class NgramMLP(nn.Module):
    """forward(ctx (N, CONTEXT) long) -> logits (N, VOCAB)."""

    def __init__(self, embed: int = 24, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.mlp = nn.Sequential(
            nn.Linear(CONTEXT * embed, hidden), nn.GELU(), nn.Linear(hidden, VOCAB)
        )

    def forward(self, ctx: Tensor) -> Tensor:
        return self.mlp(self.embed(ctx).flatten(1))


def ngram_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Mean cross-entropy of the next byte."""
    device = next(model.parameters()).device
    return F.cross_entropy(model(batch.inputs.to(device)), batch.targets.to(device))


def _examples(data: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
    rows = data[starts[:, None] + torch.arange(CONTEXT + 1)].long()  # (N, CONTEXT + 1)
    return rows[:, :-1], rows[:, -1]


class RandomContexts:
    """The train stream: `count` random (context, next byte) examples a step."""

    def __init__(self, data: Tensor, *, count: int, seed: int, device: str) -> None:
        if data.numel() < CONTEXT + 2:
            raise ValueError(f"data.source: a part of {data.numel()} bytes is too small")
        self.data, self.count, self.device = data, count, device
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> Batch:
        high = self.data.numel() - CONTEXT - 1
        starts = torch.randint(0, high, (self.count,), generator=self.generator)
        ctx, nxt = _examples(self.data, starts)
        return Batch(inputs=ctx.to(self.device), targets=nxt.to(self.device), tokens=self.count)


def eval_examples(*, tokens: int, count: int, device: str) -> list[Batch]:
    """Evenly spaced examples of the pinned held-out set, `count` a batch (no randomness)."""
    data = read_text(HELDOUT_DIR)
    starts = torch.linspace(0, data.numel() - CONTEXT - 1, max(1, tokens)).long()
    ctx, nxt = _examples(data, starts)
    return [
        Batch(c.to(device), n.to(device), n.shape[0])
        for c, n in zip(ctx.split(count), nxt.split(count), strict=True)
    ]


def build(
    spec: JobSpec,
    *,
    shard_index: int,
    num_shards: int,
    rank: int,
    world_size: int,
    device: str,
    with_train: bool,
) -> TrainingParts:
    """As examples/byo's build: every island and rank its own contiguous part of the corpus."""
    count = spec.inner.batch_size * spec.inner.seq_len
    model = NgramMLP().to(device)
    stream = None
    if with_train:
        shard = part_of(read_text(spec.data.source), shard_index, num_shards)
        stream = RandomContexts(
            part_of(shard, rank, world_size),
            count=count,
            seed=spec.data.seed * 1_000_003 + shard_index * 1009 + rank,
            device=device,
        )
    return TrainingParts(
        model=model,
        train=stream,
        eval_batches=eval_examples(tokens=spec.data.eval_tokens, count=count, device=device),
        loss_fn=ngram_loss,
        plain_merge_names=frozenset({"embed.weight"}),
    )
