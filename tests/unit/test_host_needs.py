"""Every program or file outside the repository that a test tier needs is installed by the
project's own scripts, or is on a fresh machine of this project's kind, or belongs to a tier that
is documented as optional.

CI has passed on machines where someone had installed a tool by hand (round 2: Debian's
busybox-static), while `make test` failed on a fresh machine. This test reads what the tiers look
up (``shutil.which("x")``, ``host_tool("x")``, the tool tuples they iterate, the first word of a
literal subprocess command, absolute ``/bin``/``/sbin``/``/usr`` paths they open, ``command -v`` in
the build scripts) and checks each against the install lists in hack/lib/build-common.sh.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "hack" / "lib" / "build-common.sh"

# Where the tiers' host lookups live: the tests themselves and the local cluster they start.
SCANNED_PYTHON = [ROOT / "tests", ROOT / "hack" / "localcluster"]
SCANNED_SHELL = [*sorted((ROOT / "hack").glob("*.sh")), COMMON]

# The install list of each build step and the make target (a prerequisite of `make test`) that
# runs it.
LIST_TARGETS = {"NODE_HOST_NEEDS": "node", "IMAGE_HOST_NEEDS": "images"}
LIST_SCRIPTS = {"NODE_HOST_NEEDS": "build-node.sh", "IMAGE_HOST_NEEDS": "build-images.sh"}

# On a fresh machine of this project's kind, checked by hand on 2026-11-26 against the package
# list of such a machine (Debian 12 with Go, CPython, gcc/make preinstalled): need -> what has it.
FRESH_MACHINE = {
    "go": "the Go toolchain (preinstalled; Go >= 1.26)",
    "bash": "Debian bash",
    "openssl": "Debian openssl",
    "python3": "Debian python3",
    "ip": "Debian iproute2",
    "flock": "Debian util-linux",
    "unshare": "Debian util-linux (the NetworkPolicy enforcer's mount namespace)",
    "apt-get": "Debian apt",
    "git": "Debian git (the fresh machine's package list has it; CI clones with it)",
    "debootstrap": "looked up by build-images.sh only to say it is missing before installing it",
}

# Tiers that need what no script installs and that say so: the kind tier needs a Docker engine,
# which a machine of this kind cannot run (README, Quick start).
OPTIONAL_TIERS = {"docker": "tests/kind", "kind": "tests/kind"}

# Binaries the build scripts make from pinned sources (started by path from their cache, never
# looked up on PATH; listed here when a test names them as a command).
BUILT = {"kubectl", "helm", "etcd", "kube-apiserver", "containerd", "kubelet"}

SUBPROCESS_CALLS = {"run", "Popen", "check_output", "check_call", "call"}
HOST_PROGRAM_DIRS = ("/bin/", "/sbin/", "/usr/")


# host_tool() raises its own error, which names the make target: a lookup through it is covered.
HOST_TOOL_MODULE = "hack/localcluster/realnode.py"


@dataclass(frozen=True)
class Need:
    name: str  # a command name, or an absolute path
    where: str  # file:line
    message_in: str = ""  # the file whose error says what is missing ("" = where's own file)


def install_lists(text: str) -> dict[str, dict[str, str]]:
    """The NEED:PACKAGE arrays of build-common.sh: list name -> {need: package}."""
    lists: dict[str, dict[str, str]] = {}
    for m in re.finditer(r"^(\w+_HOST_NEEDS)=\((.*?)\)", text, re.MULTILINE | re.DOTALL):
        lists[m.group(1)] = dict(item.split(":", 1) for item in m.group(2).split())
    return lists


def _constants(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level NAME = (str, ...) / [str, ...] tuples and lists."""
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple | ast.List):
            items = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
            if items and all(isinstance(i, str) for i in items):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = [str(i) for i in items]
    return out


