"""θ_pub's update history off the syncer's heap (syncer/serving/update_history.py, publisher.py):
the newest update in memory and served with no copy (and written ahead to its file), the older ones
only in files, deleted as they leave,
chains of 1, 2 and 3 updates byte for byte what payloads.encode_update_chain_buffer gives, and a
learner rebuilding from them holds θ_pub bit for bit."""

from __future__ import annotations

import dataclasses
import gc
import logging
import weakref
from pathlib import Path

import numpy
import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.core import payloads
from diloco_trainer.core.published import WeightUpdate, apply_updates, weights_checksum
from diloco_trainer.syncer.service.startup import HISTORY_DIR
from diloco_trainer.syncer.serving.update_history import SpilledUpdateHistory, chain_body

from .test_published import outer_steps
from .test_syncer import FakeClock, run, started
from .test_syncer_pull import chain_of, copy, merge_rounds, pull_spec

META = {protocol.META_KIND: protocol.KIND_UPDATES, protocol.META_CODEC: "int8"}


def appended(history: SpilledUpdateHistory, updates: list[WeightUpdate]) -> None:
    """Append each update and run its file work at once (the publisher runs it in a thread)."""
    for u in updates:
        history.append(u)()


def test_update_history_keeps_the_newest_in_memory_and_the_older_on_disk(tmp_path: Path) -> None:
    _, updates, _ = outer_steps("int8", rounds=5)
    history = SpilledUpdateHistory(3, tmp_path / "h")
    appended(history, updates[:1])
    # The newest stays in memory, and is written ahead (its memory goes when a newer comes).
    assert history.held_bytes() == updates[0].nbytes and len(history.files()) == 1
    appended(history, updates[1:])
    # Versions 3, 4, 5 kept: 5 in memory, 3 and 4 only in files; the files of 1 and 2 are gone.
    assert [u.version for u in history.updates] == [3, 4, 5]
    assert history.held_bytes() == updates[4].nbytes
    assert [u.encoded() is None for u in history.updates] == [True, True, False]
    on_disk = sorted((tmp_path / "h").iterdir())
    assert on_disk == sorted(history.files()) and len(on_disk) == 3
    assert sorted(p.name.split("-")[0] for p in on_disk) == ["3", "4", "5"]
    history.clear()()
    assert list((tmp_path / "h").iterdir()) == [] and not history.updates


def test_a_superseded_update_is_let_go_in_the_housekeeping_not_on_the_loop(
    tmp_path: Path,
) -> None:
    """append runs on the event loop; the memory of the update it supersedes (already in its
    file) must be freed by the file work it returns, which runs in a worker thread: freeing
    64-252 MB on the loop held up every pull for 10-40 ms."""
    _, updates, _ = outer_steps("int8", rounds=2)
    history = SpilledUpdateHistory(3, tmp_path)
    own = [
        dataclasses.replace(u, encoded={k: t.clone() for k, t in u.encoded.items()})
        for u in updates
    ]
    first = weakref.ref(next(iter(own[0].encoded.values())))
    history.append(own[0])()  # its file written: only the history holds its tensors now
    second = own[1]
    del own
    housekeeping = history.append(second)
    gc.collect()
    assert first() is not None  # superseded, but still held by the work not yet run
    assert history.updates[0].encoded() is None  # the history itself holds it no more
    housekeeping()
    gc.collect()
    assert first() is None


def test_update_history_restarts_after_a_gap_and_deletes_the_files(tmp_path: Path) -> None:
    _, updates, _ = outer_steps("int8", rounds=4)
    history = SpilledUpdateHistory(3, tmp_path)
    appended(history, updates[:2])  # 1 on disk, 2 in memory and on disk
    assert len(list(tmp_path.iterdir())) == 2
    appended(history, updates[3:])  # version 3 missing: 1 and 2 cannot be chained to 4
    assert [u.version for u in history.updates] == [4]
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == ["4"]
    assert history.chain(1, 4, full_bytes=10**9) is None


