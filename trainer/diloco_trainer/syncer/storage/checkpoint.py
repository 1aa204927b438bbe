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

Integrity: the manifest records each file's size and sha256 and a sha256 of its own content
(``integrity``). A checkpoint is valid when every listed file is there with its size and hash,
the manifest matches its hash, the tensors load and are finite (a poisoned state is never
resumed). ``load_newest_valid`` starts from the newest valid checkpoint and reports the corrupt
ones; pruning never deletes a valid checkpoint while keeping a corrupt one: corrupt ones are set
aside (renamed ``corrupt-ckpt-...``, kept for inspection, never loaded or counted). Checkpoints
written before integrity was recorded load without the hash checks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch

from diloco_trainer.api.manifest import CheckpointManifest
from diloco_trainer.core import payloads

log = logging.getLogger("diloco.checkpoint")

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
PREFIX = "ckpt-"
TMP_PREFIX = ".tmp-ckpt-"
WEIGHTS_FILE = "weights.safetensors"
OUTER_FILE = "outer.safetensors"
MANIFEST_FILE = "manifest.json"
PUBLISHED_FILE = "published.safetensors"
CORRUPT_PREFIX = "corrupt-"
# Checkpoints newer than the best after the quality guard ended a job (their weights rose).
ROSE_PREFIX = "rose-"
INTEGRITY_KEY = "integrity"
_HASH_CHUNK = 1 << 20


