"""The `data` section of the job spec: where the tokens come from and how text becomes tokens
(torch-free; spec.py assembles the whole spec and re-exports these)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from diloco_trainer.api.base import SpecModel

DataFormat = Literal["auto", "text", "jsonl", "parquet"]
TokenizerType = Literal["bytes", "file", "bpe"]
IncludePattern = Annotated[
    str, Field(min_length=1, description="A shell-style pattern (*, ?, [...]).")
]


class TokenizerSpec(SpecModel):
    """How text becomes tokens; the model's vocabulary follows it."""

    type: TokenizerType = Field(
        "bytes",
        description="bytes: one token per byte (256 tokens, nothing to ship); file: a "
        "Hugging Face tokenizers JSON file (path); bpe: a byte-level BPE trained on the train "
        "split with vocabSize tokens (deterministic: every process trains the same one).",
    )
    path: str | None = Field(
        None, min_length=1, description="tokenizer.json readable in the pod (type file)."
    )
    vocab_size: int = Field(
        4096, ge=256, le=1_048_576, description="Tokens of the trained BPE (type bpe)."
    )

    @model_validator(mode="after")
    def _path_with_file(self) -> TokenizerSpec:
        if (self.type == "file") != (self.path is not None):
            raise ValueError("path is required with type file, and only then")
        return self


class DataSpec(SpecModel):
    """Where the tokens come from."""

    source: str = Field(
        "builtin:stdlib-text",
        min_length=1,
        description="'builtin:stdlib-text' (the Python standard library's source, byte-level, no "
        "download) or a path readable in the pod: a file, or a directory whose files are read "
        "when their content is text (UTF-8, no NUL byte), or JSON Lines / Parquet (format).",
    )
    include: list[IncludePattern] = Field(
        default_factory=list,
        description="Shell-style patterns choosing the files of a directory source: a pattern "
        "with '/' matches the path relative to source, one without matches the file name (e.g. "
        "'*.txt', 'Apache-*', 'shard-*/*.jsonl'). Empty: every file.",
    )
    format: DataFormat = Field(
        "auto",
        description="auto: .jsonl/.ndjson (also .gz) as JSON Lines, .parquet as Parquet, other "
        "files as text when their content is; or text, jsonl, parquet for every file.",
    )
    text_field: str = Field(
        "text", min_length=1, description="The field of JSON Lines records / Parquet column read."
    )
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    eval_tokens: int = Field(
        32768, ge=1024, description="Held-out tokens used for every evaluation."
    )
    seed: int = Field(0, ge=0, description="Seed for shard shuffling.")
