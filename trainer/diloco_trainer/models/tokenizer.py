"""Tokenizers: bytes (the default) or a subword tokenizer of the `tokenizers` library.

A subword tokenizer comes from a tokenizer.json file (`data.tokenizer.type: file`) or is a
byte-level BPE trained on the corpus's train split (`type: bpe`). Training is deterministic (the
library breaks ties between equally frequent pairs by token id, and ids follow the sorted
alphabet), so the syncer and every learner, each training on the same documents, get the same
tokenizer; a test checks this across processes. The model's vocabulary is `vocab_size`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import numpy as np

from diloco_trainer.api.spec import ConfigError, TokenizerSpec
from diloco_trainer.models.sources import DOC_SEPARATOR

if TYPE_CHECKING:
    import tokenizers
    from torch import Tensor

BYTE_VOCAB = 256
ENCODE_CHUNK = 1024  # documents per encode call: bounds the memory of the library's encodings


class Tokenizer(Protocol):
    """What the data pipeline needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode_split(self, docs: Sequence[bytes]) -> Tensor:
        """The token ids of the documents, separated by DOC_SEPARATOR's tokens, as one tensor."""
        ...

    def describe(self) -> str: ...


class ByteTokenizer:
    """One token per byte: ids are the bytes themselves (uint8)."""

    vocab_size = BYTE_VOCAB

    def encode_split(self, docs: Sequence[bytes]) -> Tensor:
        import torch  # here, not at the top: making a tokenizer needs no torch (a quick import)

        joined = DOC_SEPARATOR.join(docs)
        return torch.frombuffer(bytearray(joined), dtype=torch.uint8)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of one text (for a prompt: `diloco sample`)."""
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (for people reading samples); a draw may cut a multi-byte
        character: shown as U+FFFD, not an error."""
        return bytes(ids).decode("utf-8", errors="replace")

    def describe(self) -> str:
        return "bytes (256 tokens)"


class SubwordTokenizer:
    """A `tokenizers.Tokenizer`; ids are int32."""

    def __init__(self, tok: tokenizers.Tokenizer, origin: str) -> None:
        # A tokenizer.json may carry truncation or padding for another use; a corpus is encoded
        # whole.
        tok.no_truncation()
        tok.no_padding()
        self.tok = tok
        self.origin = origin
        # Ids may have gaps (added tokens): the embedding table must cover the largest.
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        self.separator = tok.encode(DOC_SEPARATOR.decode(), add_special_tokens=False).ids

    def _encode(self, texts: list[str]) -> list[list[int]]:
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def encode_split(self, docs: Sequence[bytes]) -> Tensor:
        pieces: list[list[int]] = []
        for start in range(0, len(docs), ENCODE_CHUNK):
            chunk = docs[start : start + ENCODE_CHUNK]
            texts = [d.decode("utf-8", errors="replace") for d in chunk]
            for i, ids in enumerate(self._encode(texts)):
                if start + i > 0:
                    pieces.append(self.separator)
                pieces.append(ids)
        total = sum(len(p) for p in pieces)
        flat = np.fromiter(chain.from_iterable(pieces), dtype=np.int32, count=total)
        import torch  # see ByteTokenizer.encode_split

        return torch.from_numpy(flat)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of one text (for a prompt: `diloco sample`)."""
        return self._encode([text])[0]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids (for people reading samples)."""
        return str(self.tok.decode(list(ids)))

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as tokenizer.json (what `type: file` reads)."""
        self.tok.save(str(path))

    def describe(self) -> str:
        return f"{self.origin} ({self.vocab_size} tokens)"


def _tokenizers_module() -> ModuleType:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(
            "data.tokenizer: a subword tokenizer needs the tokenizers library: "
            "pip install 'diloco-operator[trainer]'"
        ) from None
    return tokenizers


def load_tokenizer_file(path: str) -> SubwordTokenizer:
    """A tokenizer from a tokenizer.json file; ConfigError names data.tokenizer.path."""
    tokenizers = _tokenizers_module()
    if not Path(path).is_file():
        raise ConfigError(f"data.tokenizer.path: {path!r} is not a file")
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as err:  # the library raises its own exception type
        raise ConfigError(f"data.tokenizer.path: {path} is not a tokenizer file: {err}") from None
    return SubwordTokenizer(tok, f"tokenizer file {path}")


def train_bpe(docs: Sequence[bytes], vocab_size: int) -> SubwordTokenizer:
    """A byte-level BPE (GPT-2 style: any text encodes, nothing is unknown) trained on docs."""
    tk = _tokenizers_module()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (d.decode("utf-8", errors="replace") for d in docs)
    tok.train_from_iterator(texts, trainer, length=len(docs))
    return SubwordTokenizer(tok, f"byte-level BPE trained on the corpus (vocabSize {vocab_size})")


def make_tokenizer(spec: TokenizerSpec, train_docs: Sequence[bytes]) -> Tokenizer:
    """The tokenizer data.tokenizer asks for; a BPE is trained on `train_docs`."""
    if spec.type == "file":
        assert spec.path is not None  # the spec validates that file comes with a path
        return load_tokenizer_file(spec.path)
    if spec.type == "bpe":
        return train_bpe(train_docs, spec.vocab_size)
    return ByteTokenizer()
