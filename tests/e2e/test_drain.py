"""The drain (learner/drain.py): each island trains its part of stopAfter.tokens, pushes what its
two streamed fragments still hold (partial rounds) and the job finishes with every processed
token merged, stopAfter.tokens not overshot. At K = M the part is each island's share; at K < M
the syncer's stop target, split by pace near the budget (syncer/state/targets.py)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from diloco_trainer.api import credentials
from diloco_trainer.api.documents import MergeRecord
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.core.payloads import PulledFragment
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.local.run import LocalRun

from .conftest import http_request, restart_safe_port, wait_until
from .test_convergence import (  # noqa: F401  (local_run is a fixture)
    AT_JOIN,
    local_run,
    run_to_finish,
    start_synchronised,
    status_of,
)
from .test_hostile import push_body

pytestmark = pytest.mark.e2e

ISLANDS = 2
STEPS = 20  # each island's share: 20 steps, not a multiple of H = 6
STEP_TOKENS = 2 * 32  # batchSize x seqLen


def test_drain_merges_every_processed_token_and_stops_at_the_budget(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    budget = ISLANDS * STEPS * STEP_TOKENS
    spec = make_spec(
        islands={"count": ISLANDS},
        # Rounds of H each (the partial rounds below are of H = 6): with the default (auto) a
        # round resized under load splits what is left of the budget by round lengths, rounded
        # down to whole steps (syncer/state/targets.lock_step_weights), and the job ends a step
        # short, within the drain's slack (drained_at_budget): seen once at load 13.
        inner={"steps": 6, "stepsPerIsland": "fixed"},
        sync={"quorum": ISLANDS, "fragments": 2, "graceSeconds": 5},
        stopAfter={"outerSteps": None, "tokens": budget},
    )
    run = local_run(spec)
    start_synchronised(run)
    status = run_to_finish(run, timeout=600)
    run.wait_learners(timeout=60)  # they exit on the finish: their logs are complete
    run.stop_all(timeout=30)

    assert status.finished and status.tokens == budget  # exactly: nothing past the budget
    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    # The movement cap (on by default in a job of two) clipped no honest merge, the partial
    # rounds' included (each push's Δ holds only its own steps: issue 46).
    assert [m.clip for m in merges] == [1.0] * len(merges)
    for island in (f"island-{i}" for i in range(ISLANDS)):
        # Every step the island took is in both fragments' merges, the last of each a partial
        # round (20 = 3 x 6 + 2 for fragment 0; 20 = 9 + 6 + 5 for fragment 1, whose first
        # push holds a round and a half).
        for f in (0, 1):
            steps = [c.steps for m in merges if m.fragment == f for c in m.contributors
                     if c.island == island]  # fmt: skip
            assert sum(steps) == STEPS, (island, f, steps)
            assert steps[-1] < spec.inner.steps, (island, f, steps)
        log = (run.logs / f"{island}-rank0.log").read_text()
        assert re.search(r"step \d+: this island's part of the job is done", log)
        assert f"the job has finished: exiting after {STEPS} steps" in log
        assert status.islands[island].merged_tokens == STEPS * STEP_TOKENS


@pytest.mark.parametrize(
    ("count", "quorum"),
    [
        (ISLANDS, 1),  # K = 1 of 2
        # K = 2 of 3, the third island never up (bench.adversary's honest baselines, issue 46):
        # it has no part of the budget, split between the two, and holds neither their last
        # merge (one island drained, the other's push alone under a quorum of 2) nor the finish.
        # Before, the drained islands waited in vain and trained on past the budget.
        (ISLANDS + 1, ISLANDS),
    ],
)
def test_drain_at_k_below_m_stops_each_island_at_its_target(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
    count: int,
    quorum: int,
) -> None:
    # Heartbeats every second (a quarter of the timeout): the syncer measures each island's
    # pace from two of them and sets the targets 3 s before the budget (3 heartbeats), so the
    # job must last longer than that: 300 steps an island, 5-10 s here.
    budget = ISLANDS * 300 * STEP_TOKENS
    spec = make_spec(
        islands={"count": count},
        inner={"steps": 6},
        sync={"quorum": quorum, "fragments": 2, "heartbeatTimeoutSeconds": 4},
        stopAfter={"outerSteps": None, "tokens": budget},
    )
    run = local_run(spec)
    start_synchronised(run, islands=ISLANDS)
    status = run_to_finish(run, timeout=600)
    run.wait_learners(timeout=60)  # a drained learner hears of the finish in a heartbeat
    run.stop_all(timeout=30)

    syncer_log = (run.logs / "syncer.log").read_text()
    assert "the budget is near: stop targets" in syncer_log
    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    # The movement cap clipped no honest merge: a drain's last push of one step used to be 3.4x
    # over it (its Δ held the merge it took just before, issue 46).
    assert [m.clip for m in merges] == [1.0] * len(merges), [
        (m.fragment, m.movement, [c.steps for c in m.contributors]) for m in merges if m.clip < 1
    ]
    processed = drained_and_merged(run, merges)
    # The targets are whole steps within the budget, each island's last ones merged.
    assert status.tokens == processed <= budget, (status.tokens, processed)
    assert processed > budget - ISLANDS * STEP_TOKENS, processed


class PaceSilentIsland(threading.Thread):
    """An island that joins with its own credential, pushes once (a small Δ of one claimed step,
    fragment 0) and then keeps itself in the job with heartbeats that never carry its count
    (no `tokens`): the syncer never learns its pace (adv14's paced_ratchet, issue 46)."""

    def __init__(self, run: LocalRun, island: str, claim: int | None = None) -> None:
        super().__init__(daemon=True)
        assert run.files is not None
        self.url, self.island = run.url, island
        # A count to claim in every heartbeat after a first of 0 (None: no `tokens` at all).
        self.claim = claim
        self.token = credentials.island_token(run.files.token, island)
        self.stop = threading.Event()
        self.answers: list[tuple[str, int, Any]] = []

    def call(self, path: str, **kw: Any) -> tuple[int, Any]:
        code, doc = http_request("POST", self.url + path, token=self.token, **kw)
        self.answers.append((path, code, doc))
        return code, doc

    async def shapes(self) -> dict[str, torch.Tensor]:
        async with SyncerClient(self.url, self.token) as client:
            pulled = await client.pull_fragment(0, after=-1)
            assert isinstance(pulled, PulledFragment)
            return pulled.tensors

    def run(self) -> None:
        self.call("/v1/join", json_body={"island": self.island, "replicas": 1})
        weights = asyncio.run(self.shapes())
        g = torch.Generator().manual_seed(7)
        tensors = {n: 1e-4 * torch.randn(t.shape, generator=g) for n, t in weights.items()}
        code, doc = http_request("GET", self.url + "/v1/status", token=self.token)
        base = doc["versions"][0] if code == 200 else 0
        body = push_body(tensors, island=self.island, baseVersion=base, steps=1, tokens=64)
        self.call("/v1/fragments/0/push", body=body)
        beat: dict[str, Any] = {"island": self.island, "step": 1}
        if self.claim is not None:
            self.call("/v1/heartbeat", json_body={**beat, "tokens": 0})
            beat["tokens"] = self.claim
        while not self.stop.wait(0.5):  # twice a second: well within the 4 s timeout
            code, doc = self.call("/v1/heartbeat", json_body=beat)
            if code == 200 and doc.get("finished"):
                return


@pytest.mark.parametrize("claim", [None, 2**50], ids=["no-count", "count-2^50"])
def test_drain_is_not_held_by_an_island_that_never_reports_its_pace(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
    claim: int | None,
) -> None:
    """Issue 46: K = 2 of 3; island-2 joins, pushes, and keeps itself active with heartbeats
    that never carry its token count. Before, the syncer set stop targets only once every
    running island's pace was known: no honest island drained and the job ended at the first
    merge that reached the budget, each island's work since its last merged push lost. Now
    island-2, past its pace's wait (3 heartbeat intervals, 3 s here), is left out of the split:
    the two honest islands drain at their targets, every step they took is merged, and the
    job finishes at the budget (but for the targets' rounding) with island-2 still active and
    undrained.

    With `claim` 2^50, island-2's heartbeats say 0 tokens, then 2^50 (adv15, issue 46): before,
    its count made what was left of the budget negative and both honest islands got their
    current counts as targets at its first such heartbeat, draining a few steps into the job
    (then waiting in vain and training on). Now a count growing faster than island-2 could
    process leaves it out of the split at once: the honest islands drain as above."""
    budget = 2 * 300 * STEP_TOKENS
    spec = make_spec(
        islands={"count": 3},
        inner={"steps": 6},
        sync={"quorum": 2, "fragments": 2, "heartbeatTimeoutSeconds": 4},
        stopAfter={"outerSteps": None, "tokens": budget},
    )
    run = local_run(spec)
    start_synchronised(run, islands=ISLANDS)
    silent = PaceSilentIsland(run, "island-2", claim)
    silent.start()
    try:
        status = run_to_finish(run, timeout=600)
        run.wait_learners(timeout=60)
    finally:
        silent.stop.set()
        silent.join(timeout=30)
    run.stop_all(timeout=30)

    codes = {path: code for path, code, _ in silent.answers}
    assert codes["/v1/join"] == 200 and codes["/v1/fragments/0/push"] == 200, silent.answers[:3]
    assert {c for p, c, _ in silent.answers if p == "/v1/heartbeat"} == {200}
    assert status.islands["island-2"].state == "active" and not status.islands["island-2"].drained
    syncer_log = (run.logs / "syncer.log").read_text()
    found = re.findall(r"the budget is near: stop targets \(tokens each learner counts\) (.*)",
                       syncer_log)  # fmt: skip
    assert len(found) == 1 and "island-2" not in found[0], found
    if claim is None:
        assert "no pace known for island-2" in syncer_log
    else:
        assert "island island-2: its heartbeat count (tokens) grew by" in syncer_log
        assert "no pace known for island-2" not in syncer_log
    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    processed = drained_and_merged(run, merges)
    # island-2's one push of 64 tokens, merged in fragment 0 of 2: 32 of the job's tokens.
    silent_tokens = status.islands["island-2"].merged_tokens
    assert silent_tokens == 32, silent_tokens
    assert status.tokens == processed + silent_tokens <= budget, (status.tokens, processed)
    assert processed + silent_tokens > budget - ISLANDS * STEP_TOKENS, processed


def test_drain_at_k_below_m_after_a_learner_restart_and_a_syncer_restart(
    make_spec: Callable[..., JobSpec],
    local_run: Callable[..., LocalRun],  # noqa: F811
) -> None:
    """adv17 (issue 46): K = 1 of 2. island-1's learner is killed and started again mid-job
    (it joins with its merged tokens as its count's base), then the syncer is restarted
    (SIGTERM: its checkpoint at the stop, then started again on its state dir, the operator's
    rollout), near enough the start that the targets come after it. The learners ride the
    restart out without joining again and count on from their last joins. Before, the restarted
    syncer read island-1's base as 0: its part was raised to its merged tokens in the split,
    its target counted from 0, and it trained past its share by its base: the job ended at the
    first merge past the budget, island-1 undrained. Now the base is kept (the checkpoint's
    `counts`; island-1 merges after its join, so a checkpoint holds it): both drain at their
    targets, and the job finishes at the budget (but for the targets' rounding). Two rules
    this case found: a push the old syncer held pending is lost even once island-0's merges
    passed its base (rounds.lost_with_restart), and a push refused as too stale after the
    restart (island-0, let go, merges ahead while island-1's client backs off) is trained
    again (its tokens out of island-1's part: targets.pace_of).

    island-0 is held (SIGSTOP) from island-1's kill until the restarted syncer is up, so the
    budget is not spent while the other two restart, however slow their start-ups."""
    budget = 2 * 1000 * STEP_TOKENS
    spec = make_spec(
        islands={"count": ISLANDS},
        inner={"steps": 6},
        sync={"quorum": 1, "fragments": 2, "heartbeatTimeoutSeconds": 4},
        stopAfter={"outerSteps": None, "tokens": budget},
    )
    run = local_run(spec)
    port = restart_safe_port()  # still free when the syncer comes back on it
    start_synchronised(run, port=port)
    wait_until(  # (its join may not be answered yet when the learners are let go)
        lambda: merged_tokens(run, "island-1") >= 100 * STEP_TOKENS,
        timeout=300,
        what="100 steps of island-1 merged",
    )
    (held,) = [p for p in run.learners if p.name.startswith("island-0/")]
    (victim,) = [p for p in run.learners if p.name.startswith("island-1/")]
    os.killpg(held.pid, signal.SIGSTOP)
    try:
        victim.kill()
        victim.wait()
        run.start_island(1)
        # Its new learner joined and a push of it (a fragment of 6 steps: 192 of the job's
        # tokens) merged. Counted from the join: the first learner's last pushes may merge
        # until then (a join drops those still pending), and a checkpoint holds the join only
        # with a merge after it (CI rehearsal: counted from the kill, the old pushes' merges met
        # the wait, the syncer stopped 16 ms after the join and resumed with one join).
        wait_until(
            lambda: status_of(run)["islands"]["island-1"]["joins"] == 2,
            timeout=300,
            what="island-1 to join again",
        )
        base = status_of(run)["islands"]["island-1"]["mergedTokens"]
        wait_until(
            lambda: status_of(run)["islands"]["island-1"]["mergedTokens"] >= base + 3 * STEP_TOKENS,
            timeout=300,
            what="a push of island-1's new learner to merge",
        )
        assert run.syncer is not None
        run.syncer.terminate()  # what the Deployment's rollout does to the old pod
        assert run.syncer.wait() == 0
        run.start_syncer(port=port)
        resumed = status_of(run)
        assert resumed["resumedFrom"] is not None
        assert resumed["islands"]["island-1"]["joins"] == 2
        assert resumed["tokens"] < budget // 2, resumed["tokens"]  # the split is still ahead
    finally:
        os.killpg(held.pid, signal.SIGCONT)
    status = run_to_finish(run, timeout=600)
    run.wait_learners(timeout=60)
    run.stop_all(timeout=30)

    syncer_log = (run.logs / "syncer.log").read_text()
    after_restart = syncer_log.split("resumed from")[-1]
    found = re.findall(r"the budget is near: stop targets \(tokens each learner counts\) (.*)",
                       after_restart)  # fmt: skip
    assert len(found) == 1, found
    for island in ("island-0", "island-1"):
        log = AT_JOIN.split((run.logs / f"{island}-rank0.log").read_text())[-1]  # its last life
        assert "this island's part of the job is done (its share of stopAfter" in log, island
        assert "drained, but the job did not finish" not in log, island  # no wait in vain
    merges = [
        MergeRecord.model_validate_json(line)
        for line in (run.workdir / "syncer" / "merges.jsonl").read_text().splitlines()
    ]
    log = (run.logs / "island-0-rank0.log").read_text()
    steps = int(re.findall(r"the job has finished: exiting after (\d+) steps", log)[-1])
    # Every step island-0 took is merged (its learner ran the whole job), once but for a push
    # made again over a merged one (held through the restart, its pull for that merge failed:
    # CI, 2026-12-02, fragment 1 merged 977 of 971 steps), island-1's merged tokens are both of
    # its learners' merged work, and the job is at the budget.
    again = [carried_again_steps(merges, "island-0", f) for f in (0, 1)]
    for f in (0, 1):
        merged = [c.steps for m in merges if m.fragment == f for c in m.contributors
                  if c.island == "island-0"]  # fmt: skip
        assert sum(merged) - again[f] == steps, (f, merged, again)
    # The job's merged tokens average its fragments' (MergeLog.tokens): a push's steps merged
    # again count 1/F each.
    island_0 = steps * STEP_TOKENS + sum(again) * STEP_TOKENS / 2
    assert status.tokens == round(island_0 + status.islands["island-1"].merged_tokens)
    assert budget - ISLANDS * STEP_TOKENS < status.tokens <= budget, status.tokens


def carried_again_steps(merges: list[MergeRecord], island: str, fragment: int) -> int:
    """The steps of `island`'s merged pushes to `fragment` that a later push of it carried
    again: one on the same base as its merged push before it, made again because the learner
    never received that push's merge, carries every step since that base
    (syncer/state/records.carried_again); those steps are merged twice, counted once."""
    again, last = 0, None
    for m in merges:
        if m.fragment != fragment:
            continue
        for c in m.contributors:
            if c.island != island:
                continue
            if last is not None and c.base_version == last.base_version:
                again += last.steps
            last = c
    return again


def merged_tokens(run: LocalRun, island: str) -> int:
    """The island's merged tokens in the syncer's status (0 before it joined)."""
    record = status_of(run)["islands"].get(island)
    return 0 if record is None else int(record["mergedTokens"])


def drained_and_merged(run: LocalRun, merges: list[MergeRecord]) -> int:
    """The tokens the ISLANDS honest islands processed, each of which drained at its part, never
    waited in vain for the finish, and has every step it took in both fragments' merges."""
    processed = 0
    for island in (f"island-{i}" for i in range(ISLANDS)):
        log = (run.logs / f"{island}-rank0.log").read_text()
        assert "this island's part of the job is done (its share of stopAfter" in log
        assert "drained, but the job did not finish" not in log  # no wait in vain
        steps = int(re.findall(r"the job has finished: exiting after (\d+) steps", log)[-1])
        processed += steps * STEP_TOKENS
        for f in (0, 1):  # every step it took is in both fragments' merges
            merged = [c.steps for m in merges if m.fragment == f for c in m.contributors
                      if c.island == island]  # fmt: skip
            assert sum(merged) == steps, (island, f, merged)
    return processed
