"""θ_pub's recent updates of one fragment, as the publisher keeps them: the newest in memory, the
older ones in files.

A learner that holds version V pulls with `have=V` and gets the updates V+1..W (an update chain,
core/published.py) instead of the full fragment, when every one is kept and together they are
smaller (core/published.history_length: 3 kept with int8 and the default staleness). Every
learner at K = M asks for the newest update alone, so that one stays in memory, as the encoded
tensors the merge made: the one-update chain is served from them after a prefix
(payloads.update_body), no copy. The older ones are only for a learner that lags, so each is
written to a file under the syncer's state dir as soon as it is kept (`spill`: a worker thread,
from the tensors' memory by checkpoint.write_tensors_unhashed, after its merge) and its memory
let go the moment a newer one is kept (`supersede`: no write to wait for then; the memory is
freed in the housekeeping's worker thread, not on the loop); it is read back
straight into a chain body's buffer when such a learner asks (`chain_body`: a worker thread),
and its file is deleted when it leaves the history. So a fragment's history costs one update
of memory (int8: 0.26/F x), not three. With a history of one (fp16, bf16) nothing is written.
Without a directory, or when a file cannot be written (a full disk: logged), an update stays in
memory, as pending pushes do (folding.py).

Synchronous and thread-safe: `append` and `clear` run on the event loop and return the file
work (`Housekeeping`) for the caller to run in a worker thread; spills, reads and deletions may
overlap, so an update that leaves the history while its file is being written deletes the file
once written, and a chain whose file went meanwhile is not built (the puller gets the full
fragment).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from diloco_trainer.api.protocol import UPDATE_SEPARATOR
from diloco_trainer.core import payloads
from diloco_trainer.core.published import WeightUpdate
from diloco_trainer.syncer.storage import write_tensors_unhashed

log = logging.getLogger("diloco.syncer")

# File work of a history, to run in a worker thread (append, clear).
Housekeeping = Callable[[], None]


class KeptUpdate:
    """One kept update: its encoded tensors in memory (the newest), in a file once spilled,
    or both (the newest, spilled ahead of its next one)."""

    def __init__(self, update: WeightUpdate) -> None:
        self.version = update.version
        self.nbytes = update.nbytes
        self.checksum = update.checksum
        # The encoded tensors' names, dtypes and shapes (what the file holds), on the meta device.
        self.layout = {
            k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in update.encoded.items()
        }
        self._encoded: Mapping[str, torch.Tensor] | None = update.encoded
        self.path: Path | None = None
        self._left = False  # it left the history: no file may stay behind
        self._superseded = False  # a newer update came: its memory goes once it has a file
        self._lock = threading.Lock()  # held briefly, never for a file's bytes

    def encoded(self) -> Mapping[str, torch.Tensor] | None:
        """The encoded tensors when in memory (never write them: bodies serve them), else None."""
        return self._encoded

    def spill(self, directory: Path) -> None:
        """Write the encoded tensors to a file in `directory` (a worker thread), let go of their
        memory once superseded; on an OSError (logged) they stay in memory."""
        with self._lock:
            encoded = self._encoded
            if self._left or encoded is None:
                return
        path = directory / f"{self.version}-{uuid.uuid4().hex}.safetensors"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            write_tensors_unhashed(path, encoded)
        except OSError as err:
            log.warning("update %d of θ_pub kept in memory (%s)", self.version, err)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return
        with self._lock:
            if not self._left:
                self.path = path
                if self._superseded:
                    self._encoded = None
                return
        path.unlink(missing_ok=True)  # it left the history while being written

    def supersede(self) -> Mapping[str, torch.Tensor] | None:
        """A newer update came (on the loop, quick): the memory goes now if the file is written,
        else once it is (bodies being served keep theirs). Returns the tensors it let go of now,
        for the caller to drop in a worker thread: freeing an update's memory blocks the thread
        that does it (munmap: 10-40 ms at 64-252 MB), and on the loop that held up pulls."""
        with self._lock:
            self._superseded = True
            if self.path is None:
                return None
            released, self._encoded = self._encoded, None
        return released

    def leave(self) -> Path | None:
        """It left the history (on the loop, quick): its file, to delete, if it has one."""
        with self._lock:
            self._left = True
            path, self.path = self.path, None
        return path

    def read_into(self, views: Mapping[str, torch.Tensor]) -> None:
        """Copy each encoded tensor into `views[key]` (a worker thread: from memory, or read from
        its file straight into the view); OSError when its file is gone or short."""
        with self._lock:
            encoded, path = self._encoded, self.path
        if encoded is not None:
            for key, view in views.items():
                view.copy_(encoded[key])
            return
        if path is None:
            raise FileNotFoundError(f"update {self.version} left the history")
        layout = payloads.body_layout(self.layout, {})  # as write_tensors_unhashed wrote it
        start = len(layout.prefix)
        with path.open("rb") as f:
            for key, view in views.items():
                begin, end = layout.offsets[key]
                f.seek(start + begin)
                if (
                    end > begin
                    and f.readinto(payloads.tensor_bytes(view).numpy().data) != end - begin
                ):
                    raise OSError(f"{path}: short read of {key}")


class SpilledUpdateHistory:
    """The last `maxlen` updates of one fragment, oldest first: the newest in memory, the others
    in files under `directory` (None: every one in memory)."""

    def __init__(self, maxlen: int, directory: Path | None) -> None:
        if maxlen < 1:
            raise ValueError(f"update history length must be >= 1, got {maxlen}")
        self.directory = directory
        self.updates: deque[KeptUpdate] = deque()
        self.maxlen = maxlen

    def append(self, update: WeightUpdate) -> Housekeeping:
        """Keep `update`, which must follow the newest kept one (else the history restarts);
        returns the file work: the new one to its file (when older ones are kept), the files of
        those that left deleted. The previous newest lets go of its memory."""
        left = []
        if self.updates and update.version != self.updates[-1].version + 1:
            left = list(self.updates)
            self.updates.clear()
        # What leaves memory now is let go in the housekeeping's thread, not here on the loop.
        released: list[object] = [self.updates[-1].supersede()] if self.updates else []
        newest = KeptUpdate(update)
        self.updates.append(newest)
        while len(self.updates) > self.maxlen:
            left.append(self.updates.popleft())
        files = [p for p in (u.leave() for u in left) if p is not None]
        released.extend(left)
        return lambda: self._housekeep(newest if self.maxlen > 1 else None, files, released)

    def clear(self) -> Housekeeping:
        """Forget every update; returns the deletion of their files."""
        files = [p for p in (u.leave() for u in self.updates) if p is not None]
        released: list[object] = list(self.updates)
        self.updates.clear()
        return lambda: self._housekeep(None, files, released)

    def _housekeep(
        self, spill: KeptUpdate | None, files: Sequence[Path], released: list[object]
    ) -> None:
        released.clear()  # the last references to memory that left the history (see append)
        for path in files:
            path.unlink(missing_ok=True)
        if spill is not None and self.directory is not None:
            spill.spill(self.directory)

    def chain(self, have: int, version: int, full_bytes: int) -> list[KeptUpdate] | None:
        """Updates have+1..version when every one is kept and together they are smaller than
        `full_bytes`; else None (send the full fragment)."""
        if have < 0 or have >= version:
            return None
        kept = {u.version: u for u in self.updates}
        chain = [kept.get(v) for v in range(have + 1, version + 1)]
        picked = [u for u in chain if u is not None]
        if len(picked) != len(chain) or sum(u.nbytes for u in picked) >= full_bytes:
            return None
        return picked

    def held_bytes(self) -> int:
        """Bytes of the kept updates in memory (tests, the benchmark)."""
        return sum(u.nbytes for u in self.updates if u.encoded() is not None)

    def files(self) -> list[Path]:
        """The files of the kept updates (tests)."""
        return [u.path for u in self.updates if u.path is not None]


def chain_body(chain: Sequence[KeptUpdate], metadata: Mapping[str, Any]) -> payloads.SplitBody:
    """The update-chain body of `chain` (oldest first): the newest alone served from its own
    tensors when in memory (no copy); else one new buffer that every update is copied or read
    into (a worker thread). Byte for byte payloads.encode_update_chain_buffer's."""
    if len(chain) == 1 and (encoded := chain[0].encoded()) is not None:
        return payloads.update_body(chain[0].version, encoded, metadata)
    name = "{}" + UPDATE_SEPARATOR + "{}"
    template = {name.format(u.version, k): t for u in chain for k, t in u.layout.items()}
    data, views = payloads.body_data(template)
    for u in chain:
        u.read_into({k: views[name.format(u.version, k)] for k in u.layout})
    return payloads.split_body(data, template, metadata)
