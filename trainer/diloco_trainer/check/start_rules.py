"""What a job's processes refuse when they start, asked before any of them does.

`diloco check` and `diloco run` call these (check_job), and they call the very functions the
learner and the syncer call at start: the spec read back from the JSON the processes receive,
the learner's device and precision (learner/device.py, learner/inner_step.py), the syncer's
split of the model into sync.fragments (core/fragments.py) on the model's real tensors. So a job
`diloco check` passes does not fail there (tests/unit/test_check_start_rules.py generates jobs to
show it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from diloco_trainer.api.contract import ContractError
from diloco_trainer.api.preflight import schedule_errors
from diloco_trainer.api.spec import ConfigError, JobSpec, parse_spec


def spec_problems(spec: JobSpec) -> list[str]:
    """The spec as the processes read it (spec.json), and the rules of its schedule."""
    try:
        parse_spec(json.loads(spec.to_json()))
    except ConfigError as err:  # a field the processes would read differently
        return [f"the spec as the processes read it: {err}"]
    return schedule_errors(spec)


def device_problems(spec: JobSpec, device: str) -> list[str]:
    """The learners' device (DILOCO_DEVICE) and inner.precision on it, as a learner checks them."""
    from diloco_trainer.learner.device import pick_device
    from diloco_trainer.learner.inner_step import check_precision

    try:
        picked = pick_device(device)
        check_precision(spec.inner.precision, picked)
    except (ConfigError, ContractError) as err:
        return [str(err)]
    return []


def cluster_device_warnings(spec: JobSpec) -> list[str]:
    """inner.precision fp16 where no island's pods ask for a GPU (a learner refuses it there)."""
    if spec.inner.precision != "fp16":
        return []
    for i in range(spec.islands.count):
        limits = spec.islands.resources_of(i).get("limits") or {}
        if not any("gpu" in str(k) for k in limits):
            return [
                f"inner.precision fp16 needs CUDA, and island {i}'s resources.limits ask for no "
                "GPU: its learners will refuse to start on a CPU (use bf16 or fp32, or give the "
                "islands a GPU)"
            ]
    return []


def fragment_problem(sizes: Mapping[str, int], spec: JobSpec) -> str | None:
    """sync.fragments against the model's tensors, split as the syncer splits them."""
    from diloco_trainer.core.fragments import split_fragments

    try:
        split_fragments(sizes, spec.sync.fragments)
    except ValueError as err:
        return (
            f"{err}: lower sync.fragments to at most {len(sizes)} (each fragment holds at least "
            "one tensor)"
        )
    return None


def builtin_tensor_sizes(spec: JobSpec, vocab_size: int) -> dict[str, int]:
    """The built-in GPT's tensors and their bytes, built on the meta device (no memory)."""
    import torch

    from diloco_trainer.models.model import build_model

    with torch.device("meta"):
        model = build_model(
            spec.model.preset,
            spec.inner.seq_len,
            vocab_size,
            activation_checkpointing=spec.model.activation_checkpointing,
        )
    return {n: t.numel() * 4 for n, t in model.named_parameters()}
