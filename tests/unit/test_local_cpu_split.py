"""`diloco run` gives GPU learners and the syncer separate halves of the machine's CPUs, or the
syncer the CPUs DILOCO_SYNCER_CPUS names (local/cpu_plan.py), through DILOCO_CPUS, which each
process keeps to (cpus.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from diloco_trainer.api.contract import (
    CPUS,
    SYNCER_CPUS,
    ContractError,
    format_cpu_list,
    parse_cpu_list,
)
from diloco_trainer.local.cpu_plan import cpu_split, gpu_learner_threads, process_threads


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


def assert_refused(args: list[str], variable: str, value: str) -> None:
    """`diloco ARGS` with `variable` set to `value` exits 2 naming it, without a traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "diloco_trainer.cli", *args],
        env=dict(os.environ, **{variable: value}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert variable in out.stderr and "Traceback" not in out.stderr


def test_a_wrong_cpu_list_stops_the_syncer_with_exit_2_and_the_variable_named() -> None:
    assert_refused(["syncer"], CPUS, "7-1")


def test_a_gpu_learner_leaves_two_of_its_cpus_to_its_training_and_link_threads() -> None:
    assert [gpu_learner_threads(n) for n in (1, 2, 3, 8)] == [1, 1, 1, 6]


def test_the_syncer_keeps_to_the_cpus_named_and_the_learners_to_the_rest_on_any_device() -> None:
    eight = frozenset(range(8))
    assert cpu_split(eight, "cpu", frozenset({6, 7})) == (set(range(6)), {6, 7})
    assert cpu_split(frozenset({0, 1}), "cuda", frozenset({1})) == ({0}, {1})
    # Two CPU learner ranks share the six: three threads each; the syncer gets its two.
    learner = process_threads("learner", "cpu", 2, eight, frozenset({6, 7}))
    assert learner == {"OMP_NUM_THREADS": "3", CPUS: "0-5"}
    assert process_threads("syncer", "cpu", 2, eight, frozenset({6, 7})) == {
        "OMP_NUM_THREADS": "2",
        CPUS: "6-7",
    }
    # A GPU learner still leaves two of its CPUs to its training and link threads.
    assert process_threads("learner", "cuda", 1, eight, frozenset({7}))["OMP_NUM_THREADS"] == "5"


@pytest.mark.parametrize("syncer", [{2}, {0, 1}, {1, 5}])
def test_syncer_cpus_outside_this_process_or_leaving_none_are_refused(syncer: set[int]) -> None:
    with pytest.raises(ContractError, match=SYNCER_CPUS):
        cpu_split(frozenset({0, 1}), "cpu", frozenset(syncer))


def test_diloco_run_refuses_wrong_syncer_cpus_with_exit_2_and_the_variable_named(
    tmp_path: object,
) -> None:
    mine = sorted(os.sched_getaffinity(0))
    config = f"{tmp_path}/job.yaml"
    with open(config, "w") as f:
        f.write("model: {preset: gpt-tiny}\n")
    for bad in ("x-1", format_cpu_list(frozenset(mine)), str(max(mine) + 1)):
        assert_refused(["run", config], SYNCER_CPUS, bad)
