"""The house rules that keep the rooms readable, checked:

- no function over 80 lines in trainer/ and operator/; a module's size is judged by cohesion, with
  a soft limit of 800 lines that a review judges: a module past it is named in ARCHITECTURE.md's
  "Size exceptions" with the reason it stays whole (growing one past it fails `make test` with
  the place named until the review has said so);
- the syncer's top level is its sub-packages (ARCHITECTURE.md, "The syncer"), and code outside a
  sub-package uses only its face (the names its `__init__` exports).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 800  # soft: past it, a review names the module in the size exceptions
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
    (tmp_path / "probe.py").write_text(source + "\n" * MAX_MODULE_LINES)
    assert oversized(tmp_path, tmp_path) == ["probe.py", "probe.py::long_one"]


SYNCER = ROOT / "trainer" / "diloco_trainer" / "syncer"
SYNCER_PACKAGES = {"edge", "state", "intake", "merging", "serving", "storage", "service"}


def test_architecture_the_syncer_top_level_is_its_sub_packages() -> None:
    entries = {p.name for p in SYNCER.iterdir() if p.name != "__pycache__"}
    assert entries == SYNCER_PACKAGES | {"__init__.py", "errors.py"}
    for name in SYNCER_PACKAGES:
        assert (SYNCER / name / "__init__.py").is_file(), name


def face_violations(files: list[Path], syncer: Path = SYNCER) -> list[str]:
    """Imports of a syncer sub-package from outside it that go past its face: a module inside it
    named directly, or a name its `__init__` does not export (`__all__`)."""
    faces: dict[str, set[str]] = {}
    for init in syncer.glob("*/__init__.py"):
        tree = ast.parse(init.read_text())
        exported: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                exported = {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
        faces[init.parent.name] = exported
    found = []
    for path in files:
        inside = path.relative_to(syncer).parts[0] if path.is_relative_to(syncer) else None
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module):
                continue
            parts = node.module.split(".")
            if parts[:2] != ["diloco_trainer", "syncer"] or len(parts) < 3:
                continue
            package = parts[2]
            if package not in faces or package == inside:
                continue
            where = f"{path.name}:{node.lineno}"
            if len(parts) > 3:
                found.append(f"{where} imports {node.module} (past the face)")
            found += [
                f"{where} imports {a.name} (not in {package}'s face)"
                for a in node.names
                if len(parts) == 3 and a.name not in faces[package]
            ]
    return found


def test_architecture_code_outside_a_syncer_sub_package_uses_its_face() -> None:
    files = sorted((ROOT / "trainer").rglob("*.py")) + sorted((ROOT / "operator").rglob("*.py"))
    assert face_violations(files) == []


def test_architecture_the_face_checker_finds_an_import_past_a_face(tmp_path: Path) -> None:
    sources = [
        "from diloco_trainer.syncer.state.rounds import SyncState\n",
        "from diloco_trainer.syncer.state import not_exported\n",
        "from diloco_trainer.syncer.state import SyncState\n",
    ]
    found = []
    for i, source in enumerate(sources):
        probe = tmp_path / f"probe{i}.py"
        probe.write_text(source)
        found.append(face_violations([probe]))
    past = "probe0.py:1 imports diloco_trainer.syncer.state.rounds (past the face)"
    assert found == [[past], ["probe1.py:1 imports not_exported (not in state's face)"], []]


def shared_names() -> set[str]:
    """The module names ARCHITECTURE.md's "Shared names" allows in both packages."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Shared names", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- `([^`]+\.py)`", section, flags=re.M))


def test_architecture_one_meaning_per_module_and_class_name() -> None:
    packages = [ROOT / "trainer" / "diloco_trainer", ROOT / "operator" / "diloco_operator"]
    modules: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path.name != "__init__.py":
                modules.setdefault(path.name, []).append(rel)
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, []).append(rel)
    shared = {name for name, where in modules.items() if len(where) > 1}
    assert shared == shared_names(), {
        n: modules[n] for n in shared ^ shared_names() if n in modules
    }
    assert {name: where for name, where in classes.items() if len(where) > 1} == {}


# The path of a push (ARCHITECTURE.md): its numbered steps, each "`call`" first on its line.
PATH_STEP = re.compile(r"^\s*\d+\. `([A-Za-z_]+)`", flags=re.M)


def path_of_a_push() -> list[str]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("### The path of a push", 1)[1].split("\n## ", 1)[0]
    return PATH_STEP.findall(section)


def calls_in_order(path: Path, cls: str, method: str) -> list[str]:
    """The names a method calls, in source order (a callable handed to asyncio.to_thread
    counts as called there)."""
    tree = ast.parse(path.read_text())
    found = next(
        f
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name == cls
        for f in c.body
        if isinstance(f, ast.AsyncFunctionDef | ast.FunctionDef) and f.name == method
    )
    names: list[tuple[int, int, str]] = []
    for node in ast.walk(found):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "to_thread" and node.args:
            func = node.args[0]  # type: ignore[assignment]
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        names.append((node.lineno, node.col_offset, name))
    return [name for _, _, name in sorted(names)]


def test_architecture_the_path_of_a_push_is_the_code_s() -> None:
    steps = path_of_a_push()
    assert len(steps) <= 12, steps
    service = SYNCER / "service"
    # A merge's steps 8-10 run in one worker thread (Syncer._merge_work): its calls stand
    # where _merge hands it to the thread.
    merge = calls_in_order(service / "service.py", "Syncer", "_merge")
    at = merge.index("_merge_work")
    work = calls_in_order(service / "service.py", "Syncer", "_merge_work")
    pushed = calls_in_order(service / "push.py", "PushPath", "receive")
    made = [*pushed, *merge[:at], *work, *merge[at + 1 :]]
    order = [made.index(step) for step in steps if step in made]
    assert [s for s in steps if s not in made] == []
    assert order == sorted(order), list(zip(steps, order, strict=True))
    # The push path holds the service's Control, never the service.
    source = (service / "push.py").read_text()
    assert not re.search(r"\bSyncer\b|service\.service|service import", source)
