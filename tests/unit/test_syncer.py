"""The syncer engine in-process (no HTTP): merges are reproducible from the merge log, grace with
a fake clock, replacement and retried pushes, finishing on tokens, eval cadence, resume."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.core.merge import merge_pseudo_gradients
from diloco_trainer.core.outer import OuterOptimizer
from diloco_trainer.syncer.intake.validation import fragment_body_limit, parse_push_meta
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.rounds import Refused
from diloco_trainer.syncer.storage import checkpoint as ckpt

T = TypeVar("T")

BASE: dict[str, Any] = {
    "model": {"preset": "gpt-tiny"},
    "data": {"evalTokens": 1024},
    "islands": {"count": 3},
    # batch 8 x seqLen 16: up to 128 tokens a step, what the pushes below claim at most
    "inner": {"steps": 4, "batchSize": 8, "seqLen": 16},
    # fp32 bodies ("none", not the int8 default): these tests check merged values exactly.
    "sync": {
        "quorum": 2,
        "graceSeconds": 5,
        "merge": "tokens",
        "maxStaleness": 2,
        "fragments": 1,
        "compression": "none",
    },
    "stopAfter": {"outerSteps": 100},
    "syncer": {"checkpoint": {"everyOuterSteps": 100}},
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_spec(**sections: dict[str, Any]) -> JobSpec:
    doc = {k: dict(v) for k, v in BASE.items()}
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value}
    return parse_spec(doc)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def started(spec: JobSpec, state_dir: Path, clock: FakeClock) -> Syncer:
    syncer = Syncer(spec, job_name="unit", state_dir=state_dir, clock=clock)
    await syncer.start()
    return syncer


def delta(syncer: Syncer, f: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: 1e-2 * torch.randn(syncer.model.weights[n].shape, generator=g)
        for n in syncer.fragments[f]
    }


def body(syncer: Syncer, f: int, island: str, d: dict[str, torch.Tensor], **meta: Any) -> bytes:
    m = protocol.PushMeta(
        island=island,
        base_version=meta.pop("base", syncer.state.versions[f]),
        tokens=meta.pop("tokens", 100),
        steps=meta.pop("steps", 4),
        loss=meta.pop("loss", 3.0),
        step_time=0.01,
        codec=syncer.codec,
        push_id=meta.pop("push_id", ""),
        kept_steps=meta.pop("kept", 0),
    )
    return payloads.encode_body(encode_tensors(d, syncer.codec), m.to_metadata())


def test_syncer_merge_is_reproducible_from_its_log(tmp_path: Path) -> None:
    async def scenario() -> tuple[Syncer, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        clock = FakeClock()
        syncer = await started(make_spec(), tmp_path, clock)
        initial = {n: t.clone() for n, t in syncer.model.weights.items()}
        deltas = [delta(syncer, 0, s) for s in (1, 2)]
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        await syncer.receive_push(0, body(syncer, 0, "island-0", deltas[0], tokens=300, steps=4))
        clock.now += 0.5
        await syncer.receive_push(0, body(syncer, 0, "island-1", deltas[1], tokens=100, steps=4))
        await syncer.tick()
        assert syncer.state.versions == [0]  # quorum 2 reached, grace 5 s not over
        clock.now += 5.0
        await syncer.tick()
        return syncer, initial, deltas

    syncer, initial, deltas = run(scenario())
    assert syncer.state.versions == [1]
    logged = [json.loads(x) for x in (tmp_path / "merges.jsonl").read_text().splitlines()]
    assert len(logged) == 1
    entry = logged[0]
    assert [c["island"] for c in entry["contributors"]] == ["island-0", "island-1"]
    # tokens × tokens/steps: 300·75 vs 100·25 -> 0.9 / 0.1
    assert [c["weight"] for c in entry["contributors"]] == pytest.approx([0.9, 0.1])
    # When the syncer took each push (learners align their phase on it): 0.5 s apart.
    taken = [c["receivedAt"] for c in entry["contributors"]]
    assert taken[1] - taken[0] == pytest.approx(0.5)
    # Replay: the same merge and outer step on the initial weights give the syncer's weights.
    replay = {n: t.clone() for n, t in initial.items()}
    outer = OuterOptimizer(replay, lr=0.7, momentum=0.9, nesterov=True)
    raw = [c["rawWeight"] for c in entry["contributors"]]
    scales = [c["scale"] for c in entry["contributors"]]
    assert scales == [1.0, 1.0]  # one round of H = 4 steps each
    merged = merge_pseudo_gradients(deltas, raw, "tokens", scales=scales)
    # Two of three active islands, a fresh round each: the merge carries 2/3 of a round, so it
    # moves θ by lr·(2/3)·g and completes no round (no momentum fold, outer step still 0).
    assert entry["fraction"] == pytest.approx(2 / 3)
    assert (entry["rounds"], entry["outerStep"], syncer.state.outer_step) == (0, 0, 0)
    outer.step(merged, entry["fraction"], group=entry["fragment"])
    for name, t in syncer.model.weights.items():
        assert torch.equal(t, replay[name]), name


def test_syncer_replaced_and_retried_pushes_count_once(tmp_path: Path) -> None:
    async def scenario() -> tuple[Syncer, list[dict[str, Any]]]:
        syncer = await started(make_spec(), tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        answers = [
            await syncer.receive_push(
                0, body(syncer, 0, "island-0", delta(syncer, 0, 1), tokens=100)
            ),
            await syncer.receive_push(
                0, body(syncer, 0, "island-0", delta(syncer, 0, 2), tokens=250, push_id="p1")
            ),
            await syncer.receive_push(
                0, body(syncer, 0, "island-0", delta(syncer, 0, 2), tokens=250, push_id="p1")
            ),
        ]
        for i in (1, 2):
            await syncer.receive_push(0, body(syncer, 0, f"island-{i}", delta(syncer, 0, 9 + i)))
        await syncer.tick()  # every active island contributed: no grace wait
        return syncer, answers

    syncer, answers = run(scenario())
    assert answers[1]["replaced"] is True
    assert answers[2]["duplicate"] is True and answers[2]["pending"] == answers[1]["pending"]
    assert syncer.state.versions == [1]
    entry = syncer.merge_log.recent[-1].to_json()
    by_island = {c["island"]: c for c in entry["contributors"]}
    assert by_island["island-0"]["tokens"] == 250
    assert entry["tokens"] == 250 + 100 + 100
    assert syncer.tokens == 450


def test_syncer_status_during_a_merge_shows_no_half_done_merge(tmp_path: Path) -> None:
    """A status read while a merge's arithmetic runs in its thread sees the state before the
    merge (version, pending, tokens together), and the state after it once it is done. CI once
    read the new version with the old token count."""

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        syncer = await started(make_spec(), tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
            await syncer.receive_push(
                0, body(syncer, 0, f"island-{i}", delta(syncer, 0, i), tokens=100)
            )
        # Hold the merge inside its worker thread: the only way to read status mid-merge on cue.
        entered, release = threading.Event(), threading.Event()
        real_step = syncer.model.outer.step

        def held_step(merged: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> int:
            entered.set()
            release.wait(30)
            return real_step(merged, *args, **kwargs)

        syncer.model.outer.step = held_step  # type: ignore[method-assign]
        merge = asyncio.create_task(syncer.tick())
        assert await asyncio.to_thread(entered.wait, 30), "the merge never started"
        during = await syncer.status()
        release.set()
        await merge
        return during, await syncer.status()

    during, after = run(scenario())
    assert (during["versions"], during["pending"], during["tokens"]) == ([0], [3], 0)
    assert (after["versions"], after["pending"], after["tokens"]) == ([1], [0], 300)
    assert during["islands"]["island-0"]["mergedTokens"] == 0
    assert after["islands"]["island-0"]["mergedTokens"] == 100


def test_syncer_join_tells_an_island_its_merged_tokens(tmp_path: Path) -> None:
    """A join answers the island's merged tokens (where a restarted learner's data resumes):
    100 for an island whose 100-token push was merged, 0 for one that has not pushed."""

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        clock = FakeClock()
        syncer = await started(make_spec(islands={"count": 4}), tmp_path, clock)
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
            await syncer.receive_push(
                0, body(syncer, 0, f"island-{i}", delta(syncer, 0, i), tokens=100)
            )
        clock.now += 10  # past the grace window the fourth island was awaited for
        await syncer.tick()
        return await syncer.islands.join("island-0", 1), await syncer.islands.join("island-3", 1)

    again, new = run(scenario())
    assert again["versions"] == [1]
    assert again["islandTokens"] == 100 and new["islandTokens"] == 0


def test_syncer_dropping_a_silent_island_completes_the_round(tmp_path: Path) -> None:
    async def scenario() -> Syncer:
        syncer = await started(make_spec(sync={"graceSeconds": 600}), tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        for i in (0, 1):
            await syncer.receive_push(0, body(syncer, 0, f"island-{i}", delta(syncer, 0, i)))
        await syncer.tick()
        assert syncer.state.versions == [0]
        await syncer.islands.set_membership("island-2", "dropped", "pod crash-looping")
        await syncer.tick()
        return syncer

    syncer = run(scenario())
    assert syncer.state.versions == [1]
    status = run(syncer.status())
    assert status["islands"]["island-2"]["state"] == "dropped"
    assert status["islands"]["island-2"]["reason"] == "pod crash-looping"


def test_syncer_refusal_after_decode_changes_nothing(tmp_path: Path) -> None:
    async def scenario() -> tuple[Syncer, str, str]:
        syncer = await started(make_spec(), tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        before = syncer.digest()
        bad = delta(syncer, 0, 1)
        bad[next(iter(bad))] = torch.zeros(2, 2)
        with pytest.raises(Refused) as err:
            await syncer.receive_push(0, body(syncer, 0, "island-0", bad))
        assert err.value.status == 400
        return syncer, before, syncer.digest()

    syncer, before, after = run(scenario())
    assert before == after
    assert syncer.state.rounds[0].pending == {}
    assert syncer.state.membership.islands["island-0"].pushes == 0
    assert syncer.bytes_in == 0


def test_syncer_parse_push_meta_reads_kept_steps_and_takes_none_as_zero() -> None:
    meta = protocol.PushMeta("island-0", 0, 40, 4, 1.0, 0.1, "none", kept_steps=4)
    assert parse_push_meta(meta.to_metadata(), "none").kept_steps == 4  # all of them kept
    older = {k: v for k, v in meta.to_metadata().items() if k != protocol.META_KEPT_STEPS}
    assert parse_push_meta(older, "none").kept_steps == 0  # a learner that does not say


def test_syncer_records_each_pushs_kept_steps_in_the_merge_log(tmp_path: Path) -> None:
    """Two fresh pushes (lag 0) of 4 steps and 100 tokens each: island-0 kept 2 of its steps,
    island-1 all 4. The merge log says so per contributor; nothing else reads them: the merge
    is a fresh one's (momentum share 1, weights 0.5 / 0.5, discount and scale 1, φ 2/3: two of
    three islands, a round each), as without keptSteps."""

    async def scenario() -> Syncer:
        clock = FakeClock()
        syncer = await started(make_spec(), tmp_path, clock)
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 1), kept=2))
        await syncer.receive_push(0, body(syncer, 0, "island-1", delta(syncer, 0, 2), kept=4))
        clock.now += 5.0
        await syncer.tick()
        return syncer

    syncer = run(scenario())
    assert syncer.state.versions == [1]
    (entry,) = [json.loads(x) for x in (tmp_path / "merges.jsonl").read_text().splitlines()]
    assert [c["keptSteps"] for c in entry["contributors"]] == [2, 4]
    assert entry["momentum"] == 1.0
    assert [c["weight"] for c in entry["contributors"]] == pytest.approx([0.5, 0.5])
    assert [c["discount"] for c in entry["contributors"]] == [1.0, 1.0]
    assert [c["scale"] for c in entry["contributors"]] == [1.0, 1.0]
    assert entry["fraction"] == pytest.approx(2 / 3)


def test_syncer_refuses_more_kept_steps_than_a_push_carries_and_changes_nothing(
    tmp_path: Path,
) -> None:
    async def scenario() -> tuple[Syncer, str, str, Refused]:
        syncer = await started(make_spec(), tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        before = syncer.digest()
        with pytest.raises(Refused) as err:
            await syncer.receive_push(
                0, body(syncer, 0, "island-0", delta(syncer, 0, 1), steps=4, kept=5)
            )
        return syncer, before, syncer.digest(), err.value

    syncer, before, after, err = run(scenario())
    assert err.status == 400 and "metadata.keptSteps" in err.message
    assert before == after
    assert syncer.state.rounds[0].pending == {}
    assert syncer.state.membership.islands["island-0"].pushes == 0
    assert syncer.bytes_in == 0


def test_syncer_finishes_on_tokens_with_eval_and_checkpoint(tmp_path: Path) -> None:
    spec = make_spec(
        sync={"quorum": 1, "graceSeconds": 0},
        stopAfter={"outerSteps": None, "tokens": 250},
        # The quality guard off: its best checkpoints are test_syncer_quality_guard.py's.
        syncer={"evalEveryOuterSteps": 2, "qualityGuard": {"patience": 0}},
    )

    async def scenario() -> tuple[Syncer, dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        for r in range(3):
            await syncer.receive_push(
                0, body(syncer, 0, "island-0", delta(syncer, 0, r), tokens=100)
            )
            await syncer.tick()
        late = await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 7)))
        return syncer, late

    syncer, late = run(scenario())
    assert syncer.finished and syncer.tokens == 300
    assert syncer.state.versions == [3]
    # Evaluations: start, every 2 outer steps, and the finish.
    assert [e["outerStep"] for e in syncer.jobs.evaluations.history] == [0, 2, 3]
    assert [e["tokens"] for e in syncer.jobs.evaluations.history] == [0, 200, 300]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [ckpt.checkpoint_name(3)]
    assert late == {
        "accepted": False,
        "finished": True,
        "version": 3,
        "pending": 0,
        "reason": "the job has finished",
        "run": syncer.run,
    }
    pulled = run(_pull_after_finish(syncer))
    assert pulled is not None


async def _pull_after_finish(syncer: Syncer) -> bytes | None:
    # A puller waiting for "newer" gets the final fragment at once when the job has finished.
    body = await syncer.pull(0, after=99, wait=30)
    return None if body is None else bytes(body)


def test_syncer_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    spec = make_spec(
        sync={"quorum": 1, "graceSeconds": 0}, syncer={"checkpoint": {"everyOuterSteps": 2}}
    )

    async def first() -> tuple[str, list[int]]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        for r in range(2):
            await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, r)))
            await syncer.tick()
        await syncer.stop()  # the checkpoint is written in the background
        return syncer.digest(), syncer.state.versions

    async def second() -> Syncer:
        return await started(spec, tmp_path, FakeClock())

    digest, versions = run(first())
    resumed = run(second())
    assert resumed.digest() == digest and resumed.state.versions == versions == [2]
    assert resumed.state.membership.islands["island-0"].joins == 1


def test_syncer_refuses_a_checkpoint_of_another_fragment_layout(tmp_path: Path) -> None:
    spec = make_spec(
        sync={"quorum": 1, "graceSeconds": 0}, syncer={"checkpoint": {"everyOuterSteps": 1}}
    )

    async def first() -> None:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 0)))
        await syncer.tick()
        await syncer.stop()

    run(first())
    other = make_spec(sync={"fragments": 3})
    with pytest.raises(ValueError, match=r"sync\.fragments=3"):
        Syncer(other, job_name="unit", state_dir=tmp_path)


def test_syncer_body_limit_scales_with_codec() -> None:
    shapes = {"w": torch.Size([1000, 100])}
    none, int8, int4 = (fragment_body_limit(shapes, c) for c in ("none", "int8", "int4"))
    # Never below the exact payload (fp32 400 kB, int8 100 kB + scales, int4 50 kB + scales) ...
    assert none > 400_000 and int8 > 100_000 and int4 > 50_000
    # ... and well below the next wider codec's payload.
    assert none < 500_000 and int8 < 200_000 and int4 < int8 - 40_000


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        ({"tokens": "1.5"}, "metadata.tokens"),
        ({"steps": "true"}, "metadata.steps"),
        ({"loss": "NaN"}, "metadata.loss"),
        ({"stepTime": "-1"}, "metadata.stepTime"),
        ({"baseVersion": "x"}, "metadata.baseVersion"),
        ({"keptSteps": "-1"}, "metadata.keptSteps"),
        ({"keptSteps": "0.5"}, "metadata.keptSteps"),
        ({"keptSteps": "true"}, "metadata.keptSteps"),
        ({"keptSteps": "2"}, "metadata.keptSteps"),  # more than the push's 1 step
    ],
)
def test_syncer_parse_push_meta_names_the_bad_field(meta: dict[str, str], field: str) -> None:
    good = protocol.PushMeta("island-0", 0, 10, 1, 1.0, 0.1, "none").to_metadata()
    with pytest.raises(Refused) as err:
        parse_push_meta({**good, **meta}, "none")
    assert err.value.status == 400 and field in err.value.message
