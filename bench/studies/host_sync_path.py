"""A host learner's sync path, a pass at a time: what a CPU learner's training thread (and its
link's worker thread) spends per fragment on a push, a receipt and a compressed pull, against
the ops they replaced and a copy of the same bytes, all measured in this run; and a push made
in one sliced pass against the same push over one flat buffer, which a host learner uses for a
fragment of at most push_encoding.ONE_PASS_FROM values.

The fragment is the preset's --fragment of --fragments (core/fragments.split_fragments over
the model's parameters, as a job splits it), its weights the model's initial ones, its base and
the syncer's update small random moves of them. Each case runs --repeats times, old and new in
turn; the median and the fastest are printed, with the ratio of the first path's median to the
second's (old / new). Both paths give the same bytes (tests/unit/test_learner_push_encoding.py,
test_learner_mixing.py, test_published.py); this measures only their time.

    python -m bench.studies.host_sync_path                       # gpt-125m, 2 fragments, one thread
    python -m bench.studies.host_sync_path --fragment 1           # the one with the embedding
    python -m bench.studies.host_sync_path --preset gpt-mini      # a fragment under ONE_PASS_FROM
    taskset -c 0 python -m bench.studies.host_sync_path --threads 1
    THP_MEM_ALLOC_ENABLE=1 python -m bench.studies.host_sync_path  # torch's allocations, huge pages

Torch-only besides the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.core import compress
from diloco_trainer.core.fragments import split_fragments
from diloco_trainer.core.published import apply_updates
from diloco_trainer.learner.device_copies import snapshot
from diloco_trainer.learner.mixing import pseudo_gradient, received_weights, received_weights_into
from diloco_trainer.learner.push_encoding import encode_int8_batched, snapshot_and_encode_int8
from diloco_trainer.models.model import build_model

from bench.harness.in_turn import times_in_turn


def timed(cases: list[Callable[[], object]], repeats: int) -> list[dict[str, float]]:
    """Median and fastest wall seconds of each of `cases` over `repeats` runs, taken in turn
    (bench/harness/in_turn.py)."""
    return [
        {"median": statistics.median(t), "fastest": min(t)} for t in times_in_turn(cases, repeats)
    ]


def old_push(params: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> object:
    """The three passes the one-pass push replaced: snapshot, Δ, the per-tensor int8 encoding."""
    local = snapshot(params)
    return local, compress.encode_tensors(pseudo_gradient(base, local), "int8", on=None)


def old_rebuild(base: dict[str, torch.Tensor], update: dict[str, torch.Tensor]) -> object:
    """A pull's rebuild with each tensor decoded whole, then added."""
    out = {n: t.clone() for n, t in base.items()}
    for n, t in out.items():
        t.add_(compress.decode_tensor(update, n, "int8", t.shape))
    return out


def install(params: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> None:
    """The loop's copy of the received weights into the parameters (Learner._apply)."""
    names = list(params)
    torch._foreach_copy_([params[n] for n in names], [target[n] for n in names])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    model = build_model(args.preset, args.seq_len)
    named = {n: p.detach() for n, p in model.named_parameters()}
    names = split_fragments({n: t.numel() for n, t in named.items()}, args.fragments)
    params = {n: named[n].clone() for n in names[args.fragment]}
    del model, named
    g = torch.Generator().manual_seed(args.seed)
    base = {n: p + 1e-3 * torch.randn(p.shape, generator=g) for n, p in params.items()}
    update = compress.encode_tensors(
        {n: 1e-4 * torch.randn(p.shape, generator=g) for n, p in params.items()}, "int8"
    )
    merged = apply_updates(base, [update], "int8")
    pushed = snapshot(params)
    feedback = (compress.ErrorFeedback(), compress.ErrorFeedback())  # one for each path
    # The new receipt writes over the push's copies; run again, it reads the copies it wrote
    # (other values, the same work: no value here is near a denormal).
    cases: dict[str, dict[str, Callable[[], object]]] = {
        "copy of the fragment (floor)": {"old": lambda: snapshot(params)},
        "push": {
            "old": lambda: old_push(params, base),
            "new": lambda: snapshot_and_encode_int8(params, base, None),
        },
        "push, error feedback on": {
            "one pass": lambda: snapshot_and_encode_int8(params, base, feedback[0]),
            "flat buffer": lambda: encode_int8_batched(
                pseudo_gradient(base, snapshot(params)), feedback[1]
            ),
        },
        "receipt and install": {
            "old": lambda: install(params, received_weights(merged, params, pushed)),
            "new": lambda: install(params, received_weights_into(merged, params, pushed)),
        },
        "pull rebuild (link thread)": {
            "old": lambda: old_rebuild(base, update),
            "new": lambda: apply_updates(base, [update], "int8"),
        },
    }
    rows = {
        name: dict(zip(fns, timed(list(fns.values()), args.repeats), strict=True))
        for name, fns in cases.items()
    }
    sizes = [params[n].numel() for n in params]
    return {
        "preset": args.preset,
        "fragment": args.fragment,
        "fragment_values": sum(sizes),
        "tensors": len(sizes),
        "largest_tensor": max(sizes),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        "cases": rows,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['preset']}: fragment {result['fragment']}, {result['fragment_values']:,} values "
        f"in {result['tensors']} tensors (the largest {result['largest_tensor']:,}); "
        f"{result['threads']} thread(s); THP_MEM_ALLOC_ENABLE={result['thp'] or 'unset'}; "
        f"{result['repeats']} runs each, in turn (median / fastest, s)"
    ]
    for name, row in result["cases"].items():
        text = f"  {name:30s}" + "".join(
            f"   {label} {t['median']:.4f} / {t['fastest']:.4f}" for label, t in row.items()
        )
        if len(row) == 2:
            first, second = row.values()
            text += f"   {' / '.join(row)} {first['median'] / second['median']:.2f}"
        lines.append(text)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="gpt-125m")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--fragments", type=int, default=2, help="the job's sync.fragments")
    p.add_argument("--fragment", type=int, default=0, help="which fragment to time")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the result here as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
