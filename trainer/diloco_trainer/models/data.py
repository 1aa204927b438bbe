"""Byte-level corpora, a held-out eval split, and sharded, resumable token streams.

Layout of a corpus (all byte-level; a token is a byte):
- the documents (files) in a deterministic order; a fixed share of them (every EVAL_EVERY-th file)
  is held out for evaluation, so eval text is never trained on. A corpus with too few files for
  that holds out its last EVAL_FRACTION of bytes instead.
- the train bytes are cut into `num_shards` disjoint contiguous shards (one per island), and each
  shard into `world_size` disjoint sub-shards (one per DDP rank of the island).
- a stream visits its sub-shard's non-overlapping windows in a random order that is a pure function
  of (data seed, sub-shard, epoch), so its position alone (`state_dict`) resumes it exactly.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from diloco_trainer.api.spec import ConfigError

BUILTIN_STDLIB = "builtin:stdlib-text"
EVAL_EVERY = 10  # every 10th document is held out for evaluation
EVAL_FRACTION = 0.1  # share of bytes held out when there are too few documents
TEXT_SUFFIXES = frozenset(
    {".txt", ".md", ".rst", ".py", ".json", ".yaml", ".yml", ".toml", ".csv", ".html", ".c", ".h"}
)
# Skipped when walking the stdlib: third-party code, and test suites with large binary-ish data.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_DOC_SEPARATOR = b"\n\n"

_CORPUS_CACHE: dict[str, Corpus] = {}


@dataclass(frozen=True)
class Batch:
    """One batch of next-byte prediction: targets are inputs shifted by one position."""

    inputs: Tensor  # (B, T) long
    targets: Tensor  # (B, T) long
    tokens: int  # number of target tokens, B * T

    def to(self, device: str | torch.device) -> Batch:
        """The same batch on another device."""
        return Batch(self.inputs.to(device), self.targets.to(device), self.tokens)


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into train and held-out eval bytes (uint8 tensors)."""

    train: Tensor  # (N_train,) uint8
    eval: Tensor  # (N_eval,) uint8
    documents: int  # number of files read


def _walk_files(root: Path, suffixes: frozenset[str], skip_dirs: frozenset[str]) -> list[Path]:
    """Files under root with one of the suffixes, sorted by relative path (deterministic)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of skipped trees, which is most of the time saved.
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        found.extend(Path(dirpath, f) for f in filenames if Path(f).suffix.lower() in suffixes)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _source_documents(source: str) -> list[bytes]:
    if source == BUILTIN_STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk_files(root, frozenset({".py"}), _STDLIB_SKIP_DIRS)
    elif source.startswith("builtin:"):
        raise ConfigError(
            f"data.source: unknown built-in corpus {source!r} (available: {BUILTIN_STDLIB})"
        )
    else:
        path = Path(source)
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = _walk_files(path, TEXT_SUFFIXES, frozenset({"__pycache__"}))
        else:
            raise ConfigError(f"data.source: {source!r} is neither a file nor a directory")
    docs: list[bytes] = []
    for f in files:
        try:
            docs.append(f.read_bytes())
        except OSError as err:
            raise ConfigError(f"data.source: cannot read {f}: {err.strerror}") from None
    docs = [d for d in docs if d]
    if not docs:
        raise ConfigError(f"data.source: {source!r} contains no text")
    return docs


def _split_documents(docs: list[bytes]) -> tuple[bytes, bytes]:
    if len(docs) >= 2 * EVAL_EVERY:
        # Hold out whole files: eval text then never overlaps a training window.
        held = [d for i, d in enumerate(docs) if i % EVAL_EVERY == EVAL_EVERY // 2]
        kept = [d for i, d in enumerate(docs) if i % EVAL_EVERY != EVAL_EVERY // 2]
        return _DOC_SEPARATOR.join(kept), _DOC_SEPARATOR.join(held)
    joined = _DOC_SEPARATOR.join(docs)
    cut = len(joined) - int(len(joined) * EVAL_FRACTION)
    return joined[:cut], joined[cut:]


def load_corpus(source: str) -> Corpus:
    """The corpus named by `data.source`, read once per process and cached.

    `source` is "builtin:stdlib-text" (the Python standard library's .py files, no download), a
    text file, or a directory searched recursively for text files (TEXT_SUFFIXES).
    """
    key = source if source.startswith("builtin:") else str(Path(source).resolve())
    cached = _CORPUS_CACHE.get(key)
    if cached is not None:
        return cached
    docs = _source_documents(source)
    train, held = _split_documents(docs)
    corpus = Corpus(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        eval=torch.frombuffer(bytearray(held), dtype=torch.uint8),
        documents=len(docs),
    )
    _CORPUS_CACHE[key] = corpus
    return corpus


def _mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; stable across processes and Python versions."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class TokenStream:
    """Batches of random windows from one rank's disjoint part of one shard of the train bytes.

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
                f"data.source: the train split has {data.numel()} bytes, too few for "
                f"{num_shards} shards x {world_size} ranks of at least inner.seqLen+1 = "
                f"{seq_len + 1} bytes each"
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
        """The next batch_size windows (inputs and next-byte targets)."""
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


def eval_batches(
    data: Tensor,
    *,
    eval_tokens: int,
    batch_size: int,
    seq_len: int,
    device: str | torch.device = "cpu",
) -> list[Batch]:
    """Fixed windows from the eval bytes totalling at least eval_tokens target tokens.

    The windows are evenly spaced over the eval split (no randomness), so every process evaluates
    the same batches and eval losses are comparable across islands, the syncer and baselines.
    """
    if data.numel() < seq_len + 1:
        raise ConfigError(
            f"data.source: the eval split has {data.numel()} bytes, fewer than "
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
