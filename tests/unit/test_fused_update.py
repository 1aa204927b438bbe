"""The syncer's fused merge (core/fused_update.py): a plain round's outer step and θ_pub's int8
update in one loop are bit for bit the torch path's (core/outer.py's slices with
core/published.UpdateWriter's), and only plain rounds take it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diloco_trainer.api.spec import ConfigError
from diloco_trainer.core import fused_update
from diloco_trainer.core.compress import SLICE
from diloco_trainer.core.fused_update import nesterov_int8_slice
from diloco_trainer.core.outer import OuterOptimizer
from diloco_trainer.core.published import UpdateWriter
from diloco_trainer.syncer.merging import global_model
from diloco_trainer.syncer.service.service import Syncer

from .test_syncer import FakeClock, body, delta, make_spec, run, started

# Several slices, odd tails, tensors shorter than a vector register and than a codec block.
SHAPES = {"a": (2 * SLICE + 1000,), "b": (300, 129), "c": (3,), "d": (1,), "e": (127,)}
LR, BETA = 0.7, 0.9


def _fused(writer: UpdateWriter, divisors: dict[str, float], calls: list[str]):  # type: ignore[no-untyped-def]
    """GlobalModel._fused_slices' callback, on a writer of our own."""

    def fused(name: str, sl: slice, g: torch.Tensor, theta: torch.Tensor, m: torch.Tensor) -> None:
        calls.append(name)
        published, out, q, scales = writer.int8_targets(name, sl)
        nesterov_int8_slice(
            g, divisors.get(name), m, theta, published, out, q, scales, beta=BETA, lr=LR
        )
        writer.written(name, sl)

    return fused


def _rounds(fused: bool, *, in_accumulator: bool, divide: bool) -> list[torch.Tensor]:
    """Three merges of whole rounds; everything each leaves (θ, m, θ_pub, q, scales, checksum)."""
    gen = torch.Generator().manual_seed(5)
    exact = {n: torch.randn(sh, generator=gen) for n, sh in SHAPES.items()}
    pub = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in exact.items()}
    pub["c"][1] = exact["c"][1]  # a block whose update is 0 (scale 0)
    opt = OuterOptimizer(exact, lr=LR, momentum=BETA, nesterov=True)
    got: list[torch.Tensor] = []
    calls: list[str] = []
    for rnd in range(3):
        acc = {n: torch.randn(sh, generator=gen) * 3e-2 for n, sh in SHAPES.items()}
        divisors = {n: 15.0 for n in ("a", "c", "e")} if divide else {}
        out = acc if in_accumulator else {n: torch.empty_like(t) for n, t in pub.items()}
        writer = UpdateWriter(exact, pub, sorted(SHAPES), "int8", rnd + 1, out)

        def before(
            name: str,
            sl: slice,
            acc: dict[str, torch.Tensor] = acc,
            divisors: dict[str, float] = divisors,
        ) -> None:
            if name in divisors:
                acc[name].view(-1)[sl].div_(divisors[name])

        opt.step(
            {n: acc[n] for n in sorted(acc)},
            1.0,
            complete=True,
            each=writer.slice,
            before=before,
            fused=_fused(writer, divisors, calls) if fused else None,
        )
        update = writer.finish()
        pub = out
        got += [*exact.values(), *out.values(), *update.encoded.values()]
        got += list(opt.state_tensors().values())
        got.append(torch.tensor([ord(ch) for ch in update.checksum]))
    assert bool(calls) == fused
    return got


@pytest.mark.parametrize("in_accumulator", [False, True])
@pytest.mark.parametrize("divide", [False, True])
def test_fused_merge_is_the_torch_path_bit_for_bit(in_accumulator: bool, divide: bool) -> None:
    torch_path = _rounds(False, in_accumulator=in_accumulator, divide=divide)
    fused = _rounds(True, in_accumulator=in_accumulator, divide=divide)
    assert len(torch_path) == len(fused)
    for a, b in zip(torch_path, fused, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # the bits, -0.0 included


def test_fused_slice_by_hand() -> None:
    # acc [2, -1] / 2 = g [1, -0.5]; m = 0·β + g = [1, -0.5]; u = g + β·m = [1.9, -0.95];
    # θ = [1, 1] − 0.5·u = [0.05, 1.475]; x = θ − θ_pub([0, 1]) = [0.05, 0.475]: one block
    # (padded), scale 0.475/127, q = round(x / scale) = [round(13.37), 127] = [13, 127],
    # θ_pub' = θ_pub + q·scale = [13·0.475/127, 1.475].
    acc, m, theta = torch.tensor([2.0, -1.0]), torch.zeros(2), torch.ones(2)
    pub, out = torch.tensor([0.0, 1.0]), torch.empty(2)
    q, scales = torch.empty(2, dtype=torch.int8), torch.empty(1)
    nesterov_int8_slice(acc, 2.0, m, theta, pub, out, q, scales, beta=0.9, lr=0.5)
    assert m.tolist() == [1.0, -0.5]
    assert theta.tolist() == pytest.approx([0.05, 1.475], abs=1e-6)
    assert q.tolist() == [13, 127]
    assert scales.item() == pytest.approx(0.475 / 127, rel=1e-6)
    assert out.tolist() == pytest.approx([13 * 0.475 / 127, 1.475], abs=1e-6)
    assert acc.tolist() == [2.0, -1.0]  # read, never divided in place


def test_fused_slice_refuses_what_does_not_fit() -> None:
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="sizes"):
        nesterov_int8_slice(
            t, None, torch.zeros(3), t, t, t, torch.zeros(4, dtype=torch.int8), torch.zeros(1),
            beta=0.9, lr=0.7,
        )  # fmt: skip
    with pytest.raises(ValueError, match="contiguous CPU"):
        nesterov_int8_slice(
            t.double(), None, t, t, t, t, torch.zeros(4, dtype=torch.int8), torch.zeros(1),
            beta=0.9, lr=0.7,
        )  # fmt: skip


