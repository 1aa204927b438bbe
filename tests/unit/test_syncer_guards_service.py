"""The syncer in-process (no HTTP) against hostile and broken input: refused contributions change
nothing and an honest island keeps merging; islands refused again and again are dropped; a merge
that cannot take a contribution leaves it out and goes on; only the job's islands exist; corrupt
checkpoints are never resumed; a stop writes a checkpoint; checkpoint failures are health
problems."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import ConfigError
from diloco_trainer.syncer.intake import gate as gate_module
from diloco_trainer.syncer.merging import merge_log
from diloco_trainer.syncer.service import jobs as jobs_module
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.problems import CHECKPOINT, CORRUPT, MERGE
from diloco_trainer.syncer.state.records import Beat, Contribution
from diloco_trainer.syncer.state.rounds import Refused
from diloco_trainer.syncer.storage import checkpoint as ckpt

from .test_syncer import FakeClock, body, delta, make_spec, run, started

ALONE = {"quorum": 1, "graceSeconds": 0}


def state_of(syncer: Syncer) -> dict[str, Any]:
    doc = run(syncer.status(digest=True))
    doc.pop("time")
    return doc


async def honest_round(syncer: Syncer, island: str = "island-0", seed: int = 0) -> None:
    """One accepted push of `island` to fragment 0, merged."""
    version = syncer.state.versions[0]
    answer = await syncer.receive_push(0, body(syncer, 0, island, delta(syncer, 0, seed)))
    assert answer["accepted"], answer
    await syncer.tick()
    assert syncer.state.versions[0] == version + 1


async def refused(syncer: Syncer, raw: bytes) -> Refused:
    with pytest.raises(Refused) as err:
        await syncer.receive_push(0, raw)
    return err.value


def test_guards_service_hostile_pushes_change_nothing_and_honest_work_merges(
    tmp_path: Path,
) -> None:
    spec = make_spec(sync=ALONE, syncer={"guards": {"maxRefusals": 0}})

    async def scenario() -> tuple[list[tuple[int, str]], dict[str, Any], dict[str, Any], Syncer]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await syncer.islands.join("island-1", 1)
        before = await syncer.status(digest=True)
        huge = {n: torch.full_like(t, 3e38) for n, t in delta(syncer, 0, 1).items()}
        cases = [
            body(syncer, 0, "island-1", huge),  # finite, poisons every weight
            body(syncer, 0, "island-1", {n: 1e3 * t for n, t in delta(syncer, 0, 1).items()}),
            body(syncer, 0, "island-1", delta(syncer, 0, 1), tokens=10**19),  # > int64
            body(syncer, 0, "island-1", delta(syncer, 0, 1), tokens=10**200, steps=1),
            body(syncer, 0, "island-1", delta(syncer, 0, 1), tokens=129, steps=1),
            body(syncer, 0, "island-1", delta(syncer, 0, 1), steps=10**6),
        ]
        codes = [((e := await refused(syncer, raw)).status, e.code) for raw in cases]
        after = await syncer.status(digest=True)
        await honest_round(syncer)
        await syncer.stop()
        return codes, before, after, syncer

    codes, before, after, syncer = run(scenario())
    assert codes == [
        (422, protocol.ERROR_NORM_CAP),
        (422, protocol.ERROR_NORM_CAP),
        (400, ""),
        (400, ""),
        (422, protocol.ERROR_TOKENS_RANGE),
        (422, protocol.ERROR_STEPS_RANGE),
    ]
    before.pop("time"), after.pop("time")
    # Counted per island and reason; the two 400s above come from reading the body (metadata
    # out of range), before the island is known to be the pusher: not counted.
    assert after.pop("refusals") == {
        "island-1": {
            protocol.ERROR_NORM_CAP: 2,
            protocol.ERROR_TOKENS_RANGE: 1,
            protocol.ERROR_STEPS_RANGE: 1,
        }
    }
    assert before.pop("refusals") == {}
    # And their run of 4 refused pushes names island-1 as left out of the rounds (the health
    # problem islandLeftOut, intake/refused_runs.py): named, nothing else changed.
    assert before.pop("health") == {"healthy": True, "problems": []}
    health = after.pop("health")
    assert [p["kind"] for p in health["problems"]] == ["islandLeftOut"], health
    assert "island island-1's last 4 pushes to fragment 0" in health["problems"][0]["message"]
    assert after == before
    assert (
        syncer.state.membership.islands["island-1"].state == protocol.STATE_ACTIVE
    )  # not punished
    metrics = syncer.metrics.render().decode()
    line = 'diloco_syncer_refused_contributions_total{island="island-1",reason="norm_above_cap"}'
    assert f"{line} 2.0" in metrics


def test_guards_service_learned_bound_refuses_a_diverging_island(tmp_path: Path) -> None:
    guards = {"warmupPushes": 3, "normFactor": 10, "maxDeltaNorm": 1e6}  # the bound alone
    spec = make_spec(sync=ALONE, syncer={"guards": guards})

    async def scenario() -> tuple[Refused, Syncer]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        for seed in range(3):
            await honest_round(syncer, seed=seed)
        blown = {n: 30 * t for n, t in delta(syncer, 0, 9).items()}
        err = await refused(syncer, body(syncer, 0, "island-0", blown))
        await honest_round(syncer, seed=4)  # a 2x larger one is within the bound
        await syncer.stop()
        return err, syncer

    err, syncer = run(scenario())
    assert (err.status, err.code) == (422, protocol.ERROR_NORM_OUTLIER)
    assert "median" in err.message and syncer.state.versions == [4]


def test_guards_service_island_refused_again_and_again_is_dropped(tmp_path: Path) -> None:
    spec = make_spec(sync=ALONE, syncer={"guards": {"maxRefusals": 3}})

    async def scenario() -> tuple[list[int], Syncer]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await syncer.islands.join("island-1", 1)
        nan = {n: torch.full_like(t, float("nan")) for n, t in delta(syncer, 0, 1).items()}
        codes = []
        for _ in range(4):
            try:
                await syncer.receive_push(0, body(syncer, 0, "island-1", nan))
            except Refused as err:
                codes.append(err.status)
        await honest_round(syncer)
        await syncer.stop()
        return codes, syncer

    codes, syncer = run(scenario())
    assert codes == [400, 400, 400, 403]  # the third refusal in a row drops it
    rec = syncer.state.membership.islands["island-1"]
    assert rec.state == protocol.STATE_DROPPED and "3 pushes refused in a row" in rec.reason
    assert "NaN" in rec.reason
    # The reason says the syncer dropped it (the operator leaves such an island out) ...
    assert protocol.dropped_for_refusals(rec.state, rec.reason)
    status = run(syncer.status())
    assert status["islands"]["island-1"]["reason"].startswith("refused_pushes: ")
    # ... and the three 400s (NaN does not decode) are counted; the 403 of the dropped island
    # is not a refused contribution.
    assert status["refusals"] == {"island-1": {protocol.REFUSAL_INVALID: 3}}
    assert "diloco_syncer_dropped_islands_total 1.0" in syncer.metrics.render().decode()


def test_guards_service_merge_leaves_out_what_it_cannot_take_and_goes_on(tmp_path: Path) -> None:
    spec = make_spec(sync={"quorum": 2, "graceSeconds": 0})

    async def scenario() -> tuple[Syncer, dict[str, Any]]:
        syncer = await started(spec, tmp_path, FakeClock())
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        await syncer.receive_push(0, body(syncer, 0, "island-0", delta(syncer, 0, 0)))
        # A contribution that bypassed the guards (a bug, or checks changed under it): its
        # weight is infinite, so the merge cannot be computed.
        bad = Contribution("island-1", 0, 0, 10**200, 1, None, 0.0, payload=delta(syncer, 0, 1))
        syncer.state.accept_push(0, bad, syncer.clock())
        await syncer.tick()
        left = await syncer.status()
        await syncer.receive_push(0, body(syncer, 0, "island-2", delta(syncer, 0, 2)))
        await syncer.tick()
        await syncer.stop()
        return syncer, left

    syncer, left = run(scenario())
    assert syncer.failure is None
    assert left["versions"] == [0] and left["pending"] == [1]  # island-0's work is kept
    (problem,) = [p for p in left["health"]["problems"] if p["kind"] == MERGE]
    assert "island-1" in problem["message"] and "island-0" not in problem["message"]
    assert syncer.state.versions == [1]
    merged = {c["island"] for c in syncer.merge_log.recent[-1].to_json()["contributors"]}
    assert merged == {"island-0", "island-2"}
    assert run(syncer.status())["health"]["healthy"] is True  # cleared by the next merge


def test_guards_service_only_the_jobs_islands_exist(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[tuple[int, str]], int, int, Syncer]:
        syncer = await started(make_spec(), tmp_path, FakeClock())
        size = len(json.dumps(await syncer.status()))
        codes = []
        for name in ("evil", "island-3", "eu-island-0", "island-01"):
            try:
                await syncer.islands.join(name, 1)
            except Refused as err:
                codes.append((err.status, err.code))
        for i in range(3, 3000):
            with pytest.raises(Refused):
                await syncer.islands.join(f"island-{i}", 1)
        with pytest.raises(Refused):
            await syncer.islands.set_membership("island-77", "active", "pre-register")
        for i in range(3):
            await syncer.islands.join(f"island-{i}", 1)
        return codes, size, len(json.dumps(await syncer.status())), syncer

    codes, before, after, syncer = run(scenario())
    assert codes == [
        (403, protocol.ERROR_NOT_JOB_ISLAND),
        (503, protocol.ERROR_NOT_ADMITTED),
        (503, protocol.ERROR_NOT_ADMITTED),
        (403, protocol.ERROR_NOT_JOB_ISLAND),
    ]
    assert sorted(syncer.state.membership.islands) == ["island-0", "island-1", "island-2"]
    assert after < before + 3000  # three island records, not three thousand


def test_guards_service_full_syncer_replaces_a_gone_island(tmp_path: Path) -> None:
    """Records are counted per side (issue 22, finding 7): with 2 local islands of 3 in the job,
    other regions hold at most one record, so they cannot lock out a local island; a new island
    takes the place of a gone one of its own side."""
    clock = FakeClock()
    spec = make_spec(islands={"count": 2, "totalShards": 3}, sync={"heartbeatTimeoutSeconds": 5})

    async def scenario() -> tuple[list[int], Syncer]:
        syncer = await started(spec, tmp_path, clock)
        await syncer.islands.join("island-0", 1)
        await syncer.islands.join("eu-island-0", 1)
        refused = []
        for name in ("eu-island-1", "us-island-2"):  # other regions' one record is taken
            with pytest.raises(Refused) as err:
                await syncer.islands.join(name, 1)
            refused.append(err.value.status)
        await syncer.islands.join("island-1", 1)  # the local island still has its record
        clock.now += 3
        for name in ("island-0", "island-1"):
            await syncer.islands.heartbeat(name, Beat(step=1))
        clock.now += 3
        await syncer.tick()  # eu-island-0 times out
        await syncer.islands.join("us-island-2", 1)  # and makes room on its side
        return refused, syncer

    refused, syncer = run(scenario())
    assert refused == [503, 503]
    assert sorted(syncer.state.membership.islands) == ["island-0", "island-1", "us-island-2"]


def test_guards_service_rereads_the_islands_of_a_scaled_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gate_module, "RELOAD_SECONDS", 0.0)
    config = tmp_path / "spec.json"
    spec = make_spec(islands={"count": 2})
    config.write_text(spec.to_json())

    async def scenario() -> tuple[int, Syncer]:
        syncer = Syncer(spec, job_name="unit", state_dir=tmp_path / "s", config_file=config)
        await syncer.start()
        with pytest.raises(Refused) as err:
            await syncer.islands.join("island-2", 1)
        config.write_text(make_spec(islands={"count": 3}).to_json())  # the operator scaled it
        await syncer.islands.join("island-2", 1)
        return err.value.status, syncer

    status, syncer = run(scenario())
    assert status == 503 and "island-2" in syncer.state.membership.islands


def checkpointed(tmp_path: Path, rounds: int, keep: int = 3) -> str:
    """A syncer that merged `rounds` rounds with a checkpoint after each; returns its digest."""
    spec = make_spec(sync=ALONE, syncer={"checkpoint": {"everyOuterSteps": 1, "keep": keep}})

    async def scenario() -> str:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        for seed in range(rounds):
            await honest_round(syncer, seed=seed)
        digest = syncer.digest()
        await syncer.stop()
        return digest

    return run(scenario())


def resume(tmp_path: Path, **checkpoint: Any) -> Syncer:
    spec = make_spec(sync=ALONE, syncer={"checkpoint": {"everyOuterSteps": 1, **checkpoint}})
    return Syncer(spec, job_name="unit", state_dir=tmp_path, clock=FakeClock())


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped", "missing"])
def test_guards_service_newest_checkpoint_damaged_falls_back(tmp_path: Path, damage: str) -> None:
    checkpointed(tmp_path, 2)
    newest = ckpt.list_checkpoints(tmp_path)[-1]
    weights = newest / ckpt.WEIGHTS_FILE
    raw = bytearray(weights.read_bytes())
    if damage == "truncated":
        weights.write_bytes(raw[: len(raw) // 2])
    elif damage == "bit-flipped":
        raw[-5] ^= 0x01  # a tensor byte: safetensors itself would still load it
        weights.write_bytes(bytes(raw))
    else:
        (newest / ckpt.OUTER_FILE).unlink()
    syncer = resume(tmp_path)
    assert syncer.state.versions == [1] and syncer.resumed_from.endswith(ckpt.checkpoint_name(1))
    names = sorted(p.name for p in (tmp_path / ckpt.CHECKPOINTS_DIR).iterdir())
    assert names == [ckpt.checkpoint_name(1), ckpt.CORRUPT_PREFIX + ckpt.checkpoint_name(2)]
    (problem,) = syncer.health.to_json()["problems"]
    assert problem["kind"] == CORRUPT and newest.name in problem["message"]


def test_guards_service_every_checkpoint_corrupt_refuses_to_start(tmp_path: Path) -> None:
    checkpointed(tmp_path, 2)
    for path in ckpt.list_checkpoints(tmp_path):
        (path / ckpt.WEIGHTS_FILE).write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError) as err:
        resume(tmp_path)
    message = str(err.value)
    assert "every checkpoint" in message and "allowFreshStartOnCorrupt" in message
    assert ckpt.checkpoint_name(1) in message and ckpt.checkpoint_name(2) in message
    assert len(ckpt.list_checkpoints(tmp_path)) == 2  # nothing renamed or deleted
    fresh = resume(tmp_path, allowFreshStartOnCorrupt=True)
    assert fresh.state.versions == [0] and fresh.resumed_from is None
    assert ckpt.list_checkpoints(tmp_path) == []  # set aside, kept for inspection
    assert fresh.health.to_json()["problems"][0]["kind"] == CORRUPT


def test_guards_service_stop_writes_what_was_merged_since_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    spec = make_spec(sync=ALONE, syncer={"checkpoint": {"everyOuterSteps": 100}})

    async def first() -> tuple[str, list[int]]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        for seed in range(3):
            await honest_round(syncer, seed=seed)
        scheduler = asyncio.create_task(syncer.run_scheduler())
        await syncer.stop(scheduler=scheduler)  # what SIGTERM does (http.on_cleanup)
        assert scheduler.done()
        return syncer.digest(), syncer.state.versions

    digest, versions = run(first())
    resumed = Syncer(spec, job_name="unit", state_dir=tmp_path, clock=FakeClock())
    assert resumed.digest() == digest and resumed.state.versions == versions == [3]


def test_guards_service_checkpoint_failure_is_a_health_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec(sync=ALONE, syncer={"checkpoint": {"everyOuterSteps": 1}})
    real_save = ckpt.save_checkpoint

    def full_disk(*args: Any, **kwargs: Any) -> Path:
        raise OSError(28, "No space left on device")

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], Syncer]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        monkeypatch.setattr(ckpt, "save_checkpoint", full_disk)
        await honest_round(syncer)
        failing = await syncer.status()
        monkeypatch.setattr(ckpt, "save_checkpoint", real_save)
        await honest_round(syncer, seed=1)
        recovered = await syncer.status()
        await syncer.stop()
        return failing, recovered, syncer

    failing, recovered, syncer = run(scenario())
    assert failing["health"]["healthy"] is False
    (problem,) = failing["health"]["problems"]
    assert problem["kind"] == CHECKPOINT and "No space left" in problem["message"]
    assert failing["failure"] is None  # training goes on
    assert recovered["health"] == {"healthy": True, "problems": []}
    text = syncer.metrics.render().decode()
    assert "diloco_syncer_checkpoint_failures_total 1.0" in text
    assert "diloco_syncer_healthy 1.0" in text


def test_guards_service_eval_history_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_module, "EVAL_HISTORY", 3)
    spec = make_spec(sync=ALONE)

    async def scenario() -> list[int]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        for seed in range(5):
            await honest_round(syncer, seed=seed)
        await syncer.stop()
        return [e["outerStep"] for e in syncer.jobs.evaluations.history]

    assert run(scenario()) == [0, 4, 5]  # the start of the curve and the latest


def test_guards_service_older_push_replayed_is_a_duplicate(tmp_path: Path) -> None:
    spec = make_spec(sync=ALONE)

    async def scenario() -> tuple[dict[str, Any], str, str]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        first = body(syncer, 0, "island-0", delta(syncer, 0, 0), push_id="p-0")
        await syncer.receive_push(0, first)
        await syncer.tick()
        await syncer.receive_push(
            0, body(syncer, 0, "island-0", delta(syncer, 0, 1), push_id="p-1")
        )
        await syncer.tick()
        before = syncer.digest()
        again = await syncer.receive_push(0, first)  # not the latest pushId any more
        await syncer.tick()
        await syncer.stop()
        return again, before, syncer.digest()

    again, before, after = run(scenario())
    assert again["duplicate"] is True and before == after


def test_guards_service_claims_back_to_back_cannot_outrun_the_clock(tmp_path: Path) -> None:
    """Finding 3 of issue 22: claims of a push's most steps pushed back to back reached
    stopAfter in seconds. H 4, τ 1: a push's most is 17 steps, the burst two of them."""
    spec = make_spec(sync=ALONE)
    clock = FakeClock()

    async def scenario() -> tuple[list[int | str], Syncer]:
        syncer = await started(spec, tmp_path, clock)
        syncer.gate.clock = clock  # the work rate's clock, frozen between the pushes below
        await syncer.islands.join("island-0", 1)
        got: list[int | str] = []
        for advance in (0.0, 0.0, 0.0, 1.0):
            clock.now += advance
            try:
                raw = body(syncer, 0, "island-0", delta(syncer, 0, 1), steps=17)
                answer = await syncer.receive_push(0, raw)
                got.append("accepted" if answer["accepted"] else "not accepted")
                await syncer.tick()
            except Refused as err:
                got.append(err.code)
        await syncer.stop()
        return got, syncer

    got, syncer = run(scenario())
    # Two pushes of 17 (the burst), the third refused; a second later 1.5 / 0.01 s = 150 steps
    # of credit (at most the burst, 34) let one in again.
    assert got == ["accepted", "accepted", protocol.ERROR_STEPS_RANGE, "accepted"]
    assert syncer.state.versions == [3]


