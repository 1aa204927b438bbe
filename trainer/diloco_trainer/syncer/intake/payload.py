"""A push's payload as it arrives: its still-encoded tensors, read as the decoded
pseudo-gradient one tensor (or slice) at a time, never decoded whole (the guards measure it,
the fold reads it, folding.py may spill it to a file once folded)."""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from diloco_trainer.core.compress import decode_tensor, decoded_slices, expected_encoded
from diloco_trainer.core.fold import abs_max, largest
from diloco_trainer.syncer.storage import write_tensors_unhashed


class EncodedPayload(Mapping[str, torch.Tensor]):
    """A checked push's encoded tensors, read as its decoded pseudo-gradient one tensor at a time
    (each read decodes again: nothing decoded is kept). Once folded it may be spilled to a file
    (`spill`), read back a tensor at a time; the file goes with the payload."""

    def __init__(
        self, flat: Mapping[str, torch.Tensor], codec: str, expected: Mapping[str, torch.Size]
    ) -> None:
        self.flat = dict(flat)
        self.codec = codec
        self.expected = dict(expected)
        self.path: Path | None = None
        self._nbytes = sum(t.numel() * t.element_size() for t in self.flat.values())

    def spill(self, directory: Path) -> None:
        """Move the encoded tensors to a file in `directory` (a worker thread: written from
        their memory), so a pending push holds no memory while its round stays open."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{uuid.uuid4().hex}.safetensors"
        write_tensors_unhashed(path, self.flat)
        weakref.finalize(self, path.unlink, missing_ok=True)
        self.path, self.flat = path, {}

    def _encoded(self, name: str) -> Mapping[str, torch.Tensor]:
        """The encoded tensors of `name` (from the file once spilled)."""
        if self.path is None:
            return self.flat
        keys = expected_encoded({name: self.expected[name]}, self.codec)
        with safe_open(str(self.path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in keys}

    def __getitem__(self, name: str) -> torch.Tensor:
        return decode_tensor(self._encoded(name), name, self.codec, self.expected[name])

    def slices(self, name: str) -> Iterator[tuple[slice, torch.Tensor]]:
        """`name` decoded a slice at a time (compress.decoded_slices: one slice's buffer)."""
        yield from decoded_slices(self._encoded(name), name, self.codec, self.expected[name])

    # ----- core/fold.SlicedVectors: folded a slice at a time, with no decoded copy ------------

    def shapes(self) -> Mapping[str, torch.Size]:
        return self.expected

    def device(self, name: str) -> torch.device:
        return torch.device("cpu")

    def whole(self, name: str) -> torch.Tensor:
        return self[name]

    def add_to(self, name: str, acc: torch.Tensor, alpha: float) -> float:
        flat, amax = acc.view(-1), 0.0
        for sl, piece in self.slices(name):
            part = flat[sl].add_(piece, alpha=alpha)
            amax = largest(amax, abs_max(part))  # in cache: the merge check's value (fold.py)
        return amax

    def __iter__(self) -> Iterator[str]:
        return iter(self.expected)

    def __len__(self) -> int:
        return len(self.expected)

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded tensors (in memory, or in the file once spilled)."""
        return self._nbytes
