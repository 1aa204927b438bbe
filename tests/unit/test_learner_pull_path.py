"""The path of a merge from the syncer's answer to the training thread (issue 45, K = M's waits):
a chain's receipt is made ready in its rebuild's worker thread, only once the chain matched the
syncer's checksum; the trim runs after the result is handed on, one at a time; each receipt's
log line says where the pull went (PullPath), and bench.studies.km_waits splits a wait by it."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import pytest
import torch
from diloco_trainer.core.published import apply_updates
from diloco_trainer.learner import syncer_link
from diloco_trainer.learner.fragment_state import FragmentState
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.learner.syncer_link import HeldFragment, PullPath, SyncerLink, _Once
from torch import Tensor

from bench.studies.km_waits import drift, receipts_and_waits, split_run, split_wait

from .test_learner_pull_in_place import chain_for, small_base


@pytest.fixture
def link() -> Iterator[SyncerLink]:
    """A learner's link whose syncer is never called."""
    made = SyncerLink(SyncerClient("http://127.0.0.1:9", "tok"), island="island-0", replicas=1)
    yield made
    made.close(leave=False)


class Recorder:
    """A receipt preparer that keeps a copy of what it was given and the thread it ran on."""

    def __init__(self) -> None:
        self.seen: dict[str, Tensor] | None = None
        self.thread: int | None = None

    def __call__(self, tensors: Mapping[str, Tensor]) -> None:
        self.seen = {n: t.clone() for n, t in tensors.items()}
        self.thread = threading.get_ident()


def test_a_chain_s_receipt_is_made_ready_in_its_rebuild_only_once_it_matches(
    link: SyncerLink,
) -> None:
    base = small_base()
    chain = chain_for(base, "int8")
    want = apply_updates(base, chain.updates, "int8")
    state = FragmentState(names=list(base), version=0, base=base)
    recorder = Recorder()
    once = _Once(recorder)
    held = HeldFragment(0, base, None, state.base_writer())
    _, tensors, checksum = link._apply(held, chain, once)
    assert all(tensors[n] is base[n] for n in base)  # added in place
    assert checksum == chain.checksum and once.ran
    assert recorder.seen is not None and recorder.thread == threading.get_ident()  # same call
    assert all(torch.equal(recorder.seen[n], want[n]) for n in want)  # the rebuilt weights

    # A base one value off: the chain fails its checksum, nothing is prepared (the full pull
    # that follows is prepared on its own).
    other = small_base()
    other["a"].view(-1)[7] += 1e-3
    refused = _Once(Recorder())
    _, _, checksum = link._apply(HeldFragment(0, other, None, None), chain, refused)
    assert checksum != chain.checksum and not refused.ran


