"""`diloco run --island-device I=DEVICE` (local/island_devices.py): which islands compute on
another device than the job's, the option named in every refusal, and what a learner put there
is told (its DILOCO_DEVICE, its threads: local/cpu_plan.py)."""

from __future__ import annotations

import pytest
from diloco_trainer.api.contract import CPUS, DEVICE
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.local.cpu_plan import process_threads
from diloco_trainer.local.island_devices import (
    devices_to_check,
    island_device,
    parse_island_devices,
)
from diloco_trainer.local.run import island_device_problems


def test_island_devices_are_read_by_index() -> None:
    assert parse_island_devices([], 4) == {}
    assert parse_island_devices(["3=cpu"], 4) == {3: "cpu"}
    assert parse_island_devices(["0=cuda:1", "2=auto", "1= cuda "], 4) == {
        0: "cuda:1",
        2: "auto",
        1: "cuda",
    }
    # The same island named twice with the same device is one choice, not a conflict.
    assert parse_island_devices(["1=cpu", "1=cpu"], 2) == {1: "cpu"}


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("3", "expected I=DEVICE"),
        ("3:cpu", "expected I=DEVICE"),
        ("x=cpu", "expected I=DEVICE"),
        ("4=cpu", r"island must be in \[0, 4\)"),
        ("-1=cpu", r"island must be in \[0, 4\)"),
        ("1=gpu", "DEVICE must be cpu, cuda, cuda:N or auto"),
        ("1=cuda:", "DEVICE must be"),
        ("1=", "DEVICE must be"),
        ("1=CPU", "DEVICE must be"),
    ],
)
def test_a_bad_island_device_is_refused_with_the_option_named(raw: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"--island-device '{raw}': {why}"):
        parse_island_devices([raw], 4)


def test_one_island_on_two_devices_is_refused() -> None:
    with pytest.raises(ValueError, match="--island-device '1=cuda': island 1 is already on cpu"):
        parse_island_devices(["1=cpu", "1=cuda"], 2)


def test_an_island_not_named_keeps_the_jobs_device() -> None:
    overrides = {3: "cpu"}
    assert [island_device(i, "cuda", overrides) for i in range(4)] == [
        "cuda",
        "cuda",
        "cuda",
        "cpu",
    ]


def test_each_other_device_is_checked_once_and_the_jobs_own_not_again() -> None:
    # Islands 1 and 3 on cpu, 2 on the job's cuda: cpu checked once, named by the first.
    assert devices_to_check("cuda", {3: "cpu", 1: "cpu", 2: "cuda", 0: "cuda:1"}) == [
        ("cuda:1", "--island-device 0=cuda:1"),
        ("cpu", "--island-device 1=cpu"),
    ]
    assert devices_to_check("cpu", {1: "cpu"}) == []


def test_a_cpu_island_beside_gpu_learners_computes_with_its_whole_share() -> None:
    # The job on cuda with 16 CPUs: the learners get 0-7, the syncer 8-15 (cpu_split). Four
    # ranks share 8 CPUs: 2 each. A GPU learner keeps two of its 2 free for its training and
    # link threads: max(1, 2 - 2) = 1 intra-op thread; the CPU island computes with both.
    sixteen = frozenset(range(16))
    gpu = process_threads("learner", "cuda", 4, sixteen, None)
    cpu = process_threads("learner", "cuda", 4, sixteen, None, own="cpu")
    assert gpu == {"OMP_NUM_THREADS": "1", CPUS: "0-7"}
    assert cpu == {"OMP_NUM_THREADS": "2", CPUS: "0-7"}
    # A GPU island in a CPU job: nothing is split (the CPU learners need every core), so it
    # shares them as every learner does: threads_per_learner, not a GPU learner's.
    own_gpu = process_threads("learner", "cpu", 4, sixteen, None, own="cuda")
    assert own_gpu == process_threads("learner", "cpu", 4, sixteen, None)
    assert CPUS not in own_gpu


def test_an_island_device_a_learner_would_refuse_is_refused_before_start_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # fp16 needs CUDA: with the job on cuda, island 1 put on the CPU would exit 2 at start.
    monkeypatch.setenv(DEVICE, "cuda")
    fp16 = parse_spec({"islands": {"count": 2}, "inner": {"precision": "fp16"}})
    problems = island_device_problems(fp16, {1: "cpu"})
    assert len(problems) == 1
    assert problems[0].startswith("--island-device 1=cpu: inner.precision fp16 needs a CUDA")
    # The same island on the job's own device is not checked again (the job's check did).
    assert island_device_problems(fp16, {1: "cuda"}) == []
    fp32 = parse_spec({"islands": {"count": 2}})
    assert island_device_problems(fp32, {1: "cpu"}) == []
