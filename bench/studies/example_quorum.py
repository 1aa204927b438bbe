"""The shipped example at its own quorum against the same file at quorum M, at equal tokens.

Issue 9 asks that `examples/local.yaml` at its shipped `sync.quorum` lose no more than 2% eval
loss against the same file at `quorum: M` for the same tokens. This runs the file twice per seed
with `diloco run` (a syncer and M islands as local processes, exactly what `make demo` runs),
changing only the quorum, the seeds and the stopping rule: `stopAfter.tokens` = the tokens the
file's own `stopAfter.outerSteps` rounds process (M x steps x batch x seqLen per round), so both
quorums train on the same number of tokens (the syncer's merged-token count, what
`stopAfter.tokens` counts).

    python -m bench.studies.example_quorum                     # seeds 0 and 1
    python -m bench.studies.example_quorum --seeds 0 --no-record
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from bench.harness.common import (
    REPO_ROOT,
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_ratio,
    install_signal_cleanup,
    publish,
    ratio,
    start_module,
    verdict,
    wait_all,
    workdir,
)

EXAMPLE = REPO_ROOT / "examples" / "local.yaml"
TARGET = 1.02


def variant(doc: dict[str, Any], *, quorum: int, seed: int, tokens: int) -> dict[str, Any]:
    """The example with another quorum, seed and the token budget (everything else as shipped)."""
    out = json.loads(json.dumps(doc))
    spec = out["spec"]
    spec["sync"]["quorum"] = quorum
    spec["model"]["seed"] = seed
    spec["data"]["seed"] = seed
    spec["stopAfter"] = {"outerSteps": None, "tokens": tokens}
    return out


def budget(spec: dict[str, Any]) -> int:
    """Tokens of the example's own stopAfter.outerSteps rounds at every island."""
    inner = spec["inner"]
    per_round = spec["islands"]["count"] * inner["steps"] * inner["batchSize"] * inner["seqLen"]
    return int(spec["stopAfter"]["outerSteps"]) * per_round


def run_one(doc: dict[str, Any], wd: Path, timeout: float) -> dict[str, Any]:
    wd.mkdir(parents=True, exist_ok=True)
    manifest, summary = wd / "job.yaml", wd / "summary.json"
    manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = start_module(
        "diloco run",
        "diloco_trainer.cli",
        ["run", str(manifest), "--summary", str(summary), "--workdir", str(wd / "run"), "--quiet"],
        log_file=wd / "run.log",
    )
    wait_all([proc], timeout)
    return json.loads(summary.read_text())


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.splitlines()[0], seeds=[0, 1], timeout=900)
    args = p.parse_args(argv)
    install_signal_cleanup()
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = doc["spec"]
    shipped, m, tokens = int(spec["sync"]["quorum"]), int(spec["islands"]["count"]), budget(spec)
    losses: dict[int, list[float]] = {shipped: [], m: []}
    table = Table(
        f"examples/local.yaml, eval loss at {tokens:,} tokens",
        ["seed", f"quorum {shipped} (shipped)", f"quorum {m}", "ratio", "outer steps (shipped, M)"],
    )
    with LoadMonitor() as load, workdir(args.workdir, "example_quorum") as wd:
        for seed in args.seeds:
            runs = {}
            for quorum in (m, shipped):
                print(f"seed {seed}: quorum {quorum} ...", flush=True)
                one = variant(doc, quorum=quorum, seed=seed, tokens=tokens)
                runs[quorum] = run_one(one, wd / f"seed{seed}-k{quorum}", args.timeout)
                losses[quorum].append(float(runs[quorum]["final_eval_loss"]))
                print(f"  -> {losses[quorum][-1]:.4f}", flush=True)
            table.add(
                seed,
                f"{losses[shipped][-1]:.4f}",
                f"{losses[m][-1]:.4f}",
                fmt_ratio(ratio(losses[shipped][-1], losses[m][-1]), 4),
                f"{runs[shipped]['outer_steps']} / {runs[m]['outer_steps']}",
            )
    mean = ratio(statistics.mean(losses[shipped]), statistics.mean(losses[m]))
    targets = Table("Target (issue 9)", ["target", "figure", "verdict"])
    targets.add(
        f"quorum {shipped} within 2% of quorum {m} (mean over seeds)",
        fmt_ratio(mean, 4),
        verdict(mean <= TARGET),
    )
    report = Report(
        "example_quorum",
        "`examples/local.yaml` at its shipped quorum against the same file at quorum M, at equal "
        "tokens (`diloco run`, the file's settings but the quorum, seeds and stopAfter.tokens).",
        [table, targets],
        notes=[
            f"stopAfter.tokens = {tokens:,}: the file's stopAfter.outerSteps rounds of "
            "M x steps x batchSize x seqLen; both quorums stop at the same merged-token count.",
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    sys.exit(main())
