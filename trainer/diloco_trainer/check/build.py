"""Calling a job's `model.entrypoint` once, as a learner will, and reporting its own error first.

A user's `build` that raises is a bad input like any other: the person needs their exception and
the line of their code that raised it, not the trainer's frames around it.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import diloco_trainer
from diloco_trainer.api.spec import ConfigError, JobSpec

_PACKAGE = str(Path(diloco_trainer.__file__).resolve().parent)


def user_frame(err: BaseException) -> str | None:
    """'file:line in function' of the deepest frame outside this package (the user's code)."""
    frames = traceback.extract_tb(err.__traceback__)
    theirs = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_PACKAGE)]
    if not theirs:
        return None
    last = theirs[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def build_once(spec: JobSpec) -> dict[str, int]:
    """Build the entrypoint's parts for island 0, rank 0 on the CPU; the model's tensors and
    their elements. ConfigError (first line: the user's exception) when it raises."""
    from diloco_trainer.models.parts import build_parts

    entry = spec.model.entrypoint
    try:
        parts = build_parts(spec, shard_index=0, num_shards=spec.total_shards(), device="cpu")
    except ConfigError:
        raise
    except Exception as err:  # the user's code: any exception is theirs to see
        where = user_frame(err)
        lines = [f"model.entrypoint {entry!r} raised {type(err).__name__}: {err}"]
        if where is not None:
            lines.append(f"  at {where}")
        raise ConfigError("\n".join(lines)) from None
    return {name: p.numel() for name, p in parts.model.named_parameters()}
