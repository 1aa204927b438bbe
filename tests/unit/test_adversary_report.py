"""bench/adversary's report arithmetic: each run's ratio against its own seed's baseline at equal
honest tokens, the mean over seeds and the verdict that reads the mean's noise (hand-worked)."""

from __future__ import annotations

import argparse
import doctest

from bench.harness import adversary_report
from bench.harness.adversary_report import Outcome, spreads


def outcome(variant: str, seed: int, tokens: int, loss: float) -> Outcome:
    # The baseline's curve: 4.0 at 0 tokens, 2.0 at 100 (seed 0) or 3.0 at 100 (seed 1).
    history = [(0.0, 4.0), (100.0, 2.0 + seed)] if variant == "none" else []
    return Outcome(variant, seed, tokens, loss, history, {}, {}, ["active"] * 2, 1.0)


def runs() -> list[Outcome]:
    return [
        outcome("none", 0, 100, 2.0),
        outcome("none", 1, 100, 3.0),
        # seed 0: the baseline at 50 tokens is 3.0 -> 3.3 / 3.0 = 1.1; seed 1: at 50, 3.5 ->
        # 3.15 / 3.5 = 0.9
        outcome("flood", 0, 50, 3.3),
        outcome("flood", 1, 50, 3.15),
        # no baseline of seed 2: left out of every mean
        outcome("flood", 2, 50, 9.0),
        outcome("none_again", 0, 100, 2.02),
        outcome("none_again", 1, 100, 3.0),
    ]


def test_adversary_report_doctests_pass() -> None:
    result = doctest.testmod(adversary_report)
    assert result.attempted >= 10 and result.failed == 0, result


def test_each_ratio_is_against_its_own_seeds_baseline_at_its_honest_tokens() -> None:
    by = spreads(runs())
    assert set(by) == {"flood", "none_again"}  # the baseline's own ratio is not a result
    flood = by["flood"]
    assert flood.n == 2
    assert abs(flood.low - 0.9) < 1e-12 and abs(flood.high - 1.1) < 1e-12
    assert abs(flood.mean - 1.0) < 1e-12
    # sd of (1.1, 0.9): sqrt(2 x 0.01 / 1) = 0.1414; se = 0.1414 / sqrt 2 = 0.1
    assert abs(flood.se - 0.1) < 1e-12
    assert abs(by["none_again"].mean - 1.005) < 1e-12  # (1.01 + 1.0) / 2


def test_a_mean_whose_noise_spans_the_target_is_not_called_met() -> None:
    args = argparse.Namespace(preset="gpt-tiny", inner_steps=10, steps=200)
    report = adversary_report.report(runs(), args)
    # flood's mean is exactly 1.0, but ± 12.706 x 10% (t for 1 degree of freedom) spans past 2%.
    assert "flood 1.0000x ± 127.06% (not resolved)" in report.summary
    assert "not resolved (flood)" in report.summary
    assert "the honest rerun 1.0050x" in report.summary
    means, each = report.tables
    assert [r[0] for r in means.rows] == ["flood", "none_again"]
    assert len(each.rows) == len(runs()) - 1  # the seed without a baseline has no row


def test_adversary_bench_islands_flag_sets_the_honest_islands_and_the_job() -> None:
    """bench/adversary.py --islands M: M - 1 honest learners and the adversary as island M-1; the
    job has M islands, a round waits for the honest ones, the budget is theirs (issue 46)."""
    from bench import adversary

    args = argparse.Namespace(
        preset="gpt-tiny", inner_steps=10, steps=100, batch_size=8, seq_len=64, inner_lr=3e-3,
        warmup=20, eval_tokens=8192, quality_guard=None, end_on_faint=False, pair_clip=0.0,
        pair_credit=False,
    )  # fmt: skip
    try:
        for m in (2, 5):
            adversary.set_islands(m)
            assert tuple(f"island-{i}" for i in range(m - 1)) == adversary.HONEST
            assert f"island-{m - 1}" == adversary.ADVERSARY
            spec = adversary.job_spec(args, 0, "paced_ratchet")
            assert (spec.islands.count, spec.sync.quorum) == (m, m - 1)
            assert spec.stop_after.tokens == (m - 1) * 100 * 8 * 64
            assert spec.syncer.quality_guard.margin == 0.25  # the spec's default
        # --quality-guard 0.05/3/0: every run's syncer.qualityGuard.
        args.quality_guard = "0.05/3/0"
        guard = adversary.job_spec(args, 0, "faint_claims").syncer.quality_guard
        assert (guard.margin, guard.patience, guard.warmup_outer_steps) == (0.05, 3, 0)
        # --end-on-faint: syncer.guards.endOnFaint (off by default).
        assert adversary.job_spec(args, 0, "faint_claims").syncer.guards.end_on_faint is False
        args.end_on_faint = True
        assert adversary.job_spec(args, 0, "faint_claims").syncer.guards.end_on_faint is True
    finally:
        adversary.set_islands(3)
    assert adversary.HONEST == ("island-0", "island-1") and adversary.ADVERSARY == "island-2"


