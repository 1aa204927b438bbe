"""Reading a corpus's documents: which files, which are text, JSON Lines and Parquet records.

A directory source is walked in a deterministic order (sorted relative paths). Every file is a
candidate unless `data.include` patterns narrow them; a candidate is read as
- JSON Lines (one document per record's `data.textField`) when it is named *.jsonl / *.ndjson
  (optionally .gz) or `data.format` is jsonl,
- Parquet (one document per row of the `data.textField` column) when it is named *.parquet or
  `data.format` is parquet,
- text otherwise, when its first SNIFF_BYTES are UTF-8 without a NUL byte: text is recognised by
  content, not by a list of suffixes, so extensionless files (LICENSE, Apache-2.0) are read.
Every file not read is listed with the reason, for the log and for the "no text" error.

The documents are then split into train and held-out eval documents (split_documents). Nothing
here imports torch: a process can read a corpus (and train its tokenizer) before it needs any.
"""

from __future__ import annotations

import codecs
import fnmatch
import gzip
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diloco_trainer.api.spec import ConfigError

BUILTIN_STDLIB = "builtin:stdlib-text"
EVAL_EVERY = 10  # every 10th document is held out for evaluation
EVAL_FRACTION = 0.1  # share of bytes held out when there are too few documents
# Skipped when walking the stdlib: third-party code, and test suites with large binary-ish data.
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
DOC_SEPARATOR = b"\n\n"  # between documents in a split, so no window silently joins two texts
SNIFF_BYTES = 8192  # prefix inspected to decide whether a file is text
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet",)
# Never corpus content: byte-code caches and version-control metadata.
SKIP_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn"})
PARQUET_BATCH_ROWS = 4096


@dataclass
class Documents:
    """The documents of a source in order, and what was read or skipped (for the log)."""

    docs: list[bytes] = field(default_factory=list)
    read: list[str] = field(default_factory=list)  # "path", or "path (N jsonl records)"
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why)

    def summary(self, source: str, limit: int = 20) -> str:
        """One paragraph: the files read and skipped (why), the first `limit` of each by name."""
        size = sum(len(d) for d in self.docs)
        text = (
            f"data.source {source}: read {len(self.read)} file(s), {len(self.docs)} document(s), "
            f"{size:,} bytes: {_listing(self.read, limit)}; skipped {len(self.skipped)}"
        )
        if self.skipped:
            text += ": " + _listing([f"{p} ({why})" for p, why in self.skipped], limit)
        return text

    def brief(self, source: str, limit: int = 3) -> str:
        """summary() without the names of the files read: one line for a console."""
        size = sum(len(d) for d in self.docs)
        text = (
            f"data.source {source}: read {len(self.read):,} file(s), {len(self.docs):,} "
            f"document(s), {size:,} bytes; skipped {len(self.skipped)}"
        )
        if self.skipped:
            text += ": " + _listing([f"{p} ({why})" for p, why in self.skipped], limit)
        return text


def _listing(items: Sequence[str], limit: int) -> str:
    more = len(items) - limit
    return ", ".join(items[:limit]) + (f" and {more} more" if more > 0 else "")


def matches(rel: str, patterns: Sequence[str]) -> bool:
    """Whether a relative path is chosen by the patterns: one with '/' matches the whole path,
    one without matches the file name (as in .gitignore); no patterns choose every file."""
    if not patterns:
        return True
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel if "/" in p else name, p) for p in patterns)


def walk(
    root: Path, patterns: Sequence[str], skip_dirs: frozenset[str] = SKIP_DIRS
) -> tuple[list[Path], int]:
    """Files under root chosen by the patterns, sorted by relative path, and how many were not
    chosen. Hidden directories and skip_dirs are not entered."""
    found: list[Path] = []
    left_out = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of skipped trees, which is most of the time saved.
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        for f in filenames:
            path = Path(dirpath, f)
            if matches(path.relative_to(root).as_posix(), patterns):
                found.append(path)
            else:
                left_out += 1
    return sorted(found, key=lambda p: p.relative_to(root).as_posix()), left_out


def not_text_reason(prefix: bytes) -> str | None:
    """Why a file starting with `prefix` is not text (None when it is): a NUL byte, or bytes that
    are not UTF-8. A multi-byte character cut at the end of the prefix is fine."""
    if b"\x00" in prefix:
        return "binary: NUL byte"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(prefix, final=False)
    except UnicodeDecodeError as err:
        return f"not UTF-8 (byte {err.start})"
    return None


def file_format(path: Path, fmt: str) -> str:
    """text, jsonl or parquet: the data.format, or with auto the file's suffix."""
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _jsonl_lines(path: Path) -> Iterator[bytes]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rb") as f:
        yield from f


