"""Where each island of a local job computes (`diloco run --island-device I=DEVICE`).

In a cluster an island's device follows its pods: a learner picks CUDA when its pod has a GPU
(DILOCO_DEVICE unset: `auto`), so `islands.overrides` that give some islands no GPU resources
put those islands on the CPU. A local run has one machine and, by default, one device for every
learner (DILOCO_DEVICE from the command's environment, cpu when unset); `--island-device`
gives some islands another one, e.g. a CPU island beside GPU islands on a machine with one GPU
(issue 47: islands of different speeds). Pure: no torch, no environment; whether the machine
has the device named is the learner's own check (learner/device.py), run before anything starts
(local/run.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

OPTION = "--island-device"
# What a learner accepts in DILOCO_DEVICE (learner/device.pick_device): auto (CUDA when
# available), cpu, cuda, or one GPU by its index.
DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def parse_island_devices(values: Sequence[str], count: int) -> dict[int, str]:
    """`--island-device I=DEVICE` options -> {island index: device}; ValueError naming the
    option for a malformed entry, an island outside [0, count), a device a learner does not
    take, or one island named twice with different devices."""
    out: dict[int, str] = {}
    for raw in values:
        index_s, sep, device = raw.partition("=")
        device = device.strip()
        try:
            if not sep:
                raise ValueError
            index = int(index_s)
        except ValueError:
            raise ValueError(f"{OPTION} {raw!r}: expected I=DEVICE, e.g. 3=cpu") from None
        if not 0 <= index < count:
            raise ValueError(f"{OPTION} {raw!r}: island must be in [0, {count})")
        if not DEVICE_NAME.fullmatch(device):
            raise ValueError(f"{OPTION} {raw!r}: DEVICE must be cpu, cuda, cuda:N or auto")
        if out.get(index, device) != device:
            raise ValueError(f"{OPTION} {raw!r}: island {index} is already on {out[index]}")
        out[index] = device
    return out


def island_device(index: int, default: str, overrides: Mapping[int, str]) -> str:
    """Island `index`'s device: its `--island-device`, else the job's `default` (every rank of
    an island on the same device: DDP inside an island runs one backend)."""
    return overrides.get(index, default)


def devices_to_check(default: str, overrides: Mapping[int, str]) -> list[tuple[str, str]]:
    """(device, what named it) for each device other than the job's default that some island
    is put on, in island order, each once: what the run checks before anything starts (the
    default device is checked with the rest of the job)."""
    out: dict[str, str] = {}
    for index in sorted(overrides):
        device = overrides[index]
        if device != default and device not in out:
            out[device] = f"{OPTION} {index}={device}"
    return list(out.items())
