"""`diloco run` gives GPU learners and the syncer separate halves of the machine's CPUs
(local/run.py cpu_split), through DILOCO_CPUS, which each process keeps to (cpus.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from diloco_trainer.api.contract import CPUS, ContractError, format_cpu_list, parse_cpu_list
from diloco_trainer.local.run import cpu_split, gpu_learner_threads


def test_cpu_lists_read_and_write_ranges() -> None:
    assert parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpu_list(" 5 ,1-2,") == {1, 2, 5}
    assert format_cpu_list(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    assert parse_cpu_list(format_cpu_list(frozenset({7}))) == {7}


@pytest.mark.parametrize("bad", ["", "a", "3-1", "-2", "1-x", ","])
def test_a_wrong_cpu_list_is_refused_with_the_variable_named(bad: str) -> None:
    with pytest.raises(ContractError, match=CPUS):
        parse_cpu_list(bad)


def test_gpu_learners_and_the_syncer_get_separate_halves() -> None:
    learners, syncer = cpu_split(frozenset(range(16)), "cuda") or (None, None)
    assert learners == set(range(8)) and syncer == set(range(8, 16))
    odd = cpu_split(frozenset({0, 2, 4, 6, 9}), "cuda")
    assert odd == ({0, 2}, {4, 6, 9})


def test_cpu_learners_and_small_machines_share_every_cpu() -> None:
    assert cpu_split(frozenset(range(16)), "cpu") is None
    assert cpu_split(frozenset(range(16)), "auto") is None  # may be the CPU: not split
    assert cpu_split(frozenset(range(16)), "cuda:1") is not None
    assert cpu_split(frozenset(range(3)), "cuda") is None


def test_a_process_keeps_to_its_cpus_and_sizes_its_threads_by_them() -> None:
    mine = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env[CPUS] = str(mine[-1])
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, torch; from diloco_trainer.cpus import configure_threads; "
            "configure_threads(); print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == [f"[{mine[-1]}]", "1"]


def test_a_wrong_cpu_list_stops_the_syncer_with_exit_2_and_the_variable_named() -> None:
    env = dict(os.environ, **{CPUS: "7-1"})
    out = subprocess.run(
        [sys.executable, "-m", "diloco_trainer.cli", "syncer"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert CPUS in out.stderr and "Traceback" not in out.stderr


def test_a_gpu_learner_leaves_two_of_its_cpus_to_its_training_and_link_threads() -> None:
    assert [gpu_learner_threads(n) for n in (1, 2, 3, 8)] == [1, 1, 1, 6]
