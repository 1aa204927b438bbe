"""Corpora, a held-out eval split, and sharded, resumable token streams.

Layout of a corpus:
- the documents (files, or JSON Lines / Parquet records: sources.py) in a deterministic order; a
  fixed share of them (every EVAL_EVERY-th) is held out for evaluation, so eval text is never
  trained on. A corpus with too few documents for that holds out its last EVAL_FRACTION of bytes.
- each split is tokenized (tokenizer.py: bytes by default, or a subword tokenizer whose
  vocabulary the model then takes) into one tensor of token ids.
- the train tokens are cut into `num_shards` disjoint contiguous shards (one per island), and each
  shard into `world_size` disjoint sub-shards (one per DDP rank of the island).
- a stream visits its sub-shard's non-overlapping windows in a random order that is a pure function
  of (data seed, sub-shard, epoch), so its position alone (`state_dict`) resumes it exactly.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from diloco_trainer.api.spec import ConfigError, DataSpec, TokenizerSpec
from diloco_trainer.models.sources import (
    BUILTIN_STDLIB,
    EVAL_EVERY,
    EVAL_FRACTION,
    read_source,
    split_documents,
)
from diloco_trainer.models.tokenizer import Tokenizer, make_tokenizer

log = logging.getLogger("diloco.data")

__all__ = [
    "BUILTIN_STDLIB",
    "EVAL_EVERY",
    "EVAL_FRACTION",
    "Batch",
    "Corpus",
    "TokenStream",
    "corpus_for",
    "eval_batches",
    "load_corpus",
]

_CORPUS_CACHE: dict[tuple[str, ...], Corpus] = {}


@dataclass(frozen=True)
class Batch:
    """One batch of next-token prediction: targets are inputs shifted by one position."""

    inputs: Tensor  # (B, T) long
    targets: Tensor  # (B, T) long
    tokens: int  # number of target tokens, B * T

    def to(self, device: str | torch.device) -> Batch:
        """The same batch on another device."""
        return Batch(self.inputs.to(device), self.targets.to(device), self.tokens)


@dataclass(frozen=True)
class Corpus:
    """A corpus split into train and held-out eval token ids (uint8 for bytes, else int32)."""

    train: Tensor  # (N_train,)
    eval: Tensor  # (N_eval,)
    documents: int  # number of documents read
    vocab_size: int  # every id is below it: the model's vocabulary
    tokenizer: Tokenizer
    report: str  # what was read and skipped, for people
    # One line for a console (diloco run, diloco check): counts, the first few skipped files.
    brief: str = ""


def load_corpus(
    source: str,
    *,
    include: Sequence[str] = (),
    fmt: str = "auto",
    text_field: str = "text",
    tokenizer: TokenizerSpec | None = None,
) -> Corpus:
    """The corpus named by `data.source`, read and tokenized once per process and cached.

    `source` is "builtin:stdlib-text" (the Python standard library's .py files, no download), a
    file, or a directory searched recursively (sources.py says which files are read). The other
    arguments are data.include, data.format, data.textField and data.tokenizer.
    """
    tokenizer = tokenizer or TokenizerSpec()
    where = source if source.startswith("builtin:") else str(Path(source).resolve())
    key = (where, "\0".join(include), fmt, text_field, tokenizer.model_dump_json())
    cached = _CORPUS_CACHE.get(key)
    if cached is not None:
        return cached
    docs = read_source(source, include=include, fmt=fmt, text_field=text_field)
    train_docs, held_docs = split_documents(docs.docs)
    tok = make_tokenizer(tokenizer, train_docs)
    train, held = tok.encode_split(train_docs), tok.encode_split(held_docs)
    report = f"{docs.summary(source)}; tokenizer: {tok.describe()}; {train.numel():,} train and "
    report += f"{held.numel():,} eval tokens"
    log.info("%s", report)
    corpus = Corpus(
        train=train,
        eval=held,
        documents=len(docs.docs),
        vocab_size=tok.vocab_size,
        tokenizer=tok,
        report=report,
        brief=docs.brief(source),
    )
    _CORPUS_CACHE[key] = corpus
    return corpus


def corpus_for(data: DataSpec) -> Corpus:
    """The corpus of a job's `data` section."""
    return load_corpus(
        data.source,
        include=data.include,
        fmt=data.format,
        text_field=data.text_field,
        tokenizer=data.tokenizer,
    )


def _mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; stable across processes and Python versions."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class TokenStream:
    """Batches of random windows from one rank's disjoint part of one shard of the train tokens.

    Every window is visited once per epoch, in an order that is a pure function of
    (seed, sub-shard, epoch); `state_dict()` is the position, so a restored stream continues with
    exactly the batches the original would have produced.
    """

    def __init__(
        self,
        data: Tensor,
        *,
        shard_index: int,
        num_shards: int,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} is not in [0, {num_shards})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        parts = num_shards * world_size
        self.part = shard_index * world_size + rank
        part_len = data.numel() // parts
        self.windows = (part_len - 1) // seq_len if part_len > 0 else 0
        if self.windows < 1:
            raise ConfigError(
                f"data.source: the train split has {data.numel()} tokens, too few for "
                f"{num_shards} shards x {world_size} ranks of at least inner.seqLen+1 = "
                f"{seq_len + 1} tokens each"
            )
        start = self.part * part_len
        self.data = data[start : start + part_len]
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.device = torch.device(device)
        self.position = 0  # windows handed out so far, across epochs
        self.tokens_consumed = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)
        self._offsets = torch.arange(seq_len + 1)

    def _permutation(self, epoch: int) -> Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(_mix_seed(self.seed, self.part, epoch))
            self._perm = torch.randperm(self.windows, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> Batch:
        """The next batch_size windows (inputs and next-token targets)."""
        idx = []
        for p in range(self.position, self.position + self.batch_size):
            epoch, j = divmod(p, self.windows)
            idx.append(self._permutation(epoch)[j])
        starts = torch.stack(idx) * self.seq_len  # (B,)
        rows = self.data[starts[:, None] + self._offsets].long()  # (B, T+1)
        self.position += self.batch_size
        batch = Batch(
            inputs=rows[:, :-1].to(self.device),
            targets=rows[:, 1:].to(self.device),
            tokens=self.batch_size * self.seq_len,
        )
        self.tokens_consumed += batch.tokens
        return batch

    def state_dict(self) -> dict[str, int]:
        """The stream position; JSON-serialisable."""
        return {"position": self.position, "tokens_consumed": self.tokens_consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by state_dict()."""
        position = int(state["position"])
        tokens = int(state.get("tokens_consumed", position * self.seq_len))
        if position < 0 or tokens < 0:
            raise ValueError(f"invalid token stream state {state!r}")
        self.position = position
        self.tokens_consumed = tokens


def resume_position(island_tokens: int, *, seq_len: int, world_size: int) -> int:
    """The window a rank's TokenStream resumes at after its island trained `island_tokens`
    tokens: every rank of an island takes the same number of windows of seq_len tokens per
    step, each from its own part of the shard, so a rank has taken island_tokens / (seq_len x
    world_size) of them (rounded down: a partial window was never taken)."""
    if island_tokens < 0 or seq_len < 1 or world_size < 1:
        raise ValueError(f"resume_position({island_tokens}, {seq_len=}, {world_size=})")
    return island_tokens // (seq_len * world_size)


def eval_batches(
    data: Tensor,
    *,
    eval_tokens: int,
    batch_size: int,
    seq_len: int,
    device: str | torch.device = "cpu",
) -> list[Batch]:
    """Fixed windows from the eval tokens totalling at least eval_tokens target tokens.

    The windows are evenly spaced over the eval split (no randomness), so every process evaluates
    the same batches and eval losses are comparable across islands, the syncer and baselines.
    """
    if data.numel() < seq_len + 1:
        raise ConfigError(
            f"data.source: the eval split has {data.numel()} tokens, fewer than "
            f"inner.seqLen+1 = {seq_len + 1}"
        )
    n_windows = max(1, -(-eval_tokens // seq_len))
    last_start = data.numel() - (seq_len + 1)
    starts = torch.linspace(0, last_start, n_windows).round().long()  # (N,)
    rows = data[starts[:, None] + torch.arange(seq_len + 1)].long()  # (N, T+1)
    batches = []
    for chunk in rows.split(batch_size):
        batches.append(
            Batch(
                inputs=chunk[:, :-1].to(device),
                targets=chunk[:, 1:].to(device),
                tokens=chunk.shape[0] * seq_len,
            )
        )
    return batches