def test_guards_service_unwritable_merge_log_is_a_health_problem(tmp_path: Path) -> None:
    """Finding 6 of issue 22: a merge whose log line could not be written raised after the
    weights moved; the syncer failed, and its stop skipped the final checkpoint."""
    spec = make_spec(sync=ALONE)
    log_file = tmp_path / merge_log.MERGE_LOG_FILE

    async def scenario() -> tuple[list[Any], Syncer]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await honest_round(syncer, seed=0)
        log_file.unlink()
        log_file.mkdir()  # unwritable even as root (a full or read-only disk alike)
        await honest_round(syncer, seed=1)  # merged all the same
        await honest_round(syncer, seed=2)
        failing = (await syncer.status())["health"]
        log_file.rmdir()
        await honest_round(syncer, seed=3)  # written again, with the two it kept
        healed = (await syncer.status())["health"]
        await syncer.stop()
        return [failing, healed], syncer

    (failing, healed), syncer = run(scenario())
    assert syncer.failure is None and syncer.state.versions == [4]
    (problem,) = failing["problems"]
    assert problem["kind"] == merge_log.MERGE_LOG and problem["count"] == 2
    assert "2 merge(s) kept" in problem["message"]
    assert healed == {"healthy": True, "problems": []}
    # The first merge's line went with the file replaced above; the two kept came with the 4th.
    lines = log_file.read_text().splitlines()
    assert [json.loads(line)["version"] for line in lines] == [2, 3, 4]
    # The stop checkpointed the last merge, as a stop does.
    assert ckpt.list_checkpoints(tmp_path)[-1].name == ckpt.checkpoint_name(4)


