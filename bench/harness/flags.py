"""The flags several benchmarks share, each written once: its name, type and help here, its
default in the benchmark that uses it (`base_parser(__doc__, islands=4, inner_steps=20, ...)` in
bench/harness/common.py), because the defaults are what makes each benchmark fit its time budget."""

from __future__ import annotations

import argparse
from typing import Any

CODECS = ("none", "fp16", "bf16", "int8", "int4")

# Keyword (the flag with `-` for `_`) -> add_argument options but the default.
SHARED_FLAGS: dict[str, dict[str, Any]] = {
    "preset": {"help": "model preset (gpt-tiny, gpt-mini, ...)"},
    "islands": {"type": int, "help": "M: islands (DDP workers, torchft replicas)"},
    "inner_steps": {"type": int, "help": "H: inner steps per outer round"},
    "steps": {"type": int, "help": "S: inner steps per island"},
    "batch_size": {"type": int},
    "seq_len": {"type": int},
    "inner_lr": {"type": float},
    "warmup": {"type": int, "help": "inner warm-up steps"},
    "eval_tokens": {"type": int},
    "seeds": {"type": int, "nargs": "+"},
    "seconds": {"type": float, "help": "measured window W (s)"},
    "warmup_timeout": {"type": float, "help": "longest wait for the first sync (s)"},
    "timeout": {"type": float, "help": "per run (s)"},
    "codec": {"choices": list(CODECS), "help": "ours' push compression"},
    "skip_torchft": {"action": "store_true", "help": "leave torchft's DiLoCo out"},
}

# The model and batch every training benchmark starts from (each may override one).
TRAINING: dict[str, Any] = {"preset": "gpt-tiny", "batch_size": 8, "seq_len": 64}
# The inner optimizer of the benchmarks that compare loss at equal tokens.
INNER_OPTIMIZER: dict[str, Any] = {"inner_lr": 3e-3, "warmup": 20}
# The benchmarks that measure a window of wall time, ours against torchft (decoupling, goodput).
WALL_CLOCK: dict[str, Any] = {
    "inner_steps": 20,
    "eval_tokens": 4096,
    "codec": "none",
    "skip_torchft": False,
    "warmup_timeout": 300,
}


def add_shared_flags(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add `--NAME` for each keyword (a key of SHARED_FLAGS) with the value as its default."""
    for name, default in defaults.items():
        if name not in SHARED_FLAGS:
            raise ValueError(f"no shared benchmark flag {name!r} (known: {sorted(SHARED_FLAGS)})")
        options = SHARED_FLAGS[name]
        flag = "--" + name.replace("_", "-")
        if options.get("action") == "store_true":
            parser.add_argument(flag, **options)  # store_true flags default to False
        else:
            parser.add_argument(flag, default=default, **options)


def inner_section(args: argparse.Namespace) -> dict[str, Any]:
    """The job spec's `inner` section that the shared flags --inner-lr, --warmup,
    --inner-steps, --batch-size and --seq-len spell (camelCase, as a manifest says it)."""
    return {
        "lr": args.inner_lr,
        "warmupSteps": args.warmup,
        "steps": args.inner_steps,
        "batchSize": args.batch_size,
        "seqLen": args.seq_len,
    }
