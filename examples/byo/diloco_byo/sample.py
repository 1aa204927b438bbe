"""A small synthetic corpus for trying the example: `python -m diloco_byo.sample DIR`.

Sentences from a tiny grammar, seeded: the same files on every machine. Real corpora go on the
volume that data.source names (docs/byo.md).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ADJECTIVES = ["old", "quiet", "red", "small", "brave", "cold", "bright", "slow", "green", "wise"]
NOUNS = ["fox", "river", "tower", "miller", "lamp", "garden", "ship", "owl", "bridge", "king"]
VERBS = ["sees", "follows", "guards", "paints", "finds", "crosses", "wakes", "builds", "hears"]
PLACES = ["the hill", "the harbour", "the forest", "the market", "the old road", "the sea"]


def sentence(rng: random.Random) -> str:
    """One sentence: subject, verb, object, place."""
    subject = f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    obj = f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    return f"{subject} {rng.choice(VERBS)} {obj} near {rng.choice(PLACES)}."


def write_sample(root: Path, *, files: int = 8, lines: int = 100, seed: int = 0) -> list[Path]:
    """Write `files` text files of `lines` sentences each under root; returns them."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    written = []
    for i in range(files):
        path = root / f"part-{i:02d}.txt"
        path.write_text("\n".join(sentence(rng) for _ in range(lines)) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m diloco_byo.sample DIR")
    for p in write_sample(Path(sys.argv[1])):
        print(p)
