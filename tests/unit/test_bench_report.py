"""The decoupled-quality report's arithmetic (time to a loss, how far a run went): its
hand-worked doctests run with the unit tier, so a change of rule fails here."""

from __future__ import annotations

import doctest

from bench import decoupled_quality_report


def test_bench_report_doctests_pass() -> None:
    result = doctest.testmod(decoupled_quality_report)
    assert result.attempted >= 5 and result.failed == 0, result