def test_only_a_plain_round_takes_the_fused_path() -> None:
    params = {"w": torch.zeros(4)}
    opt = OuterOptimizer(params, lr=LR, momentum=BETA, nesterov=True)
    grads = {"w": torch.ones(4)}
    assert opt.plain_round(grads, 1.0, complete=True)
    assert opt.plain_round(grads, 1.0, complete=False)  # all of a round, from an empty one
    assert not opt.plain_round(grads, 0.5, complete=True)  # part of a round's work
    assert not opt.plain_round(grads, 2.0, complete=False)  # two folds
    assert not OuterOptimizer(params, lr=LR, momentum=BETA, nesterov=False).plain_round(
        grads, 1.0, complete=True
    )  # heavy ball
    assert not OuterOptimizer(params, lr=LR, momentum=0.0, nesterov=True).plain_round(
        grads, 1.0, complete=True
    )  # plain SGD
    calls: list[str] = []

    def never(*args: object) -> None:
        calls.append("called")

    opt.step(grads, 0.5, fused=never)  # opens a round: a buffer now holds half of it
    assert not opt.plain_round(grads, 1.0, complete=True)  # the buffer folds with it
    assert not opt.plain_round(grads, 1.0, complete=False)  # 0.5 closes it, 0.5 opens the next
    opt.step(grads, 1.0, complete=True, fused=never)
    assert calls == []
    assert opt.plain_round(grads, 1.0, complete=True)  # the buffer folded: plain again


def _spec() -> object:
    return make_spec(
        islands={"count": 2},
        sync={"quorum": 2, "graceSeconds": 0, "compression": "int8", "fragments": 2},
    )


def test_a_syncers_merges_are_the_same_with_and_without_the_fused_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slices: list[int] = []
    kernel = fused_update.nesterov_int8_slice

    def counted(*args: object, **kwargs: float) -> None:
        slices.append(1)
        kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fused_update, "nesterov_int8_slice", counted)

    async def scenario(fused: str, path: Path) -> tuple[str, list[bytes], Syncer]:
        monkeypatch.setenv(global_model.FUSED_MERGE_ENV, fused)
        syncer = await started(_spec(), path, FakeClock())
        for island in ("island-0", "island-1"):
            await syncer.islands.join(island, 1)
        for rnd in range(2):
            for i, island in enumerate(("island-0", "island-1")):
                for f in (0, 1):
                    push = delta(syncer, f, 10 * rnd + 2 * i + f + 1)
                    await syncer.receive_push(f, body(syncer, f, island, push))
            await syncer.tick()
        bodies = [bytes(syncer.model.published_data[f].numpy()) for f in (0, 1)]
        digest = syncer.model.digest()
        await syncer.stop()
        return digest, bodies, syncer

    fused = run(scenario("1", tmp_path / "a"))
    assert fused[2].model.pull_compression == "int8" and fused[2].model.fused
    assert slices  # the merges went through the fused loop
    slices.clear()
    torch_path = run(scenario("0", tmp_path / "b"))
    assert not torch_path[2].model.fused and not slices
    assert fused[2].state.versions == torch_path[2].state.versions == [2, 2]
    assert fused[0] == torch_path[0]  # θ_exact, the momentum and θ_pub
    assert fused[1] == torch_path[1]  # the pull bodies


def test_which_syncers_use_the_fused_loop() -> None:
    big, small = global_model.FUSED_MIN_VALUES, global_model.FUSED_MIN_VALUES - 1
    assert global_model.use_fused_merge("int8", big, "auto")
    assert global_model.use_fused_merge("int8", big, "")  # unset: auto
    assert not global_model.use_fused_merge("int8", small, "auto")  # a toy: not worth compiling
    assert global_model.use_fused_merge("int8", small, "1")
    assert not global_model.use_fused_merge("int8", big, "0")
    assert not global_model.use_fused_merge("none", big, "1")  # the loop writes int8 updates
    assert not global_model.use_fused_merge("int4", big, "1")
    with pytest.raises(ConfigError, match="DILOCO_FUSED_MERGE='yes'"):
        global_model.use_fused_merge("int8", big, "yes")