def jsonl_documents(path: Path, text_field: str) -> tuple[list[bytes], int]:
    """Each record's `text_field` string as a document, and how many records had none.

    A line that is not JSON is an error naming the file and line: a corpus with a broken record
    is better fixed than silently shortened."""
    docs: list[bytes] = []
    missing = 0
    for number, line in enumerate(_jsonl_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ConfigError(
                f"data.source: {path} line {number} is not JSON ({err}); data.format reads it "
                "as JSON Lines"
            ) from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if isinstance(text, str):
            if text:
                docs.append(text.encode())
        else:
            missing += 1
    return docs, missing


def parquet_documents(path: Path, text_field: str) -> tuple[list[bytes], int]:
    """Each row's `text_field` string as a document, and how many rows had none (null)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"data.source: {path} is Parquet, which needs pyarrow: "
            "pip install 'diloco-operator[trainer]'"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own error types for a broken file
        raise ConfigError(f"data.source: {path} is not a Parquet file: {err}") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise ConfigError(
            f"data.textField: {path} has no column {text_field!r} (columns: {', '.join(names)})"
        )
    docs: list[bytes] = []
    missing = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str):
                if text:
                    docs.append(text.encode())
            elif isinstance(text, bytes):  # a binary column holding UTF-8 text
                if text:
                    docs.append(text)
            else:
                missing += 1
    return docs, missing


def _read_records(path: Path, name: str, kind: str, text_field: str, out: Documents) -> None:
    reader = jsonl_documents if kind == "jsonl" else parquet_documents
    docs, missing = reader(path, text_field)
    if not docs:
        why = f"no record with a non-empty string {text_field!r} (data.textField)"
        out.skipped.append((name, why))
        return
    out.docs.extend(docs)
    note = f", {missing} without {text_field!r}" if missing else ""
    out.read.append(f"{name} ({len(docs)} {kind} records{note})")


def _read_text(path: Path, name: str, out: Documents, *, sniff: bool) -> None:
    with path.open("rb") as f:
        head = f.read(SNIFF_BYTES)
        why = "empty" if not head else not_text_reason(head) if sniff else None
        if why is not None:  # a binary file is not read past its prefix
            out.skipped.append((name, why))
            return
        out.docs.append(head + f.read())
    out.read.append(name)


def read_files(
    files: Sequence[Path],
    *,
    fmt: str,
    text_field: str,
    sniff: bool = True,
    root: Path | None = None,
) -> Documents:
    """The documents of `files` in order; files that hold none are listed as skipped.

    `sniff=False` reads a text file whatever its content (a file the user named itself). Files
    are named relative to `root` in the lists (errors name the full path)."""
    out = Documents()
    for path in files:
        kind = file_format(path, fmt)
        name = path.relative_to(root).as_posix() if root is not None else str(path)
        try:
            if kind == "text":
                _read_text(path, name, out, sniff=sniff)
            else:
                _read_records(path, name, kind, text_field, out)
        except OSError as err:
            raise ConfigError(f"data.source: cannot read {path}: {err.strerror or err}") from None
    return out


def _refuse_binary(path: Path) -> None:
    """ConfigError naming data.source when the file `path` does not start as text."""
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as err:
        raise ConfigError(f"data.source: cannot read {path}: {err.strerror or err}") from None
    why = not_text_reason(head)
    if why is not None:
        raise ConfigError(
            f"data.source: {path} is not text ({why}); name a text file, a directory of them, "
            "or JSON Lines / Parquet records (data.format)"
        )


def read_source(
    source: str, *, include: Sequence[str] = (), fmt: str = "auto", text_field: str = "text"
) -> Documents:
    """The documents data.source names; ConfigError (naming the field and path) when none."""
    sniff = True
    left_out = 0
    root: Path | None = None
    if source == BUILTIN_STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files, left_out = walk(root, include or ["*.py"], _STDLIB_SKIP_DIRS)
        sniff = False  # the stdlib's sources are text; read them as always
    elif source.startswith("builtin:"):
        raise ConfigError(
            f"data.source: unknown built-in corpus {source!r} (available: {BUILTIN_STDLIB})"
        )
    else:
        path = Path(source)
        if path.is_file():
            # A file the user named is refused when it is not text: training on an executable
            # or an archive's bytes is never meant, and would otherwise go on without a word.
            chosen = matches(path.name, include)
            if chosen and file_format(path, fmt) == "text":
                _refuse_binary(path)
            files, left_out, sniff = ([path] if chosen else []), int(not chosen), False
        elif path.is_dir():
            files, left_out = walk(path, include)
            root = path
        else:
            problem = "is neither a file nor a directory" if path.exists() else "does not exist"
            raise ConfigError(f"data.source: {source!r} {problem}")
    docs = read_files(files, fmt=fmt, text_field=text_field, sniff=sniff, root=root)
    if not docs.docs:
        why = [f"{p} ({reason})" for p, reason in docs.skipped[:20]]
        if left_out:
            why.append(f"{left_out} file(s) not chosen by data.include {list(include)}")
        detail = "; ".join(why) if why else "no files"
        raise ConfigError(f"data.source: {source!r} contains no text: {detail}")
    return docs


def split_documents(docs: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(train, eval) documents: every EVAL_EVERY-th document held out, or with too few documents
    the last EVAL_FRACTION of their bytes."""
    if len(docs) >= 2 * EVAL_EVERY:
        # Hold out whole documents: eval text then never overlaps a training window.
        held = [d for i, d in enumerate(docs) if i % EVAL_EVERY == EVAL_EVERY // 2]
        kept = [d for i, d in enumerate(docs) if i % EVAL_EVERY != EVAL_EVERY // 2]
        return kept, held
    joined = DOC_SEPARATOR.join(docs)
    cut = len(joined) - int(len(joined) * EVAL_FRACTION)
    return [joined[:cut]], [joined[cut:]]