@pytest.mark.parametrize("directory", [True, False])
def test_update_history_chains_are_the_buffer_encoders_bytes(
    tmp_path: Path, directory: bool
) -> None:
    published, updates, _ = outer_steps("int8", rounds=5)
    history = SpilledUpdateHistory(3, tmp_path if directory else None)
    appended(history, updates)
    assert len(history.files()) == (3 if directory else 0)
    assert history.held_bytes() == (
        updates[4].nbytes if directory else sum(u.nbytes for u in updates[2:])
    )
    for have, length in ((4, 1), (3, 2), (2, 3)):
        chain = history.chain(have, 5, full_bytes=10**9)
        assert chain is not None and [u.version for u in chain] == list(range(have + 1, 6))
        meta = {**META, protocol.META_CHECKSUM: chain[-1].checksum}
        body = chain_body(chain, meta)
        want = payloads.encode_update_chain_buffer(
            [(u.version, u.encoded) for u in updates[have:]], meta
        )
        assert bytes(body) == bytes(want) and len(body) == len(want)
        # A learner holding θ_pub at `have` rebuilds version 5 bit for bit, checksum and all.
        tensors, got_meta = payloads.decode_body(bytes(body))
        received = payloads.split_update_chain(tensors, have, 5)
        assert len(received) == length
        rebuilt = apply_updates(published[have], received, "int8")
        assert all(torch.equal(rebuilt[n], published[5][n]) for n in rebuilt)
        assert weights_checksum(rebuilt) == got_meta[protocol.META_CHECKSUM] == updates[4].checksum


def test_update_history_serves_the_newest_update_from_its_own_tensors(tmp_path: Path) -> None:
    _, updates, _ = outer_steps("int8", rounds=2)
    history = SpilledUpdateHistory(3, tmp_path)
    appended(history, updates)
    chain = history.chain(1, 2, full_bytes=10**9)
    assert chain is not None
    body = chain_body(chain, META)
    # No copy: the body's data parts are the update's own tensors' memory.
    own = {t.data_ptr() for t in updates[1].encoded.values() if t.numel()}
    parts = {numpy.asarray(p).__array_interface__["data"][0] for p in body.parts}
    assert parts == own


def test_update_history_keeps_an_update_in_memory_when_its_file_cannot_be_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # a file where the directory should be: every write fails
    _, updates, _ = outer_steps("int8", rounds=3)
    history = SpilledUpdateHistory(3, blocker / "h")
    with caplog.at_level(logging.WARNING, logger="diloco.syncer"):
        appended(history, updates)
    assert "kept in memory" in caplog.text
    assert history.held_bytes() == sum(u.nbytes for u in updates)
    chain = history.chain(0, 3, full_bytes=10**9)
    assert chain is not None
    want = payloads.encode_update_chain_buffer([(u.version, u.encoded) for u in updates], META)
    assert bytes(chain_body(chain, META)) == bytes(want)


def test_update_history_an_update_that_left_while_spilling_leaves_no_file(
    tmp_path: Path,
) -> None:
    _, updates, _ = outer_steps("int8", rounds=4)
    history = SpilledUpdateHistory(2, tmp_path)
    work = [history.append(u) for u in updates]
    for w in work:  # the file work runs late: versions 1 and 2 left before their spills ran
        w()
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["3", "4"]
    assert [u.version for u in history.updates] == [3, 4]
    assert history.held_bytes() == updates[3].nbytes
    history.clear()()
    # A chain whose older update's file went before it was read: OSError (a full pull).
    history = SpilledUpdateHistory(2, tmp_path)
    appended(history, updates[:2])
    chain = history.chain(0, 2, full_bytes=10**9)
    assert chain is not None
    history.append(updates[2])()  # version 1 leaves: its file goes
    with pytest.raises(OSError):
        chain_body(chain, META)


