"""bench/heldout_quorum's pure parts: the pooled ratio K = 1 / K = M with its interval, the
verdict against 1.01, the runs that would resolve it, and the learners' import path."""

from __future__ import annotations

import doctest
import math
import os

import pytest

from bench import heldout_quorum
from bench.harness.hetero_figures import Kept, repeats_to_resolve
from bench.heldout_quorum import TARGET, import_path, pooled_ratio, verdict


def run(seed: int, quorum: int, loss: float) -> dict[str, object]:
    return {"seed": seed, "quorum": quorum, "loss": loss}


def test_pooled_ratio_divides_each_seed_by_its_own_k_equals_m_mean() -> None:
    # Seed 0: K = 4 at 2.0 and 2.2 (mean 2.1), K = 1 at 2.1 -> 0.952381, 1.047619 and 1.0.
    # Seed 1: K = 4 at 1.0 (alone: 1.0), K = 1 at 1.02 -> 1.02.
    runs = [run(0, 4, 2.0), run(0, 4, 2.2), run(0, 1, 2.1), run(1, 4, 1.0), run(1, 1, 1.02)]
    kept = pooled_ratio(runs, 4)
    assert kept is not None
    # K = 1 side: 1.0, 1.02 (mean 1.01); K = 4 side: 0.952381, 1.047619, 1.0 (mean 1.0).
    assert kept.ratio == pytest.approx(1.01)
    assert kept.per_run == pytest.approx((1.0, 1.02))
    assert kept.baselines == pytest.approx((2.0 / 2.1, 2.2 / 2.1, 1.0))
    # Pooled relative noise: squares (0.047619^2 x 2 + 0) + ((1/1.01 - 1)^2 + (1.02/1.01 - 1)^2)
    # = 0.0045351 + 0.0001960 = 0.0047311 over 2 + 3 - 2 = 3 degrees of freedom -> s = 0.039712;
    # se = s x sqrt(1/2 + 1/3) = 0.036252; half = 1.01 x t(3) = 3.182 x that = 0.116512.
    assert kept.half_width == pytest.approx(0.116512, rel=1e-4)


def test_pooled_ratio_leaves_out_a_seed_without_both_sides() -> None:
    runs = [run(0, 4, 2.0), run(0, 1, 2.02), run(1, 1, 9.0)]
    kept = pooled_ratio(runs, 4)
    assert kept is not None and kept.ratio == pytest.approx(1.01)
    assert math.isnan(kept.half_width)  # one run a side: no noise estimate
    assert pooled_ratio([run(0, 4, 2.0)], 4) is None


@pytest.mark.parametrize(
    ("ratio", "half", "expected"),
    [
        (1.004, 0.006, "met"),  # 1.010 at the top: on the target counts as within it
        (1.004, 0.0061, "not resolved"),
        (1.016, 0.0059, "MISSED"),  # 1.0101 at the bottom
        (1.016, 0.006, "not resolved"),  # 1.010 at the bottom: not above
        (0.99, math.nan, "not resolved"),
    ],
)
def test_verdict_against_one_percent(ratio: float, half: float, expected: str) -> None:
    assert TARGET == 1.01
    assert verdict(Kept(ratio, half, (), ())) == expected


def test_repeats_to_resolve_takes_the_quorum_target() -> None:
    # 3 runs a side, half-width 0.012 at ratio 1.0: s = 0.012 / (1.0 x t(4) 2.776 x sqrt(2/3))
    # = 0.0052942. Against 1.01 (margin 0.01) n runs a side resolve once
    # t(2n-2) x 0.0052942 x sqrt(2/n) < 0.01: n = 3 gives 0.0120 (not <), n = 4: t(6) 2.447 x
    # 0.0052942 x 0.70711 = 0.00916 < 0.01.
    kept = Kept(1.0, 0.012, (1.0,) * 3, (1.0,) * 3)
    assert repeats_to_resolve(kept, target=TARGET) == 4
    # The default target stays 0.97 (margin 0.03): n = 2 gives t(2) 4.303 x 0.0052942 x 1
    # = 0.0228 < 0.03.
    assert repeats_to_resolve(kept) == 2


def test_import_path_puts_the_models_first_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/a", "/b"]))
    path = import_path(["byo", "ngram-mlp"]).split(os.pathsep)
    assert path[0].endswith(os.path.join("examples", "byo"))
    assert path[2:] == ["/a", "/b"]
    assert len(path) == 4


def test_doctests_pass() -> None:
    result = doctest.testmod(heldout_quorum)
    assert result.attempted > 0 and result.failed == 0


def test_the_ngram_mlp_trains_on_contexts_not_sequences() -> None:
    from diloco_trainer.api.spec import parse_spec
    from diloco_trainer.models.parts import build_parts

    from bench.harness.common import REPO_ROOT
    from bench.heldout_quorum import CORPUS
    from bench.user_models.ngram_mlp import CONTEXT

    spec = parse_spec(
        {
            "model": {"entrypoint": "bench.user_models.ngram_mlp:build"},
            "data": {"source": str(REPO_ROOT / CORPUS), "evalTokens": 1040},
            "inner": {"batchSize": 2, "seqLen": 32},
        }
    )
    parts = build_parts(spec, shard_index=1, num_shards=4)
    assert parts.train is not None
    batch = parts.train.next_batch()
    # batchSize x seqLen = 64 examples of 8 bytes, one predicted byte each.
    assert tuple(batch.inputs.shape) == (64, CONTEXT) and tuple(batch.targets.shape) == (64,)
    assert batch.tokens == 64
    # The pinned held-out set: 1040 examples in batches of 64 (16 x 64 + 16).
    assert [b.tokens for b in parts.eval_batches] == [64] * 16 + [16]
    loss = float(parts.loss_fn(parts.model, batch).detach())
    assert abs(loss - math.log(256)) < 0.5  # untrained: about uniform over bytes
