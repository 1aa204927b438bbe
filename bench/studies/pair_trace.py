"""Per merge of a finished bench.adversary run (issue 46, loud claims at M = 2): what each merge
held and moved, read from the run's own records (the syncer's merges.jsonl and its log's eval
lines; nothing is re-run).

Per merge: the outer step, its contributors (island, claimed steps, mixing share, the scale its
vector got: 1/w, times syncer.guards.pairClip's factor where that held it), the work fraction φ,
the merged pseudo-gradient per round's norm ‖g‖ (`movement`, before the movement cap's clip)
and the clip, φ·‖g‖ (what the outer step's gradient term moves θ by over lr), and the eval loss
after the outer step. A merge of one contributor tells its push's norm: ‖Δ‖ = ‖g‖ / scale.

    python -m bench.studies.pair_trace RUN_DIR [RUN_DIR ...]   # e.g. <workdir>/loud_claims-0
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

EVAL = re.compile(r"eval at outer step (\d+) \((\d+) tokens\): loss ([0-9.]+)")


def evals(run: Path) -> dict[int, float]:
    """Outer step -> the syncer's eval loss after it (its log: syncer.*.log)."""
    out: dict[int, float] = {}
    for log in sorted(run.glob("syncer*.log")):
        for m in EVAL.finditer(log.read_text(errors="replace")):
            out[int(m.group(1))] = float(m.group(3))
    return out


def rows(run: Path) -> list[str]:
    loss = evals(run)
    lines = []
    for raw in (run / "syncer" / "merges.jsonl").read_text().splitlines():
        d = json.loads(raw)
        parts = [
            f"{c['island'].rsplit('-', 1)[-1]}:{c['steps']}s ρ{c['weight']:.2f} x{c['scale']:.3g}"
            for c in d["contributors"]
        ]
        norm = d.get("movement") or 0.0
        solo = ""
        if len(d["contributors"]) == 1 and d["contributors"][0]["scale"] > 0:
            solo = f"{norm / d['contributors'][0]['scale']:.3f}"
        step = d["outerStep"]
        lines.append(
            f"| {step} | {' + '.join(parts)} | {d['fraction']:.2f} | {norm:.3f} | "
            f"{d['clip']:.3g} | {d['fraction'] * norm:.3f} | {solo or '-'} | "
            f"{loss.get(step, '-')} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    args = p.parse_args()
    for run in args.runs:
        print(f"\n{run.name}\n")
        print(
            "| outer step | contributors (island:steps ρ x scale) | φ | ‖g‖ | clip | φ·‖g‖ "
            "| ‖Δ‖ alone | eval |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(rows(run)))


if __name__ == "__main__":
    main()