def test_syncer_history_on_disk_serves_chains_and_is_emptied_at_start(tmp_path: Path) -> None:
    spec = pull_spec()

    async def scenario() -> tuple[list[dict[str, torch.Tensor]], dict[int, bytes], object, int]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        held = [copy(syncer.model.published, syncer.fragments[0])]
        await merge_rounds(syncer, 4, held)
        await syncer.publisher.housekeeping_done()
        newest = syncer.publisher.history[0].updates[-1]
        bodies = {}
        for have in (1, 2, 3):
            got = await syncer.pull(0, after=have, wait=0, have=have)
            assert got is not None
            bodies[have] = got
        one = bodies[3]
        bodies = {h: bytes(b) for h, b in bodies.items()}  # type: ignore[arg-type]
        await syncer.stop()
        return held, bodies, one, newest.nbytes

    held, bodies, one, newest_bytes = run(scenario())
    files = sorted((tmp_path / HISTORY_DIR / "fragment-0").iterdir())
    assert sorted(p.name.split("-")[0] for p in files) == ["2", "3", "4"]  # 1 left
    assert isinstance(one, payloads.SplitBody) and len(one) < newest_bytes + 2**16
    for have, length in ((1, 3), (2, 2), (3, 1)):
        meta, chain = chain_of(bodies[have])
        assert len(chain) == length
        rebuilt = apply_updates(held[have], chain, "int8")
        assert all(torch.equal(rebuilt[n], held[4][n]) for n in rebuilt)
        assert weights_checksum(rebuilt) == meta[protocol.META_CHECKSUM]

    # A restart: the files of the old process's versions go, and it serves no chain from them.
    async def restarted() -> bytes | None:
        syncer = await started(spec, tmp_path, FakeClock())
        assert not any((tmp_path / HISTORY_DIR).glob("**/*.safetensors"))
        got = await syncer.pull(0, after=-1, wait=0, have=3)
        await syncer.stop()
        return None if got is None else bytes(got)  # type: ignore[arg-type]

    full = run(restarted())
    assert full is not None
    assert protocol.read_metadata(full)[protocol.META_KIND] == protocol.KIND_FULL


def test_update_history_of_one_update_writes_no_file(tmp_path: Path) -> None:
    # fp16 and bf16 keep one update (core/published.history_length): no chain ever needs a file.
    _, updates, _ = outer_steps("fp16", rounds=3)
    history = SpilledUpdateHistory(1, tmp_path)
    appended(history, updates)
    assert list(tmp_path.iterdir()) == [] and history.held_bytes() == updates[2].nbytes


# The chain rule (moved from core/published.UpdateHistory, which this history replaced).


def bare_update(version: int, nbytes: int = 10) -> WeightUpdate:
    return WeightUpdate(version=version, encoded={}, nbytes=nbytes, checksum=f"c{version}")


def test_published_history_evicts_old_updates_so_far_behind_gets_full() -> None:
    history = SpilledUpdateHistory(3, None)
    for v in range(1, 6):
        history.append(bare_update(v))
    # Kept: 3, 4, 5. A learner at 2 needs 3..5: served; one at 1 needs 2..5: 2 was evicted.
    chain = history.chain(2, 5, full_bytes=1000)
    assert chain is not None and [u.version for u in chain] == [3, 4, 5]
    assert history.chain(1, 5, full_bytes=1000) is None
    # Only up to the published version, even when a newer update is already kept.
    chain = history.chain(3, 4, full_bytes=1000)
    assert chain is not None and [u.version for u in chain] == [4]
    assert history.chain(5, 5, full_bytes=1000) is None  # nothing newer
    assert history.chain(-1, 5, full_bytes=1000) is None  # holds nothing
    assert history.chain(7, 5, full_bytes=1000) is None  # ahead (syncer restarted)


def test_published_history_sends_a_chain_only_when_smaller_than_the_fragment() -> None:
    history = SpilledUpdateHistory(5, None)
    for v in range(1, 4):
        history.append(bare_update(v, nbytes=30))
    assert history.chain(2, 3, full_bytes=100) is not None  # 30 < 100
    assert history.chain(0, 3, full_bytes=100) is not None  # 90 < 100
    assert history.chain(0, 3, full_bytes=90) is None  # 90 is not smaller than 90


def test_published_history_restarts_after_a_gap() -> None:
    history = SpilledUpdateHistory(5, None)
    history.append(bare_update(1))
    history.append(bare_update(3))  # version 2 missing: 1 cannot be chained to 3
    assert [u.version for u in history.updates] == [3]
    assert history.chain(0, 3, full_bytes=1000) is None
