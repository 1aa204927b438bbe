"""Syncer checkpoints: global weights, outer momentum and counters, written atomically.

Layout under ``state_dir/checkpoints/``::

    ckpt-000012/            one directory per checkpoint, named by outer step (zero-padded)
      weights.safetensors   the fp32 global weights (θ_exact, what the outer optimizer steps)
      outer.safetensors     the outer optimizer's momentum buffers
      published.safetensors the weights learners hold (θ_pub), only with compressed pulls
      manifest.json         versions per fragment, outerStep, tokens, evalHistory, islands,
                            push answers (retried pushes), ...

A checkpoint without published.safetensors (written with sync.pullCompression none, or by an older
syncer) loads with `published` None: the syncer then publishes θ_exact.

A checkpoint is written into a hidden temporary directory, every file and the directory are
fsynced, and only then is it renamed to its final name (a rename within one filesystem is atomic),
so a crash leaves either the complete new checkpoint or none: loaders see only complete ones and
remove leftover temporary directories. manifest.json is written last, and a directory without it
is never loaded. Only safetensors and JSON: nothing is pickled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

log = logging.getLogger("diloco.checkpoint")

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
PREFIX = "ckpt-"
TMP_PREFIX = ".tmp-ckpt-"
WEIGHTS_FILE = "weights.safetensors"
OUTER_FILE = "outer.safetensors"
MANIFEST_FILE = "manifest.json"
PUBLISHED_FILE = "published.safetensors"


@dataclass
class Checkpoint:
    """A loaded checkpoint."""

    path: Path
    weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    manifest: dict[str, Any]
    published: dict[str, torch.Tensor] | None = None  # θ_pub, when it was kept apart

    @property
    def outer_step(self) -> int:
        return int(self.manifest["outerStep"])


def checkpoint_name(outer_step: int) -> str:
    """Directory name of the checkpoint at `outer_step` (sorts by step as text)."""
    return f"{PREFIX}{outer_step:09d}"


def state_digest(
    weights: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    published: Mapping[str, torch.Tensor] | None = None,
) -> str:
    """sha256 over every weight and momentum tensor (name, dtype, shape and bytes), by name, and
    the published weights when they are kept apart from the exact ones.

    Two syncers with equal digests hold bit-identical global state.
    """
    h = hashlib.sha256()
    parts = [("weights", weights), ("momentum", momentum)]
    if published is not None:
        parts.append(("published", published))
    for label, tensors in parts:
        h.update(label.encode())
        for name in sorted(tensors):
            t = tensors[name].detach().contiguous().cpu()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owned(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses views and shared storage; a clone owns its memory.
    return {n: t.detach().contiguous().clone() for n, t in tensors.items()}


def save_checkpoint(
    state_dir: Path,
    *,
    outer_step: int,
    weights: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    manifest: Mapping[str, Any],
    keep: int,
    published: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write a checkpoint atomically, then keep only the newest `keep`; returns its directory.

    `manifest` is stored with formatVersion and outerStep added. A checkpoint at the same outer
    step as an existing one replaces it. `published` (θ_pub) is written only when given.
    """
    root = state_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=root))
    try:
        safetensors.torch.save_file(_owned(weights), str(tmp / WEIGHTS_FILE))
        safetensors.torch.save_file(_owned(momentum), str(tmp / OUTER_FILE))
        files = [WEIGHTS_FILE, OUTER_FILE]
        if published is not None:
            safetensors.torch.save_file(_owned(published), str(tmp / PUBLISHED_FILE))
            files.append(PUBLISHED_FILE)
        doc = {**manifest, "formatVersion": FORMAT_VERSION, "outerStep": outer_step}
        (tmp / MANIFEST_FILE).write_text(json.dumps(doc, indent=1, sort_keys=True))
        for name in (*files, MANIFEST_FILE):
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        final = root / checkpoint_name(outer_step)
        if final.exists():
            # Same step written again (e.g. after a restart): move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=root))
            final.rename(old / "old")
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(state_dir, keep)
    return final


def list_checkpoints(state_dir: Path) -> list[Path]:
    """Complete checkpoint directories (manifest present), oldest first."""
    root = state_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    dirs = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and (p / MANIFEST_FILE).is_file()
    ]
    return sorted(dirs, key=lambda p: p.name)


def prune_checkpoints(state_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; returns the deleted directories."""
    if keep < 1:
        raise ValueError(f"syncer.checkpoint.keep must be >= 1, got {keep}")
    doomed = list_checkpoints(state_dir)[:-keep]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def clean_partial(state_dir: Path) -> list[Path]:
    """Remove temporary directories a crash left behind; returns them."""
    root = state_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    partial = [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]
    partial += [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and not (p / MANIFEST_FILE).is_file()
    ]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def load_checkpoint(path: Path) -> Checkpoint:
    """Load one checkpoint directory; ValueError when it is unreadable or of another format."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        weights = safetensors.torch.load_file(str(path / WEIGHTS_FILE))
        momentum = safetensors.torch.load_file(str(path / OUTER_FILE))
        published = None
        if (path / PUBLISHED_FILE).is_file():
            published = safetensors.torch.load_file(str(path / PUBLISHED_FILE))
    except Exception as err:  # OSError, JSON errors, safetensors' own errors
        raise ValueError(f"checkpoint {path} is unreadable: {err}") from None
    if manifest.get("formatVersion") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format {manifest.get('formatVersion')!r}, "
            f"this syncer reads {FORMAT_VERSION}"
        )
    return Checkpoint(
        path=path, weights=weights, momentum=momentum, manifest=manifest, published=published
    )


def load_latest(state_dir: Path) -> Checkpoint | None:
    """The newest loadable checkpoint (after cleaning partial ones), or None.

    An unreadable newest checkpoint is skipped with a warning in favour of an older one.
    """
    for path in clean_partial(state_dir):
        log.warning("removed incomplete checkpoint %s", path)
    for path in reversed(list_checkpoints(state_dir)):
        try:
            return load_checkpoint(path)
        except ValueError as err:
            log.warning("%s; trying an older checkpoint", err)
    return None


def spec_hash(spec_json: str) -> str:
    """A short hash of the job spec JSON, stored in manifests to notice a changed spec."""
    return hashlib.sha256(spec_json.encode()).hexdigest()[:16]


def append_jsonl(path: Path, entry: Mapping[str, Any]) -> None:
    """Append one JSON line and flush it to the OS (the merge log)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        with contextlib.suppress(OSError):
            os.fsync(f.fileno())
