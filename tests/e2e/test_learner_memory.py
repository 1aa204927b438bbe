"""A learner's copies of the model, counted by the learner itself (FragmentSync.held_copies) in a
real job: a `diloco syncer` process and one island's learner in this process, its inner steps
emulated (learner/emulated_step.py) so that the sync path runs at once, with the job defaults
(2 fragments, int8 pushes and pulls, the overlap fitted, no error feedback, lateMergeRule keep).

ARCHITECTURE.md, "A learner's memory": with those defaults rank 0's DiLoCo state is the weights
(1x), one Δ base (1x over all fragments) and the weights at each push in flight (1/F each, at
most 1x): at most 3 copies. A merged fragment pulled as a chain of updates is added into the
base in place (learner/syncer_link.py), so none waits beside it (it was 3 + 1/F). gpt-tiny's
fragments take the flat-buffer push (push_encoding.ONE_PASS_FROM), gpt-small's the host's
deferred one-pass push and the receipt prepared on the link's thread, as gpt-125m's do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from diloco_trainer.api.contract import EMULATE_STEP, LearnerEnv
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.learner.loop import Learner
from diloco_trainer.local import launch

from tests.e2e.conftest import SyncerHandle

FRAGMENTS = 2
# Storage bytes of a full pulled fragment include its body's header (a few hundred bytes).
SLACK = 1.01


@pytest.mark.parametrize("preset", ["gpt-tiny", "gpt-small"])
def test_a_learner_holds_the_documented_copies_of_the_model(
    preset: str, syncer_proc: Callable[..., SyncerHandle], tmp_path: Path
) -> None:
    steps, rounds, seq_len = 8, 4, 32
    spec = parse_spec(
        {
            "model": {"preset": preset, "seed": 0},
            "data": {"evalTokens": 1024},
            "islands": {"count": 1},
            "inner": {"steps": steps, "batchSize": 1, "seqLen": seq_len},
            "sync": {"fragments": FRAGMENTS},
            "stopAfter": {"tokens": rounds * steps * seq_len},
            "syncer": {"evalEveryOuterSteps": 1000, "checkpoint": {"everyOuterSteps": 1000}},
        }
    )
    syncer = syncer_proc(spec)
    variables = launch.learner_env(
        syncer.files,
        syncer_url=syncer.url,
        island="island-0",
        island_index=0,
        rank=0,
        world_size=1,
        master_port=1,
    )
    variables[EMULATE_STEP] = "0.02"
    learner = Learner(spec, LearnerEnv.from_env(variables), "cpu", threading.Event())
    assert learner.run() == 0
    assert learner.sync is not None
    peak = learner.sync.peak_copies
    weights = peak["weights"]
    assert weights == 4 * sum(p.numel() for p in learner.params.values())
    # One Δ base over all fragments: not a second one kept beside it.
    assert peak["base"] == weights
    # Each fragment's weights at its push, while it is in flight: 1/F to all F of them.
    assert weights / FRAGMENTS * 0.99 <= peak["at_push"] <= weights
    # No merged fragment waits beside the base it replaces: the pulled chains were added into
    # the base (the arrived fragment's tensors are the base's own, counted there).
    assert learner.sync.link.pull_counts["updates"] > 0
    assert peak["arrived"] == 0
    # Not with these defaults: no GPU mirror, no eager update, no error feedback.
    assert peak["base_on_device"] == peak["last_update"] == peak["residuals"] == 0
    assert sum(peak.values()) <= 3 * weights * SLACK
