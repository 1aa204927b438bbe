"""The CPU budget (learners and the syncer) reads the pod's CPU limit on cgroup v2 and on cgroup
v1 nodes (the real node of tests/node is cgroup v1: its learners got every node CPU as threads
before)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from diloco_trainer import cpus as device


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


def test_configure_threads_follows_the_quota_unless_omp_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU process's torch threads are its CPU budget (a quota of 1 CPU: one thread), unless
    OMP_NUM_THREADS says otherwise (`diloco run` sets it)."""
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("100000 100000\n")  # limits.cpu: 1
    monkeypatch.setattr(device, "CGROUP_V2_CPU_MAX", str(cpu_max))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        device.configure_threads()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        device.configure_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_syncer_sets_its_threads_before_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """`diloco syncer` sizes torch's threads to its pod's CPU limit before it builds anything
    (torch's default is the node's core count). The quota itself cannot be set here, so the two
    calls are recorded in their order."""
    from diloco_trainer.syncer.service import service

    calls: list[str] = []
    monkeypatch.setattr(service, "configure_threads", lambda: calls.append("threads"))
    monkeypatch.setattr(service.server, "run", lambda factory: calls.append("serve") or 0)
    assert service.main(argparse.Namespace()) == 0
    assert calls == ["threads", "serve"]