def test_trims_run_after_the_sync_one_at_a_time_and_once_more_for_those_asked_meanwhile(
    link: SyncerLink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three trims asked for while the first runs: two run in all, one after the other."""
    running, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_trim() -> None:
        calls.append(len(calls))
        running.set()
        assert release.wait(10)

    monkeypatch.setattr(syncer_link, "trim", slow_trim)

    async def ask() -> None:
        link._trim_soon()

    link.submit(ask()).result(5)
    assert running.wait(10)
    for _ in range(3):
        link.submit(ask()).result(5)
    assert calls == [0]  # the first still runs; the others wait for it
    release.set()

    async def settled() -> None:
        task = link._trim_task
        assert task is not None
        await task

    link.submit(settled()).result(10)
    assert calls == [0, 1]


def test_a_pull_path_s_answer_is_its_ready_time_less_its_parts() -> None:
    path = PullPath(pull=0.25, pull_bytes=73048, rebuild=0.05, prepare=0.01, ready_at=100.0)
    assert path.answered_at == pytest.approx(100.0 - 0.25 - 0.05 - 0.01)  # 99.69
    assert path.describe() == (
        "pull 0.250s (73048 bytes), rebuild 0.050s, receipt ready 0.010s, ready at 100.000"
    )


def test_a_wait_is_cut_at_its_merge_s_marks_clipped_and_in_order() -> None:
    # Wait 10.0-11.0; marks before it, crossing (10.1 after 10.2: two clocks) and after it.
    parts = split_wait(10.0, 11.0, [9.5, 10.2, 10.1, 10.5, 12.0])
    assert parts == pytest.approx([0.0, 0.2, 0.0, 0.3, 0.5, 0.0])
    assert sum(parts) == pytest.approx(1.0)


LOG = """\
2026-11-29 21:06:31,040 INFO island-0/0 diloco.learner: step 77: waited 0.500s for fragment 1 (x)
2026-11-29 21:06:31,041 INFO island-0/0 diloco.learner: step 77: fragment 1 applied version 2 \
(merged, 0.30s after the push; 0.001s on the training thread; pull 0.100s (7000 bytes), rebuild \
0.020s, receipt ready 0.010s, ready at {ready})
"""


def test_km_waits_splits_a_wait_by_its_merge_s_path() -> None:
    from datetime import datetime

    end = datetime.strptime("2026-11-29 21:06:31,040", "%Y-%m-%d %H:%M:%S,%f").timestamp()
    start = end - 0.5
    text = LOG.format(ready=f"{end - 0.01:.3f}")
    receipts, waits = receipts_and_waits(text)
    assert [(w.fragment, w.version, w.seconds) for w in waits] == [(1, 2, 0.5)]
    r = receipts[(1, 2)]
    assert r.apply == pytest.approx(0.03) and r.pull == pytest.approx(0.1)
    # The merge: last push 0.1 s into the wait, taken 0.05 s later, pullable 0.05 s after that.
    merge = {
        "time": start + 0.15,
        "mergeSeconds": 0.05,
        "contributors": [{"receivedAt": start + 0.02}, {"receivedAt": start + 0.1}],
    }
    first = {"time": start - 9, "mergeSeconds": 0.0, "contributors": [{"receivedAt": start - 9}]}
    s = split_run({(1, 1): first, (1, 2): merge}, [text])
    # answered = ready - apply - pull = end - 0.01 - 0.03 - 0.1 = start + 0.36; pull ends
    # at start + 0.46, ready at start + 0.49, the wait ends at start + 0.5.
    assert s.waits == pytest.approx(
        {
            "peer": 0.1,
            "fold": 0.05,
            "merge": 0.05,
            "answer": 0.16,
            "pull": 0.1,
            "apply": 0.03,
            "hand-over": 0.01,
        },
        abs=2e-3,  # the log's stamps are to the ms
    )
    assert s.waited == pytest.approx(0.5)
    assert s.first == 0.0 and s.first_peer == 0.0
    # The same wait for the fragment's first merge (no earlier one): left out of the parts,
    # counted in `first`, of it 0.1 s before the last push arrived (the slowest peer).
    alone = split_run({(1, 2): merge}, [text])
    assert alone.waited == 0.0
    assert alone.first == pytest.approx(0.5)
    assert alone.first_peer == pytest.approx(0.1, abs=2e-3)


def test_km_waits_drift_reads_the_start_up_offset_apart_from_later_spreads() -> None:
    # Three merges of two islands: the first 2.0 s apart (b started late; a waits for it),
    # then 0.1 s and 0.3 s, b last in both; a's steps 10 ms, b's 12 ms (windows after the
    # first).
    pushes = {
        "a": {(0, 0): 10.0, (1, 0): 12.165, (0, 1): 12.33},
        "b": {(0, 0): 12.0, (1, 0): 12.265, (0, 1): 12.63},
    }
    window = "20 steps: {t}s training, 0.0s sync path, 0.0s waiting for the syncer\n"
    logs = {
        "a": window.format(t=9.9) + window.format(t=0.2) * 2,
        "b": window.format(t=9.9) + window.format(t=0.24) * 2,
    }
    d = drift(pushes, logs)
    assert d.first_spread == pytest.approx(2.0)
    assert d.spreads == pytest.approx([0.1, 0.3])
    assert d.last_shares == {"a": 0.0, "b": 1.0}
    assert d.step_times == pytest.approx({"a": 0.010, "b": 0.012})
    # Gaps between an island's pushes: a 2.165, 0.165; b 0.265, 0.365: median 0.315 s over
    # the median step 0.011 s; the speed gap 2 ms a step over those steps.
    assert d.steps_between == pytest.approx(0.315 / 0.011)
    assert d.speed_spread == pytest.approx(0.002 * 0.315 / 0.011)
