"""Deprecated: the first release's `diloco_trainer.data`, kept so a user's `build` that did
`from diloco_trainer.data import Batch` still imports. The public module is
`diloco_trainer.parts` (Batch, TrainingParts, lm_loss); the corpus and stream helpers are
`diloco_trainer.models.data`'s."""

from __future__ import annotations

import warnings

from diloco_trainer.models.data import (
    BUILTIN_STDLIB,
    EVAL_EVERY,
    EVAL_FRACTION,
    Batch,
    Corpus,
    TokenStream,
    corpus_for,
    eval_batches,
    load_corpus,
)

warnings.warn(
    "diloco_trainer.data is deprecated: import Batch from diloco_trainer.parts (the corpus "
    "helpers are in diloco_trainer.models.data)",
    DeprecationWarning,
    stacklevel=2,
)

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
