"""bench/studies/push_alignment hooks the syncer's methods by name and scores pushes against the
other island's and the merges' directions: the methods must still exist with the arguments the
hooks pass, and the scores are the hand-derived ones."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch
from diloco_trainer.syncer.intake.guards import ContributionGuard
from diloco_trainer.syncer.merging.global_model import GlobalModel

from bench.studies.push_alignment import Recorder, zs


def test_the_hooked_methods_take_the_arguments_the_hooks_pass() -> None:
    for method, names in (
        (ContributionGuard.check_delta, ["self", "fragment", "island", "stats", "steps"]),
        (ContributionGuard.accepted, ["self", "fragment", "island", "stats", "steps"]),
        (GlobalModel.commit_merge, ["self", "f", "prepared", "new_version"]),
    ):
        assert list(inspect.signature(method).parameters) == names, method


def test_a_push_is_scored_against_the_other_island_and_the_last_update(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "records.jsonl")
    rec.accepted(0, "island-1", torch.tensor([1.0, 0.0, 0.0, 0.0]), steps=4)
    rec.accepted(0, "island-1", torch.tensor([0.0, 1.0, 0.0, 0.0]), steps=4)
    rec.accepted(0, "island-0", torch.tensor([0.0, 0.0, 5.0, 0.0]), steps=4)  # its own: ignored
    # θ moved from (1, 1, 1, 1) to (1, 1, 1, 0): the update points along +e4 (before - after)
    rec.merged(0, torch.ones(4), torch.tensor([1.0, 1.0, 1.0, 0.0]))
    out = rec.judged(0, "island-0", torch.tensor([1.0, 1.0, 0.0, 1.0]), steps=12)
    c = out["cos"]
    assert math.isclose(c["other"], 1 / math.sqrt(3))  # (0,1,0,0): 1 / (1 x sqrt 3)
    assert math.isclose(c["other_sum"], 2 / math.sqrt(6))  # (1,1,0,0): 2 / (sqrt 2 x sqrt 3)
    assert math.isclose(c["other_recent"], 2 / math.sqrt(6))
    assert math.isclose(c["global"], 1 / math.sqrt(3))  # (0,0,0,1)
    assert out["start"] == 4 and out["steps"] == 12 and out["d"] == 4
    assert rec.judged(1, "island-0", torch.ones(4), steps=1)["cos"]["other"] is None


def test_best_is_the_largest_magnitude_and_best_plus_the_largest_value() -> None:
    rec = {"d": 4, "cos": {"other": -0.5, "global": 0.25, "other_sum": None}}
    assert zs([rec], "cos", "best") == [-1.0]  # -0.5 x sqrt(4)
    assert zs([rec], "cos", "best+") == [0.5]
    assert zs([rec], "cos", "other_sum") == []
