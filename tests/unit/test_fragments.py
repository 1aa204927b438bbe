"""Streaming fragments: balanced split, staggered offsets, due steps."""

from __future__ import annotations

import pytest
from diloco_trainer.core.fragments import fragment_offsets, fragments_due, split_fragments
from diloco_trainer.models.model import build_model


def _model_sizes() -> dict[str, int]:
    model = build_model("gpt-tiny", 64)
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters()}


def test_split_fragments_every_name_exactly_once() -> None:
    sizes = _model_sizes()
    for f in (1, 2, 3, 5):
        frags = split_fragments(sizes, f)
        assert len(frags) == f
        flat = [n for frag in frags for n in frag]
        assert sorted(flat) == sorted(sizes)
        assert all(frag for frag in frags)


def test_split_fragments_is_balanced() -> None:
    sizes = _model_sizes()
    frags = split_fragments(sizes, 3)
    loads = [sum(sizes[n] for n in frag) for frag in frags]
    # Greedy largest-first: the spread is at most the largest tensor.
    assert max(loads) - min(loads) <= max(sizes.values())
    assert max(loads) <= 1.2 * sum(sizes.values()) / 3


def test_split_fragments_greedy_by_hand() -> None:
    sizes = {"a": 10, "b": 7, "c": 5, "d": 3, "e": 3}
    # Largest first into the least filled: a->0, b->1, c->1 (7<10), d->0 (10<12), e->1 (12<13).
    assert split_fragments(sizes, 2) == [["a", "d"], ["b", "c", "e"]]


def test_split_fragments_is_deterministic_and_keeps_model_order() -> None:
    sizes = _model_sizes()
    a = split_fragments(sizes, 4)
    b = split_fragments(dict(sizes), 4)
    assert a == b
    order = list(sizes)
    for frag in a:
        assert frag == sorted(frag, key=order.index)


def test_split_fragments_ties_broken_by_name() -> None:
    assert split_fragments({"y": 4, "x": 4}, 2) == [["x"], ["y"]]


def test_split_fragments_too_many_fragments_names_field() -> None:
    with pytest.raises(ValueError, match=r"sync.fragments \(3\) .* 2 tensors"):
        split_fragments({"a": 1, "b": 1}, 3)
    with pytest.raises(ValueError, match=r"sync\.fragments must be >= 1"):
        split_fragments({"a": 1}, 0)


def test_fragment_offsets_are_staggered() -> None:
    assert fragment_offsets(12, 1) == [0]
    assert fragment_offsets(12, 4) == [0, 3, 6, 9]
    assert fragment_offsets(10, 3) == [0, 3, 6]
    assert fragment_offsets(24, 24) == list(range(24))
    with pytest.raises(ValueError):
        fragment_offsets(0, 1)


def test_fragments_due_each_fragment_once_per_round() -> None:
    h = 10
    offsets = fragment_offsets(h, 3)
    due = {step: fragments_due(step, h, offsets) for step in range(1, 3 * h + 1)}
    for f in range(3):
        steps = [s for s, fs in due.items() if f in fs]
        assert len(steps) == 3
        assert steps[1] - steps[0] == h
    assert due[10] == [0] and due[20] == [0]  # offset 0: end of each round, as plain DiLoCo
    assert due[3] == [1] and due[6] == [2]
    assert due[1] == []


def test_fragments_due_more_fragments_than_steps_share_steps() -> None:
    offsets = fragment_offsets(2, 4)  # [0, 0, 1, 1]
    assert fragments_due(2, 2, offsets) == [0, 1]
    assert fragments_due(3, 2, offsets) == [2, 3]
