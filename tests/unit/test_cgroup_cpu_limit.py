"""The learner's CPU budget reads the pod's CPU limit on cgroup v2 and on cgroup v1 nodes (the
real node of tests/node is cgroup v1: its learners got every node CPU as threads before)."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_trainer.learner import device


def test_quota_cpus_rounds_up_and_reads_no_limit() -> None:
    assert device.quota_cpus(-1, 100_000) is None  # cgroup v1 without a limit
    assert device.quota_cpus(100_000, 100_000) == 1
    assert device.quota_cpus(150_000, 100_000) == 2
    assert device.quota_cpus(10_000, 100_000) == 1  # 100m still gets one thread


@pytest.mark.parametrize(
    ("v2", "v1", "want"),
    [
        ("max 100000\n", None, None),
        ("200000 100000\n", None, 2),
        (None, ("100000\n", "100000\n"), 1),  # cgroup v1: limits.cpu 1
        (None, ("-1\n", "100000\n"), None),
        (None, None, None),
    ],
)
def test_cgroup_cpu_limit_v2_then_v1(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    v2: str | None,
    v1: tuple[str, str] | None,
    want: int | None,
) -> None:
    v2_file = tmp_path / "cpu.max"
    if v2 is not None:
        v2_file.write_text(v2)
    v1_dir = tmp_path / "cpu"
    if v1 is not None:
        v1_dir.mkdir()
        (v1_dir / "cpu.cfs_quota_us").write_text(v1[0])
        (v1_dir / "cpu.cfs_period_us").write_text(v1[1])
    monkeypatch.setattr(device, "CGROUP_V2_CPU_MAX", str(v2_file))
    monkeypatch.setattr(device, "CGROUP_V1_CPU", (str(v1_dir),))
    assert device.cgroup_cpu_limit() == want
