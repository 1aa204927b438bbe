"""A push refused as ahead of a restarted syncer (409 `ahead`) is counted as refused only if its
learner does not push its steps again (docs/algorithm.md, "A syncer restart", rule 2, and "A
count's frame is kept across a syncer restart"): the island's next push to the fragment says
which (records.ahead_carried). Counted at once, its tokens were counted twice when the push made
again merged them: refused (out of the island's part) and merged."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.service.service import Syncer
from diloco_trainer.syncer.state.records import AheadRefusal, ahead_carried
from diloco_trainer.syncer.state.rounds import RoundPolicy, SyncState

from .test_syncer import FakeClock, body, delta, run
from .test_syncer_drain import paces_after_restart, restart_pair


def test_a_push_based_below_the_refused_base_carries_its_steps() -> None:
    """Refused on version 3: a push on 2 (the base counted as the restarted syncer's version,
    every step since it) carries its steps; one on 3 or 4 (after a receipt at or past 3, which
    kept only the steps since the refused push) does not."""
    refused = AheadRefusal(base=3, tokens=512.0)
    assert [ahead_carried(refused, v) for v in (0, 2, 3, 4)] == [True, True, False, False]


def test_membership_counts_a_push_refused_as_ahead_once_the_next_push_tells() -> None:
    """island-1 (joined) has a push of 512 tokens on version 3 refused as ahead: nothing
    refused yet. Its next push, on 2, carries it: still 0. Another refused as ahead (256, on 3),
    then a push on 3: the 256 are refused. A 422's 100 at once: 356. One refused as ahead on
    fragment 1 (128) is pending when the learner restarts and joins: the join drops it and the
    356 (a new count), and the fragment's next push (on 5) counts nothing."""
    policy = RoundPolicy(
        quorum=1, max_staleness=2, heartbeat_timeout=30.0, grace_seconds=None, overlap_steps=0
    )
    members = SyncState(policy, 2).membership
    members.join("island-1", 1, 0.0)
    rec = members.islands["island-1"]
    seen: list[float] = []
    members.refused_push("island-1", 512.0, fragment=0, base=3, ahead=True)
    seen.append(rec.refused_tokens)
    members.pushed("island-1", 0, 2)
    seen.append(rec.refused_tokens)
    members.refused_push("island-1", 256.0, fragment=0, base=3, ahead=True)
    members.pushed("island-1", 0, 3)
    seen.append(rec.refused_tokens)
    members.refused_push("island-1", 100.0, fragment=0, base=3)
    seen.append(rec.refused_tokens)
    members.refused_push("island-1", 128.0, fragment=1, base=5, ahead=True)
    members.join("island-1", 1, 1.0)
    members.pushed("island-1", 1, 5)
    seen.append(rec.refused_tokens)
    # main (refused at once, no pending): [512, 512, 768, 868, 0]
    assert seen == [0.0, 0.0, 256.0, 356.0, 0.0]


async def refused_ahead(syncer: Syncer, island: str, base: int, tokens: int, steps: int) -> None:
    with pytest.raises(Refused) as err:
        await syncer.receive_push(
            0, body(syncer, 0, island, delta(syncer, 0, 7), base=base, tokens=tokens, steps=steps)
        )
    assert (err.value.status, err.value.code) == (409, "ahead")


def test_a_push_refused_as_ahead_and_pushed_again_is_counted_once(tmp_path: Path) -> None:
    """RESTART_SPEC: K = 1 of 2, 128 tokens a step, a capped push 2,176 tokens, budget 3,712.
    island-1's push of 4 steps, 512 tokens, on version 1 (a merge the syncer lost) is refused
    as ahead; its learner pushes it again on version 0 with every step since: 8 steps, 1,024
    tokens, merged (version 1). Then island-0 reports 0 and 640 a second later, island-1 1,024
    and 1,664 (640 tokens/s each; all of island-1's 1,024 tokens are merged).

    Now: nothing refused; island-1's part 0 + 1,664 (within [1,024, 1,024 + 2,176]); done
    640 + 1,664 = 2,304, left 1,408, 704 each: island-0 1,344 -> 10 steps (1,280), island-1
    2,368 -> 18 steps (2,304): 1,280 + 2,304 = 3,584 merged at most, within the budget.
    Main: 512 refused, its part 1,664 - 512 = 1,152 (within [1,024, 1,024 + 2,176 - 512]),
    done 1,792, left 1,920, 960 each: island-0 1,600 -> 1,536, island-1 2,624 -> 2,560:
    1,536 + 2,560 = 4,096, the budget overshot by the 512 counted twice less rounding."""
    clock = FakeClock()

    async def scenario() -> list[object]:
        syncer = await restart_pair(tmp_path, clock)
        try:
            await refused_ahead(syncer, "island-1", base=1, tokens=512, steps=4)
            rec = syncer.state.membership.islands["island-1"]
            seen: list[object] = [rec.refused_tokens]
            clock.now += 2.0
            d = delta(syncer, 0, 8)
            answer = await syncer.receive_push(
                0, body(syncer, 0, "island-1", d, base=0, tokens=1_024, steps=8)
            )
            assert answer["accepted"], answer
            await syncer.tick()
            seen += [syncer.state.versions[0], rec.merged_tokens, rec.refused_tokens]
            seen.append(await paces_after_restart(syncer, clock, (0, 1_024)))
            return seen
        finally:
            await syncer.stop()

    # main: [512.0, 1, 1024.0, 512.0, {"island-0": 1536, "island-1": 2560}]
    assert run(scenario()) == [0.0, 1, 1_024.0, 0.0, {"island-0": 1_280, "island-1": 2_304}]


def test_a_push_refused_as_ahead_whose_steps_were_dropped_is_counted_refused(
    tmp_path: Path,
) -> None:
    """island-1's push of 2 steps, 256 tokens, on version 1 is refused as ahead (version 0);
    island-0's push merges (version 1) before island-1's learner pulls, so the learner receives
    version 1, keeping only the steps since the refused push, and pushes those on 1: the 256
    are refused then (not at the refusal), and the push's 512 merge."""
    clock = FakeClock()

    async def scenario() -> list[object]:
        syncer = await restart_pair(tmp_path, clock)
        try:
            await refused_ahead(syncer, "island-1", base=1, tokens=256, steps=2)
            rec = syncer.state.membership.islands["island-1"]
            seen: list[object] = [rec.refused_tokens]
            for island, seed, tokens in (("island-0", 1, 512), ("island-1", 2, 512)):
                clock.now += 2.0
                d = delta(syncer, 0, seed)
                pushed = body(syncer, 0, island, d, base=1 if seed == 2 else 0, tokens=tokens)
                assert (await syncer.receive_push(0, pushed))["accepted"]
                await syncer.tick()
                seen.append(rec.refused_tokens)
            seen.append(rec.merged_tokens)
            return seen
        finally:
            await syncer.stop()

    # main: [256.0, 256.0, 256.0, 512.0]
    assert run(scenario()) == [0.0, 0.0, 256.0, 512.0]
