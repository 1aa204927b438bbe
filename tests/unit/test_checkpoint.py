"""Syncer checkpoints: atomic layout, pruning, partial-directory cleanup, digests, and integrity:
damaged or poisoned checkpoints are never loaded and never kept over valid ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diloco_trainer.syncer.storage import checkpoint as ck


def tensors(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    weights = {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g)}
    momentum = {"a.weight": torch.randn(4, 3, generator=g)}
    return weights, momentum


def save(tmp_path: Path, step: int, seed: int = 0, keep: int = 3) -> Path:
    weights, momentum = tensors(seed)
    return ck.save_checkpoint(
        tmp_path,
        outer_step=step,
        weights=weights,
        momentum=momentum,
        manifest={"versions": [step], "tokens": 10 * step},
        keep=keep,
    )


def test_checkpoint_roundtrip_keeps_tensors_and_manifest(tmp_path: Path) -> None:
    path = save(tmp_path, 7, seed=1)
    assert path.name == "ckpt-000000007"
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None
    weights, momentum = tensors(1)
    assert loaded.outer_step == 7
    assert loaded.manifest["versions"] == [7]
    assert loaded.manifest["formatVersion"] == ck.FORMAT_VERSION
    assert ck.state_digest(loaded.weights, loaded.momentum) == ck.state_digest(weights, momentum)


def test_checkpoint_keeps_published_weights_when_given(tmp_path: Path) -> None:
    weights, momentum = tensors(1)
    published = {n: t + 1e-3 for n, t in weights.items()}
    path = ck.save_checkpoint(
        tmp_path / "pub",
        outer_step=3,
        weights=weights,
        momentum=momentum,
        manifest={"versions": [3]},
        keep=2,
        published=published,
    )
    assert (path / ck.PUBLISHED_FILE).is_file()
    loaded = ck.load_latest(tmp_path / "pub")
    assert loaded is not None and loaded.published is not None
    assert all(torch.equal(loaded.published[n], t) for n, t in published.items())
    assert ck.state_digest(weights, momentum, published) != ck.state_digest(weights, momentum)
    # Without them (pull codec none, or an older syncer) the checkpoint has no such file.
    save(tmp_path / "plain", 3)
    plain = ck.load_latest(tmp_path / "plain")
    assert plain is not None and plain.published is None


def test_checkpoint_prunes_to_keep_newest(tmp_path: Path) -> None:
    for step in range(1, 6):
        save(tmp_path, step, keep=2)
    names = [p.name for p in ck.list_checkpoints(tmp_path)]
    assert names == ["ckpt-000000004", "ckpt-000000005"]


def test_checkpoint_cleans_its_temporaries_and_reports_one_without_a_manifest(
    tmp_path: Path,
) -> None:
    """A crash's temporary directory is removed; a ckpt-* directory without a manifest (the
    syncer never leaves one) is kept and reported as corrupt, not deleted (issue 22, 8)."""
    save(tmp_path, 3)
    root = tmp_path / ck.CHECKPOINTS_DIR
    (root / f"{ck.TMP_PREFIX}crashed").mkdir()
    (root / f"{ck.TMP_PREFIX}crashed" / ck.WEIGHTS_FILE).write_bytes(b"half")
    odd = root / ck.checkpoint_name(9)
    odd.mkdir()
    (odd / ck.WEIGHTS_FILE).write_bytes(b"someone's weights")
    found = ck.load_newest_valid(tmp_path)
    assert found.checkpoint is not None and found.checkpoint.outer_step == 3
    assert found.corrupt == [(odd, "ckpt-000000009 has no manifest.json")]
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000003", "ckpt-000000009"]
    assert (odd / ck.WEIGHTS_FILE).read_bytes() == b"someone's weights"


def test_checkpoint_falls_back_when_newest_is_corrupt(tmp_path: Path) -> None:
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    (newest / ck.WEIGHTS_FILE).write_bytes(b"not safetensors")
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None and loaded.outer_step == 1


def test_checkpoint_refuses_other_format(tmp_path: Path) -> None:
    path = save(tmp_path, 1)
    doc = json.loads((path / ck.MANIFEST_FILE).read_text())
    doc["formatVersion"] = 99
    (path / ck.MANIFEST_FILE).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="format 99"):
        ck.load_checkpoint(path)


def test_checkpoint_same_step_replaces(tmp_path: Path) -> None:
    save(tmp_path, 4, seed=1)
    save(tmp_path, 4, seed=2)
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None
    assert ck.state_digest(loaded.weights, loaded.momentum) == ck.state_digest(*tensors(2))
    assert len(ck.list_checkpoints(tmp_path)) == 1
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_checkpoint_digest_sees_one_changed_value() -> None:
    weights, momentum = tensors(0)
    before = ck.state_digest(weights, momentum)
    momentum["a.weight"][0, 0] += 1e-6
    assert ck.state_digest(weights, momentum) != before


def test_checkpoint_empty_state_dir_has_none(tmp_path: Path) -> None:
    assert ck.load_latest(tmp_path) is None


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "missing", "manifest"])
def test_checkpoint_damaged_newest_is_skipped_and_reported(tmp_path: Path, damage: str) -> None:
    save(tmp_path, 1, seed=1)
    newest = save(tmp_path, 2, seed=2)
    weights = newest / ck.WEIGHTS_FILE
    raw = bytearray(weights.read_bytes())
    if damage == "truncated":
        weights.write_bytes(raw[:-7])
    elif damage == "bit-flipped":
        raw[-1] ^= 0x80  # tensor data: still a loadable safetensors file, with another value
        weights.write_bytes(bytes(raw))
    elif damage == "missing":
        weights.unlink()
    else:
        doc = json.loads((newest / ck.MANIFEST_FILE).read_text())
        doc["versions"] = [99]
        (newest / ck.MANIFEST_FILE).write_text(json.dumps(doc))
    found = ck.load_newest_valid(tmp_path)
    assert found.checkpoint is not None and found.checkpoint.outer_step == 1
    assert [p for p, _ in found.corrupt] == [newest]
    assert ck.state_digest(found.checkpoint.weights, found.checkpoint.momentum) == (
        ck.state_digest(*tensors(1))
    )


def test_checkpoint_with_non_finite_tensors_is_never_loaded(tmp_path: Path) -> None:
    weights, momentum = tensors(0)
    weights["a.weight"][0, 0] = float("-inf")
    ck.save_checkpoint(
        tmp_path, outer_step=1, weights=weights, momentum=momentum, manifest={}, keep=2
    )
    found = ck.load_newest_valid(tmp_path)
    assert found.checkpoint is None and "NaN or Inf" in found.corrupt[0][1]


def test_checkpoint_pruning_never_keeps_corrupt_over_valid(tmp_path: Path) -> None:
    # Two corrupt newer-named checkpoints (a restart went back to step 1): writing steps 2 and
    # 3 again must keep the new valid ones and set the corrupt ones aside, not delete the new.
    save(tmp_path, 1, keep=2)
    for step in (5, 6):
        (save(tmp_path, step, keep=5) / ck.WEIGHTS_FILE).write_bytes(b"junk")
    save(tmp_path, 2, keep=2)
    save(tmp_path, 3, keep=2)
    names = sorted(p.name for p in (tmp_path / ck.CHECKPOINTS_DIR).iterdir())
    assert names == [
        "ckpt-000000002",
        "ckpt-000000003",
        ck.CORRUPT_PREFIX + "ckpt-000000005",
        ck.CORRUPT_PREFIX + "ckpt-000000006",
    ]
    loaded = ck.load_latest(tmp_path)
    assert loaded is not None and loaded.outer_step == 3


def test_checkpoint_every_one_corrupt_is_reported_not_loaded(tmp_path: Path) -> None:
    for path in [save(tmp_path, step) for step in (1, 2)]:
        (path / ck.OUTER_FILE).write_bytes(b"")
    found = ck.load_newest_valid(tmp_path)
    assert found.checkpoint is None and len(found.corrupt) == 2
    assert len(ck.list_checkpoints(tmp_path)) == 2  # the caller decides what to do with them


def test_checkpoint_files_are_streamed_from_the_tensors_and_hashed_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_tensors writes what safetensors writes (tensors by dtype size, then name), in
    pieces of _WRITE_CHUNK bytes (made small here: many pieces per tensor), from the tensors'
    own memory; its sha256 and size are those of the file on disk."""
    import hashlib

    import safetensors.torch

    monkeypatch.setattr(ck, "_WRITE_CHUNK", 1000)
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(40, 60, generator=gen)
    tensors = {
        "w": torch.randn(123, 45, generator=gen),
        "view": base[:, :7],  # not contiguous
        "half": torch.randn(77, generator=gen).half(),
        "empty": torch.zeros(0),
    }
    path = tmp_path / "t.safetensors"
    digest = ck.write_tensors(path, tensors)
    raw = path.read_bytes()
    assert digest == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    reference = tmp_path / "ref.safetensors"
    safetensors.torch.save_file({n: t.contiguous() for n, t in tensors.items()}, str(reference))
    assert raw == reference.read_bytes()
    loaded = safetensors.torch.load_file(str(path))
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t)
    # The unhashed writer (spilled updates and pending pushes) writes the same bytes.
    unhashed = tmp_path / "u.safetensors"
    assert ck.write_tensors_unhashed(unhashed, tensors) == len(raw)
    assert unhashed.read_bytes() == raw
