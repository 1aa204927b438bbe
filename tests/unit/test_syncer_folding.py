"""syncer/merging/folding.py: rounds folded as pushes arrive, pushes kept encoded, and the merge's
fallback to the encoded payloads when the round changed in a way a fold cannot follow."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from diloco_trainer.core.compress import decode_tensors, encode_tensors
from diloco_trainer.core.contributions import Contributor, MergePlan, plan_merge
from diloco_trainer.core.merge import merge_pseudo_gradients
from diloco_trainer.syncer.intake.payload import EncodedPayload
from diloco_trainer.syncer.merging.folding import RoundFolds
from diloco_trainer.syncer.state.records import Contribution

SHAPES = {"a": torch.Size([4, 8]), "b": torch.Size([64])}


def contribution(
    island: str, tokens: int, steps: int, seed: int
) -> tuple[Contribution, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    raw = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    flat = encode_tensors(raw, "int8")
    c = Contribution(
        island=island,
        base_version=0,
        lag=0,
        tokens=tokens,
        steps=steps,
        loss=None,
        received_at=0.0,
        payload=EncodedPayload(flat, "int8", SHAPES),
    )
    return c, decode_tensors(flat, "int8", SHAPES)


def plan_of(cs: list[Contribution], lags: list[float]) -> MergePlan:
    return plan_merge(
        [Contributor(c.tokens, c.steps, lag) for c, lag in zip(cs, lags, strict=True)],
        rule="tokens",
        inner_steps=4,
        islands=len(cs),
    )


def folds() -> RoundFolds:
    return RoundFolds(2, rule="tokens", inner_steps=4, plain_names=frozenset())


def test_encoded_payload_reads_as_the_decoded_pseudo_gradient() -> None:
    c, decoded = contribution("a", 100, 4, seed=0)
    payload = c.payload
    assert list(payload) == ["a", "b"] and len(payload) == 2
    for name in SHAPES:
        assert torch.equal(payload[name], decoded[name])
    # int8: one byte per value and one fp32 scale per block, a quarter of fp32 and a little.
    assert payload.nbytes < (32 + 64) * 4 // 3


def test_weight_and_scale_are_the_plans() -> None:
    # tokens × tokens/steps = 300 · 75; 2 steps of H = 4 are half a round: scale 2; a lag of
    # 3 rounds is 2 beyond the free one: discount 3^-1/2.
    c, _ = contribution("a", 300, 2, seed=0)
    weight, scale = folds().weight_and_scale(c, 3.0)
    assert scale == 2.0
    assert weight == 300 * 150 * 3**-0.5


def test_a_folded_round_merges_as_the_batch_merge_in_arrival_order() -> None:
    rf = folds()
    pushed = [contribution(f"i{k}", 100 * (k + 1), 4, seed=k) for k in range(3)]
    for c, decoded in pushed:  # arrival order: i0, i1, i2
        assert rf.add(1, c, decoded, 0.0)
    assert rf.held_bytes() == (32 + 64) * 4  # one fp32 accumulator, whatever the pushes
    cs = [c for c, _ in pushed]
    plan = plan_of(cs, [0.0] * 3)
    fold = rf.take(1, cs, plan)
    assert fold is not None and rf.held_bytes() == 0
    want = merge_pseudo_gradients(
        [d for _, d in pushed], plan.weights, "tokens", scales=plan.scales
    )
    got = fold.result()
    for name in SHAPES:
        assert torch.equal(got[name], want[name])


def test_a_round_left_without_one_push_is_merged_from_the_encoded_payloads() -> None:
    rf = folds()
    pushed = [contribution(f"i{k}", 100, 4, seed=k) for k in range(3)]
    for c, decoded in pushed:
        rf.add(0, c, decoded, 0.0)
    kept = [pushed[0][0], pushed[2][0]]  # i1 left out by a failed merge
    assert rf.take(0, kept, plan_of(kept, [0.0, 0.0])) is None  # no fold: it holds i1
    # The fallback: the batch merge over the encoded payloads equals the merge of the two
    # decoded pushes alone (equal weights: their mean).
    merged = merge_pseudo_gradients([c.payload for c in kept], [1.0, 1.0], "tokens")
    for name in SHAPES:
        mean = (pushed[0][1][name] + pushed[2][1][name]) / 2
        assert torch.allclose(merged[name], mean, rtol=1e-6, atol=1e-7)


def test_a_replaced_push_or_another_lag_is_not_taken_from_the_fold() -> None:
    rf = folds()
    old, d_old = contribution("i0", 100, 4, seed=0)
    new, d_new = contribution("i0", 200, 4, seed=1)
    rf.add(0, old, d_old, 0.0)
    rf.add(0, new, d_new, 0.0)  # the island's newer push replaced the old one in the round
    assert rf.take(0, [new], plan_of([new], [0.0])) is None
    rf.add(0, new, d_new, 0.0)
    assert rf.take(0, [new], plan_of([new], [2.0])) is None  # planned with another discount
    assert rf.take(0, [new], plan_of([new], [0.0])) is None  # the fold left with the last take


def test_a_push_that_cannot_be_folded_drops_the_fold() -> None:
    rf = folds()
    c, decoded = contribution("i0", 100, 4, seed=0)
    rf.add(0, c, decoded, 0.0)
    bad, _ = contribution("i1", 100, 4, seed=1)
    assert not rf.add(0, bad, {"a": torch.zeros(3)}, 0.0)  # wrong names and shape
    assert rf.held_bytes() == 0
    assert rf.take(0, [c], plan_of([c], [0.0])) is None


def test_a_spilled_payload_reads_back_the_same_and_its_file_goes_with_it(
    tmp_path: Path,
) -> None:
    """A folded push's encoded tensors go to a file (memory flat in the number of islands); a
    merge that must read it again decodes the same values from the file, and the file is gone
    once the payload is."""
    gen = torch.Generator().manual_seed(4)
    shapes = {"w": torch.Size([37, 29]), "b": torch.Size([300])}
    flat = encode_tensors({n: torch.randn(s, generator=gen) for n, s in shapes.items()}, "int8")
    kept = EncodedPayload(flat, "int8", shapes)
    spilled = EncodedPayload(flat, "int8", shapes)
    spilled.spill(tmp_path / "pending")
    assert spilled.flat == {} and spilled.path is not None and spilled.path.is_file()
    assert spilled.nbytes == kept.nbytes == sum(t.numel() * t.element_size() for t in flat.values())
    for name in shapes:
        assert torch.equal(spilled[name], kept[name])
    path = spilled.path
    del spilled
    gc.collect()
    assert not path.exists()


def test_fold_result_notes_the_largest_magnitude_for_the_merge_check() -> None:
    # Mean of [1, -6, 0] and [3, 2, 0] (weights 1 and 1): [2, -2, 0]; |x| max 2, in "b" (the
    # larger of a's 1.5 and b's 2); a NaN anywhere is noted as not finite, with its tensor.
    from diloco_trainer.core.fold import MergeFold

    fold = MergeFold("mean")
    fold.add({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([1.0, -6.0, 0.0])}, 1.0, 1.0)
    fold.add({"a": torch.tensor([2.0, -1.0]), "b": torch.tensor([3.0, 2.0, 0.0])}, 1.0, 1.0)
    out = fold.result()
    assert torch.equal(out["a"], torch.tensor([1.5, 0.5]))
    assert torch.equal(out["b"], torch.tensor([2.0, -2.0, 0.0]))
    assert (fold.amax, fold.amax_name) == (2.0, "b")
    bad = MergeFold("mean")
    bad.add({"a": torch.tensor([float("nan"), 1.0]), "b": torch.tensor([9.0])}, 1.0, 1.0)
    bad.result()
    assert bad.amax != bad.amax and bad.amax_name == "a"  # NaN, noted at its tensor


def _big_push(codec: str, seed: int) -> tuple[EncodedPayload, dict[str, torch.Tensor]]:
    """A push of several 1 MiB slices with ragged tails, kept encoded, and its decoded values."""
    from diloco_trainer.core.compress import SLICE

    shapes = {
        "big": torch.Size([2 * SLICE + 77]),
        "mat": torch.Size([33, 130]),
        "one": torch.Size([1]),
    }
    gen = torch.Generator().manual_seed(seed)
    raw = {n: torch.randn(s, generator=gen) * 1e-2 for n, s in shapes.items()}
    flat = encode_tensors(raw, codec)
    return EncodedPayload(flat, codec, shapes), decode_tensors(flat, codec, shapes)


def test_a_push_folds_a_slice_at_a_time_bit_for_bit_as_its_decoded_copy() -> None:
    """MergeFold.add reads an EncodedPayload a slice at a time (no decoded copy): the
    accumulator and the merge are the bits of folding the whole decoded tensors, for every
    codec, through result()."""
    from diloco_trainer.core.fold import MergeFold

    for codec in ("int8", "int4", "bf16", "none"):
        (p1, d1), (p2, d2) = _big_push(codec, 1), _big_push(codec, 2)
        sliced, whole = MergeFold("tokens"), MergeFold("tokens")
        sliced.add(p1, 3.0, 0.5)
        sliced.add(p2, 1.0, 1.25)
        whole.add(d1, 3.0, 0.5)
        whole.add(d2, 1.0, 1.25)
        for name in d1:
            assert torch.equal(sliced.acc[name], whole.acc[name]), (codec, name)
        got, want = sliced.result(), whole.result()
        for name in d1:
            assert torch.equal(got[name], want[name]), (codec, name)
        assert sliced.amax == want_amax(want)


def want_amax(merged: dict[str, torch.Tensor]) -> float:
    return max(float(t.abs().max()) for t in merged.values())


def test_push_stats_read_a_slice_at_a_time_are_the_decoded_ones() -> None:
    """The guards' stats of a push kept encoded: finite, the same direction sample bit for
    bit, and the norm of the decoded values (combined from slices: equal up to rounding)."""
    from diloco_trainer.syncer.intake.guards import delta_stats

    payload, decoded = _big_push("int8", 3)
    got, want = delta_stats(payload), delta_stats(decoded)
    assert got.finite and want.finite
    assert got.sample is not None and want.sample is not None
    assert torch.equal(got.sample, want.sample)
    full = float(torch.sqrt(sum((t.double() ** 2).sum() for t in decoded.values())))
    assert abs(got.norm - full) <= 1e-5 * full and abs(want.norm - full) <= 1e-5 * full


def test_push_stats_of_an_encoded_push_with_a_huge_or_infinite_scale() -> None:
    """A scale that decodes past fp32 (inf) in the second slice: not finite; a huge finite
    one: its norm is |x|max (beyond any cap)."""
    from diloco_trainer.core.compress import SLICE
    from diloco_trainer.syncer.intake.guards import delta_stats

    payload, _ = _big_push("int8", 4)
    scales = payload.flat["big::scale"].clone()
    scales[SLICE // 128 + 3] = 3e38  # q * 3e38 overflows to inf for |q| > 1
    payload.flat["big::scale"] = scales
    assert not delta_stats(payload).finite
    scales[SLICE // 128 + 3] = 1e20
    stats = delta_stats(payload)
    assert stats.finite and stats.norm >= 1e20


def test_the_merge_checks_max_is_read_at_fold_time_from_the_final_accumulator() -> None:
    """EncodedPayload.add_to reads max |acc| as it writes each slice; the fold keeps the last
    add's, so the merge check sees the final accumulator: a large value cancelled by a later
    push no longer counts, and a NaN in a later slice of the last push is noted."""
    from diloco_trainer.core.compress import SLICE
    from diloco_trainer.core.fold import MergeFold

    shapes = {"big": torch.Size([2 * SLICE + 5])}

    def push(values: dict[int, float]) -> EncodedPayload:
        t = torch.zeros(shapes["big"])
        for i, v in values.items():
            t[i] = v
        return EncodedPayload(encode_tensors({"big": t}, "none"), "none", shapes)

    fold = MergeFold("mean")
    fold.add(push({3: 100.0, SLICE + 1: 2.0}), 1.0, 1.0)
    fold.add(push({3: -100.0, 2 * SLICE + 4: -6.0}), 1.0, 1.0)
    # acc: 0 at 3 (cancelled), 2 at SLICE + 1, -6 at 2·SLICE + 4; mean over Σρ = 2: max 3
    out = fold.result()
    assert (fold.amax, fold.amax_name) == (3.0, "big")
    assert float(out["big"].abs().max()) == 3.0
    bad = MergeFold("mean")
    bad.add(push({0: 5.0}), 1.0, 1.0)
    bad.add(push({2 * SLICE + 1: float("nan")}), 1.0, 1.0)
    bad.result()
    assert bad.amax != bad.amax and bad.amax_name == "big"


# ----- a K = M round folded in island order, whatever the arrival order ----------------------


def _exact_push(island: str, value: float) -> tuple[Contribution, dict[str, torch.Tensor]]:
    """A push of one fp32 value, a whole round (4 of H = 4 steps): weight 1, scale 1 under
    "mean"."""
    c = Contribution(
        island=island, base_version=0, lag=0, tokens=8, steps=4, loss=None, received_at=0.0
    )
    return c, {"x": torch.tensor([value], dtype=torch.float32)}


# fp32 sums depend on their order: 1e8 + 1 rounds to 1e8 (the spacing there is 8), so
# (1e8 + -1e8) + 1 = 1 but (1e8 + 1) + -1e8 = 0.
VALUES = {"i0": 1e8, "i1": -1e8, "i2": 1.0}
ORDER = ["i0", "i1", "i2"]


def _fold_in(arrival: list[str], order: list[str] | None) -> torch.Tensor:
    rf = RoundFolds(1, rule="mean", inner_steps=4, plain_names=frozenset())
    pushed = {name: _exact_push(name, VALUES[name]) for name in ORDER}
    for name in arrival:
        c, decoded = pushed[name]
        assert rf.add(0, c, decoded, 0.0, order)
    cs = [pushed[name][0] for name in ORDER]  # the merge's order: SyncState.peek_round's
    fold = rf.take(0, cs, plan_of_mean(cs))
    assert fold is not None
    return fold.result()["x"]


def plan_of_mean(cs: list[Contribution]) -> MergePlan:
    return plan_merge(
        [Contributor(c.tokens, c.steps, 0.0) for c in cs],
        rule="mean",
        inner_steps=4,
        islands=len(cs),
    )


def test_an_ordered_round_sums_in_island_order_whatever_the_arrival_order() -> None:
    """A K = M round (the push path gives the order) sums (1e8 + -1e8) + 1 = 1, over Σρ = 3:
    fp32(1/3), in every arrival order; folded as the pushes came (K < M), the order i0, i2, i1
    sums (1e8 + 1) + -1e8 = 0 instead."""
    third = torch.tensor([1.0], dtype=torch.float32) / 3
    for arrival in (["i0", "i1", "i2"], ["i2", "i0", "i1"], ["i1", "i2", "i0"], ["i2", "i1", "i0"]):
        got = _fold_in(arrival, ORDER)
        assert torch.equal(got, third), arrival
    assert torch.equal(_fold_in(["i0", "i2", "i1"], None), torch.zeros(1))
    assert torch.equal(_fold_in(["i0", "i1", "i2"], None), third)
    # the batch merge (a round its fold could not follow) in the merge's order: the same bits
    batch = merge_pseudo_gradients([_exact_push(n, VALUES[n])[1] for n in ORDER], [1.0] * 3, "mean")
    assert torch.equal(batch["x"], third)


def test_an_ordered_push_waits_for_the_islands_ahead_of_it() -> None:
    """i2 first: kept (nothing folded); i0: folded; i1: folded, then the waiting i2."""
    rf = RoundFolds(1, rule="mean", inner_steps=4, plain_names=frozenset())
    pushed = {name: _exact_push(name, VALUES[name]) for name in ORDER}

    def folded() -> list[str]:
        held = rf._folds[0]
        assert held is not None
        return [c.island for c, _, _ in held.items]

    rf.add(0, *pushed["i2"], 0.0, ORDER)
    assert folded() == [] and rf.held_bytes() == 0
    rf.add(0, *pushed["i0"], 0.0, ORDER)
    assert folded() == ["i0"]
    rf.add(0, *pushed["i1"], 0.0, ORDER)
    assert folded() == ["i0", "i1", "i2"]


def test_an_ordered_round_merged_without_an_island_folds_the_waiting_pushes_at_the_take() -> None:
    """i1 never pushed (it left): i2 waited for it, and the merge of i0 and i2 folds it then,
    in order: (1e8 + 1) / 2 in fp32 = 5e7 (1e8 + 1 rounds to 1e8)."""
    rf = RoundFolds(1, rule="mean", inner_steps=4, plain_names=frozenset())
    pushed = {name: _exact_push(name, VALUES[name]) for name in ORDER}
    rf.add(0, *pushed["i2"], 0.0, ORDER)
    rf.add(0, *pushed["i0"], 0.0, ORDER)
    cs = [pushed["i0"][0], pushed["i2"][0]]
    fold = rf.take(0, cs, plan_of_mean(cs))
    assert fold is not None
    assert torch.equal(fold.result()["x"], torch.tensor([5e7]))


def test_an_ordered_fold_out_of_the_merges_order_is_not_taken() -> None:
    """i1 folded while i0 was not yet a member (it joined later, ahead of it in the order): the
    fold is not the merge's order, so the merge reads the encoded payloads again (None)."""
    rf = RoundFolds(1, rule="mean", inner_steps=4, plain_names=frozenset())
    pushed = {name: _exact_push(name, VALUES[name]) for name in ORDER}
    rf.add(0, *pushed["i1"], 0.0, ["i1"])
    rf.add(0, *pushed["i0"], 0.0, ["i0", "i1"])
    cs = [pushed["i0"][0], pushed["i1"][0]]
    assert rf.take(0, cs, plan_of_mean(cs)) is None
