"""The house rules that keep the rooms small: no module over 500 lines and no function over 80
lines in trainer/ and operator/, unless ARCHITECTURE.md's "Size exceptions" names it with a reason.

A checker, not a style wish: growing a module past the limit fails `make test` with the place named.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def size_exceptions() -> set[str]:
    """Entries of ARCHITECTURE.md's "Size exceptions" list: `path` or `path::function`."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Size exceptions", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- `([^`]+)`", section, flags=re.M))


def oversized(root: Path, base: Path = ROOT) -> list[str]:
    """Every module over MAX_MODULE_LINES and function over MAX_FUNCTION_LINES under `root`,
    as paths relative to `base` (functions as `path::name`)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(base).as_posix()
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            found.append(rel)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    found.append(f"{rel}::{node.name}")
    return found


def test_architecture_modules_and_functions_stay_small() -> None:
    allowed = size_exceptions()
    found = oversized(ROOT / "trainer") + oversized(ROOT / "operator")
    unexplained = [place for place in found if place not in allowed]
    assert not unexplained, (
        f"over {MAX_MODULE_LINES} lines per module / {MAX_FUNCTION_LINES} per function, "
        f"and not named in ARCHITECTURE.md's size exceptions: {unexplained}"
    )


def test_architecture_size_checker_finds_oversized_places(tmp_path: Path) -> None:
    # The checker itself must be able to fail: a 90-line function in a 600-line module is found,
    # an 80-line function is not.
    long_body = "\n".join(f"    x{i} = {i}" for i in range(89))
    short_body = "\n".join(f"    y{i} = {i}" for i in range(79))
    source = f"def long_one():\n{long_body}\n\n\ndef short_one():\n{short_body}\n"
    (tmp_path / "probe.py").write_text(source + "\n" * 500)
    assert oversized(tmp_path, tmp_path) == ["probe.py", "probe.py::long_one"]