def _iterated_constant(parents: dict[ast.AST, ast.AST], node: ast.AST, var: str) -> str | None:
    """The module constant that the innermost enclosing loop binding `var` iterates
    (`for tool in TOOLS: which(tool)`, `[t for t in TOOLS if which(t)]`)."""
    current: ast.AST | None = node
    while current is not None:
        loops: list[ast.For | ast.comprehension] = []
        if isinstance(current, ast.For):
            loops.append(current)
        elif isinstance(current, ast.ListComp | ast.SetComp | ast.GeneratorExp):
            loops.extend(current.generators)
        for loop in loops:
            if isinstance(loop.target, ast.Name) and loop.target.id == var:
                return loop.iter.id if isinstance(loop.iter, ast.Name) else None
        current = parents.get(current)
    return None


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def python_needs(path: Path) -> Iterator[Need]:
    tree = ast.parse(path.read_text(), filename=str(path))
    constants = _constants(tree)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    rel = path.relative_to(ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            where = f"{rel}:{node.lineno}"
            name, arg = _call_name(node.func), node.args[0]
            if name in {"which", "host_tool"}:
                message_in = HOST_TOOL_MODULE if name == "host_tool" else ""
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield Need(arg.value, where, message_in)
                elif isinstance(arg, ast.Name):
                    source = _iterated_constant(parents, node, arg.id)
                    for item in constants.get(source or "", []):
                        yield Need(item, where, message_in)
            elif name in SUBPROCESS_CALLS and isinstance(arg, ast.List) and arg.elts:
                first = arg.elts[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    yield Need(first.value, where)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if (
                value.startswith(HOST_PROGRAM_DIRS)
                and re.fullmatch(r"[\w./+-]+", value)  # one path, not a PATH list
                and _opened_on_host(tree, node)
            ):
                yield Need(value, f"{rel}:{node.lineno}")


def _opened_on_host(tree: ast.Module, const: ast.Constant) -> bool:
    """Whether an absolute path constant is a host file the code opens: the argument of Path()
    or the default of os.environ.get (paths inside an image or a config are not)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and const in node.args:
            name = _call_name(node.func)
            if name == "Path" or (name == "get" and node.args.index(const) == 1):
                return True
    return False


def shell_needs(path: Path) -> Iterator[Need]:
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        for m in re.finditer(r"command -v ([A-Za-z0-9_.-]+)", line):
            yield Need(m.group(1), f"{path.relative_to(ROOT)}:{lineno}")


def all_needs() -> list[Need]:
    needs: list[Need] = []
    for folder in SCANNED_PYTHON:
        for path in sorted(folder.rglob("*.py")):
            needs.extend(python_needs(path))
    for path in SCANNED_SHELL:
        needs.extend(shell_needs(path))
    return needs


def test_host_needs_every_lookup_of_the_tiers_is_installed_or_on_a_fresh_machine() -> None:
    lists = install_lists(COMMON.read_text())
    installed = {need for entries in lists.values() for need in entries}
    needs = all_needs()
    # The scan must find the lookups it was written for, or it proves nothing.
    found = {n.name for n in needs}
    assert {"runc", "iptables", "ip", "/bin/busybox", "buildah", "umoci", "openssl"} <= found
    unaccounted = [
        f"{n.name} ({n.where})"
        for n in needs
        if n.name not in installed
        and n.name not in FRESH_MACHINE
        and n.name not in OPTIONAL_TIERS
        and n.name not in BUILT
    ]
    assert not unaccounted, (
        "the tiers look up programs or files that no script installs and a fresh machine lacks: "
        + ", ".join(unaccounted)
        + " (add them to an install list in hack/lib/build-common.sh)"
    )


def test_host_needs_busybox_static_is_installed_by_the_node_step() -> None:
    lists = install_lists(COMMON.read_text())
    assert lists["NODE_HOST_NEEDS"]["/bin/busybox"] == "busybox-static"


def test_host_needs_each_list_is_installed_by_its_script_which_make_test_runs() -> None:
    lists = install_lists(COMMON.read_text())
    assert set(lists) == set(LIST_TARGETS)
    makefile = (ROOT / "Makefile").read_text()
    test_deps = re.search(r"^test:(.*)$", makefile, re.MULTILINE)
    assert test_deps is not None
    for name, target in LIST_TARGETS.items():
        script = (ROOT / "hack" / LIST_SCRIPTS[name]).read_text()
        assert f'"${{{name}[@]}}"' in script, f"hack/{LIST_SCRIPTS[name]} does not install {name}"
        assert target in test_deps.group(1).split(), f"make test does not run make {target}"
        assert re.search(rf"^{target}:.*\n\tbash hack/{LIST_SCRIPTS[name]}", makefile, re.M)


def test_host_needs_a_missing_installed_need_names_the_make_target_that_installs_it() -> None:
    lists = install_lists(COMMON.read_text())
    targets_of: dict[str, set[str]] = {}
    for name, entries in lists.items():
        for need in entries:
            targets_of.setdefault(need, set()).add(LIST_TARGETS[name])
    checked = 0
    for need in all_needs():
        file = need.message_in or need.where.split(":")[0]
        if need.name not in targets_of or file.endswith(".sh"):
            continue  # the build scripts install these themselves
        source = (ROOT / file).read_text()
        assert any(f"`make {t}`" in source for t in targets_of[need.name]), (
            f"{need.where} looks up {need.name} but its error does not say which of "
            f"{sorted(targets_of[need.name])} (make targets) installs it"
        )
        checked += 1
    assert checked >= 3  # realnode's host tools, the busybox fixture, the image tools


def test_host_needs_missing_tools_reports_commands_and_paths_by_package(tmp_path: Path) -> None:
    there = tmp_path / "there"
    there.write_text("")
    script = (
        f"source {COMMON}; missing_tools sh:dash no-such-command-xyz:pkg-a "
        f"{there}:pkg-b {tmp_path}/absent:pkg-c"
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["pkg-a", "pkg-c"]