def test_a_guard_ended_run_names_its_kept_model_against_the_baseline_at_its_own_tokens() -> None:
    """Issue 46: the guard kept a checkpoint holding 20 honest tokens while the job merged 50
    before it ended; the ratio column reads the kept loss 3.5 at 50 (3.5 / 3.0 = 1.1667x), the
    ended cell at its own 20 tokens, where seed 0's baseline is 4.0 - 2.0 x 20 / 100 = 3.6:
    3.5 / 3.6 = 0.9722x (not degraded)."""
    from bench.harness.adversary_report import ended_cell, per_run_table

    guarded = Outcome(
        "faint_claims", 0, 50, 3.5, [], {}, {}, ["active"], 1.0,
        ended="quality guard at outer step 9 (kept 1)", kept_tokens=20,
    )  # fmt: skip
    outcomes = [*runs()[:2], guarded]
    assert ended_cell(outcomes, guarded) == (
        "quality guard at outer step 9 (kept 1); kept model 0.9722x the baseline at its 20 "
        "honest tokens"
    )
    table, _ = per_run_table(outcomes)
    row = next(r for r in table.rows if r[1] == "faint_claims")
    assert row[5] == "1.1667x" and row[-1].endswith("0.9722x the baseline at its 20 honest tokens")
    # A run that reached its budget: unchanged.
    assert ended_cell(outcomes, runs()[2]) == "budget"


def test_no_worse_judges_only_the_side_an_adversary_can_hurt() -> None:
    # Ratios 0.97 ... 1.01: mean 0.99, sd sqrt(0.001 / 4) = 1.5811%, se = 1.5811% / sqrt 5 =
    # 0.70711%, w = t(4) 2.776 x 0.70711% = 1.9629%: upper bound 1.009629 <= 1.01, met; the
    # two-sided reading at 1% is not (|0.99 - 1| + 1.96% > 1%).
    better = adversary_report.Spread.of([0.97, 0.98, 0.99, 1.0, 1.01])
    assert abs(adversary_report.upper_bound(better) - 1.0096293) < 1e-6
    assert adversary_report.no_worse(better) == "met"
    assert adversary_report.judge(better, 0.01) == "not resolved"
    # The same spread about 1.01: 1.01 + 1.96% > 1.01 and 1.01 - 1.96% < 1.01: not resolved.
    level = adversary_report.Spread.of([0.99, 1.0, 1.01, 1.02, 1.03])
    assert adversary_report.no_worse(level) == "not resolved"
    # About 1.04: 1.04 - 1.96% = 1.0204 > 1.01: MISSED.
    worse = adversary_report.Spread.of([1.02, 1.03, 1.04, 1.05, 1.06])
    assert adversary_report.no_worse(worse) == "MISSED"
    # The target is a parameter: at 3%, 1.0204 <= 1.03 < 1.0596 (1.04 + 1.96%): not resolved.
    assert adversary_report.no_worse(worse, 0.03) == "not resolved"


def test_the_mean_table_and_summary_carry_the_one_sided_reading() -> None:
    args = argparse.Namespace(preset="gpt-tiny", inner_steps=10, steps=200)
    report = adversary_report.report(runs(), args)
    means, _ = report.tables
    flood = dict(zip(means.columns, means.rows[0], strict=True))
    # flood: mean 1.0, w = 12.706 x 10% = 127.06%: upper 2.2706x. Over the rerun, 1.1 / 1.01 =
    # 1.0891089 and 0.9 / 1.0: mean 0.9945545, se = half their difference 0.0945545, w = 12.706
    # x se = 1.2014089: upper 2.1960x.
    column = "no worse than 1% (one-sided): upper bound of the 95% interval, of the baseline / "
    cell = flood[column + "of the honest rerun"]
    assert cell == "2.2706x not resolved / 2.1960x not resolved"
    assert "No worse than 1% (one-sided, issue 46 at three islands): flood not resolved" in (
        report.summary
    )