class FileTensors(MutableMapping[str, torch.Tensor]):
    """The tensors of a safetensors file, each read from it when asked for (a resume then holds
    one checkpoint tensor at a time beside the model, not the three files); deleting a name
    only forgets it. Tensors set here are kept in memory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with safetensors.safe_open(str(path), framework="pt") as f:
            self._names = dict.fromkeys(f.keys())
        self._set: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._set:
            return self._set[name]
        if name not in self._names:
            raise KeyError(name)
        with safetensors.safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(name)

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._names[name] = None
        self._set[name] = value

    def __delitem__(self, name: str) -> None:
        del self._names[name]
        self._set.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def clear(self) -> None:
        """Forget every tensor (without reading them, as MutableMapping's would)."""
        self._names.clear()
        self._set.clear()

    def __len__(self) -> int:
        return len(self._names)


@dataclass
class Checkpoint:
    """A loaded checkpoint: `manifest` is manifest.json as stored (its hashes are over these
    bytes), `document` the same typed (api/manifest.CheckpointManifest), which readers use."""

    path: Path
    weights: MutableMapping[str, torch.Tensor]  # read a tensor at a time (FileTensors)
    momentum: MutableMapping[str, torch.Tensor]
    manifest: dict[str, Any]
    document: CheckpointManifest
    published: MutableMapping[str, torch.Tensor] | None = None  # θ_pub, when kept apart

    @property
    def outer_step(self) -> int:
        return int(self.manifest["outerStep"])


def checkpoint_name(outer_step: int) -> str:
    """Directory name of the checkpoint at `outer_step` (sorts by step as text)."""
    return f"{PREFIX}{outer_step:09d}"


def outer_step_of(path: Path) -> int:
    """The outer step a checkpoint directory's name says (checkpoint_name's inverse)."""
    return int(path.name.removeprefix(PREFIX))


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


# Bytes written (and hashed) at a time: large enough for the disk, small enough that the copy
# of a non-contiguous tensor stays small.
_WRITE_CHUNK = 64 * 2**20


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Write tensors as a safetensors file straight from their memory (no copy of them first,
    no interpreter lock held for the bytes: file writes and sha256 release it), hashing the
    bytes as they are written; returns {bytes, sha256} as _file_digest would."""
    h = hashlib.sha256()
    size = _write_file(path, tensors, h.update)
    return {"bytes": size, "sha256": h.hexdigest()}


def write_tensors_unhashed(path: Path, tensors: Mapping[str, torch.Tensor]) -> int:
    """write_tensors without the digest, for files nothing verifies (the publisher's spilled
    updates: a chain built from them carries θ_pub's own checksum): sha256 of a 64-252 MB
    update cost its worker thread as long as the write. Returns the bytes written."""
    return _write_file(path, tensors, None)


def _write_file(
    path: Path, tensors: Mapping[str, torch.Tensor], seen: Callable[[Any], None] | None
) -> int:
    """The safetensors file of `tensors` at `path`, each chunk also given to `seen`."""
    layout = payloads.body_layout(tensors, {})
    with path.open("wb") as f:
        f.write(layout.prefix)
        if seen is not None:
            seen(layout.prefix)
        for name in layout.order:
            raw = payloads.tensor_bytes(tensors[name])
            for start in range(0, raw.numel(), _WRITE_CHUNK):
                piece = raw[start : start + _WRITE_CHUNK].numpy().data
                f.write(piece)
                if seen is not None:
                    seen(piece)
    return len(layout.prefix) + layout.data_bytes


def save_checkpoint(
    state_dir: Path,
    *,
    outer_step: int,
    weights: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    manifest: Mapping[str, Any],
    keep: int,
    published: Mapping[str, torch.Tensor] | None = None,
    protect: Path | None = None,
) -> Path:
    """Write a checkpoint atomically, then keep only the newest `keep`; returns its directory.

    `manifest` is stored with formatVersion and outerStep added. A checkpoint at the same outer
    step as an existing one replaces it. `published` (θ_pub) is written only when given.
    `protect`: a checkpoint the pruning neither counts nor deletes (the quality guard's best).
    """
    root = state_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=root))
    try:
        parts = {WEIGHTS_FILE: weights, OUTER_FILE: momentum}
        if published is not None:
            parts[PUBLISHED_FILE] = published
        # Streamed from the tensors given (the live ones, the caller keeping them still) and
        # hashed as written.
        digests = {name: write_tensors(tmp / name, part) for name, part in parts.items()}
        files = list(parts)
        doc = {**manifest, "formatVersion": FORMAT_VERSION, "outerStep": outer_step}
        doc[INTEGRITY_KEY] = {"files": digests, "manifest": _manifest_hash(doc)}
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
    prune_checkpoints(state_dir, keep, protect=protect)
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


def prune_checkpoints(state_dir: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` intact checkpoints, `protect` (when given) neither
    counted nor deleted; returns the deleted directories.

    A checkpoint whose files do not match its manifest (sizes; the hashes are checked at load)
    is set aside, not counted: a corrupt newer one never pushes a valid one out.
    """
    if keep < 1:
        raise ValueError(f"syncer.checkpoint.keep must be >= 1, got {keep}")
    intact = []
    for path in list_checkpoints(state_dir):
        problem = quick_problem(path)
        if problem is None:
            intact.append(path)
        else:
            log.error(
                "checkpoint %s is corrupt (%s); set aside as %s",
                path,
                problem,
                set_aside(path).name,
            )
    doomed = [p for p in intact if p != protect]
    doomed = doomed[:-keep]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def set_aside(path: Path, prefix: str = CORRUPT_PREFIX) -> Path:
    """Rename a checkpoint to <prefix><name> (never loaded, pruned or overwritten): a corrupt
    one, or one the quality guard would not keep (`set_aside_after`)."""
    target = path.with_name(prefix + path.name)
    n = 1
    while target.exists():
        target = path.with_name(f"{prefix}{path.name}.{n}")
        n += 1
    path.rename(target)
    return target


def set_aside_after(state_dir: Path, outer_step: int) -> list[Path]:
    """Set aside (ROSE_PREFIX) every checkpoint of an outer step after `outer_step`: after the
    quality guard kept the best of that step, the newest checkpoint on disk is the best, so a
    restart resumes from it and `diloco export` of the state dir takes it. Returns the new
    paths."""
    return [
        set_aside(p, ROSE_PREFIX)
        for p in list_checkpoints(state_dir)
        if outer_step_of(p) > outer_step
    ]


def clean_partial(state_dir: Path) -> list[Path]:
    """Remove the temporary directories a crash left behind (a checkpoint being written lives
    under TMP_PREFIX until it is complete); returns them."""
    root = state_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    partial = [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def without_manifest(state_dir: Path) -> list[Path]:
    """Checkpoint directories without a manifest, oldest first. The syncer never leaves one (it
    renames a checkpoint into place only once complete), so one is a damaged checkpoint or
    someone else's files: set aside and reported, never deleted."""
    root = state_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and not (p / MANIFEST_FILE).is_file()
    )


def _file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _manifest_hash(doc: Mapping[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != INTEGRITY_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_manifest(path: Path) -> dict[str, Any]:
    doc = json.loads((path / MANIFEST_FILE).read_text())
    if not isinstance(doc, dict):
        raise ValueError("manifest.json is not a JSON object")
    return doc


def quick_problem(path: Path) -> str | None:
    """What is wrong with a checkpoint that a quick look sees (manifest readable and matching
    its hash, each listed file there with its size), or None."""
    try:
        manifest = _read_manifest(path)
    except (OSError, ValueError) as err:
        return f"manifest.json is unreadable: {err}"
    integrity = manifest.get(INTEGRITY_KEY)
    if integrity is None:
        return None  # written before integrity was recorded
    if not isinstance(integrity, dict) or integrity.get("manifest") != _manifest_hash(manifest):
        return "manifest.json does not match its recorded hash"
    for name, want in (integrity.get("files") or {}).items():
        file = path / str(name)
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != want.get("bytes"):
            return f"{name} has {file.stat().st_size} bytes, the manifest says {want.get('bytes')}"
    return None


def _check_hashes(path: Path, manifest: Mapping[str, Any]) -> None:
    integrity = manifest.get(INTEGRITY_KEY)
    if integrity is None:
        return
    problem = quick_problem(path)
    if problem is not None:
        raise ValueError(problem)
    for name, want in (integrity.get("files") or {}).items():
        if _file_digest(path / str(name))["sha256"] != want.get("sha256"):
            raise ValueError(f"{name} does not match its recorded sha256")


def _check_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{what} {name!r} holds NaN or Inf")


def load_checkpoint(path: Path) -> Checkpoint:
    """Load one checkpoint directory; ValueError when it is unreadable, of another format, does
    not match its recorded hashes, its manifest is not a CheckpointManifest, or it holds
    NaN/Inf."""
    try:
        manifest = _read_manifest(path)
    except Exception as err:  # OSError, JSON errors
        raise ValueError(f"checkpoint {path} is unreadable: {err}") from None
    if manifest.get("formatVersion") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format {manifest.get('formatVersion')!r}, "
            f"this syncer reads {FORMAT_VERSION}"
        )
    try:
        _check_hashes(path, manifest)
        weights = FileTensors(path / WEIGHTS_FILE)
        momentum = FileTensors(path / OUTER_FILE)
        published = None
        if (path / PUBLISHED_FILE).is_file():
            published = FileTensors(path / PUBLISHED_FILE)
        for what, tensors in (("weight", weights), ("momentum", momentum)):
            _check_finite(tensors, what)
        _check_finite(published or {}, "published weight")
        document = CheckpointManifest.from_json(manifest)  # DocumentError: a ValueError
    except Exception as err:  # OSError, hash, shape or finiteness problems, safetensors' errors
        raise ValueError(f"checkpoint {path} is unreadable: {err}") from None
    return Checkpoint(
        path=path,
        weights=weights,
        momentum=momentum,
        manifest=manifest,
        document=document,
        published=published,
    )


@dataclass
class Loaded:
    """What load_newest_valid found: the newest valid checkpoint, and the corrupt ones newer
    than it (every one when none is valid), with what is wrong with each."""

    checkpoint: Checkpoint | None
    corrupt: list[tuple[Path, str]]


def load_newest_valid(state_dir: Path) -> Loaded:
    """The newest valid checkpoint (after cleaning partial ones) and the corrupt ones: those
    tried before it, and every checkpoint directory without a manifest; nothing is renamed or
    deleted but the syncer's own temporaries (the caller decides)."""
    for path in clean_partial(state_dir):
        log.warning("removed incomplete checkpoint %s", path)
    corrupt = [(p, f"{p.name} has no {MANIFEST_FILE}") for p in without_manifest(state_dir)]
    for path in reversed(list_checkpoints(state_dir)):
        try:
            return Loaded(load_checkpoint(path), corrupt)
        except ValueError as err:
            log.warning("%s; trying an older checkpoint", err)
            corrupt.append((path, str(err)))
    return Loaded(None, corrupt)


def load_latest(state_dir: Path) -> Checkpoint | None:
    """The newest valid checkpoint (after cleaning partial ones), or None: a corrupt newer one
    is skipped with a warning in favour of an older one."""
    return load_newest_valid(state_dir).checkpoint


def spec_hash(spec_json: str) -> str:
    """A short hash of the job spec JSON, stored in manifests to notice a changed spec."""
    return hashlib.sha256(spec_json.encode()).hexdigest()[:16]