def test_guards_service_merge_log_lines_kept_are_written_at_stop(tmp_path: Path) -> None:
    """Merge-log lines kept while merges.jsonl was unwritable are written by the stop when the
    log can be written again, though no merge came after it healed (they were lost before)."""
    spec = make_spec(sync=ALONE)
    log_file = tmp_path / merge_log.MERGE_LOG_FILE

    async def scenario() -> tuple[dict[str, Any], Syncer]:
        syncer = await started(spec, tmp_path, FakeClock())
        await syncer.islands.join("island-0", 1)
        await honest_round(syncer, seed=0)
        log_file.unlink()
        log_file.mkdir()
        await honest_round(syncer, seed=1)
        await honest_round(syncer, seed=2)
        failing = (await syncer.status())["health"]
        log_file.rmdir()  # healed, but no merge comes to write the two kept lines
        await syncer.stop()
        return failing, syncer

    failing, syncer = run(scenario())
    assert failing["problems"][0]["count"] == 2
    assert not syncer.merge_log.unwritten
    lines = log_file.read_text().splitlines()
    assert [json.loads(line)["version"] for line in lines] == [2, 3]


def test_guards_service_a_checkpoint_without_manifest_is_set_aside_and_reported(
    tmp_path: Path,
) -> None:
    """A ckpt-* directory without a manifest (issue 22, finding 8: it was deleted at start) is
    renamed aside and reported as a health problem; the valid checkpoint is resumed."""
    digest = checkpointed(tmp_path, 2)
    stray = tmp_path / ckpt.CHECKPOINTS_DIR / ckpt.checkpoint_name(7)
    stray.mkdir()
    (stray / ckpt.WEIGHTS_FILE).write_bytes(b"kept for a person to look at")
    syncer = resume(tmp_path)
    assert syncer.state.versions == [2] and syncer.digest() == digest
    aside = tmp_path / ckpt.CHECKPOINTS_DIR / (ckpt.CORRUPT_PREFIX + stray.name)
    assert not stray.exists()
    assert (aside / ckpt.WEIGHTS_FILE).read_bytes() == b"kept for a person to look at"
    problems = syncer.health.to_json()["problems"]
    assert [p["kind"] for p in problems] == [CORRUPT] and stray.name in problems[0]["message"]
