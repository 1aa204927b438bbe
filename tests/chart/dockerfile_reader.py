"""A small Dockerfile and .dockerignore reader for static checks (no Docker engine needed)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


@dataclass
class Stage:
    """One FROM ... [AS name] section of a Dockerfile."""

    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args_of(self, keyword: str) -> list[str]:
        """Arguments of every instruction with this keyword, in order."""
        return [args for kw, args in self.instructions if kw == keyword]


@dataclass
class Dockerfile:
    """A parsed Dockerfile: global ARG defaults and the stages in order."""

    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        """The stage with this name; fails the test when there is none."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise AssertionError(f"no stage named {name!r}: {[s.name for s in self.stages]}")

    def chain(self, name: str) -> list[Stage]:
        """The stage and every stage it is built FROM, nearest first."""
        names = {s.name for s in self.stages}
        out = [self.stage(name)]
        while out[-1].base in names:
            out.append(self.stage(out[-1].base))
        return out

    def resolve(self, text: str) -> str:
        """Substitute ${ARG} / $ARG with the global ARG defaults."""
        return re.sub(
            r"\$\{(\w+)\}|\$(\w+)",
            lambda m: self.global_args.get(m.group(1) or m.group(2), m.group(0)),
            text,
        )


def parse_dockerfile(text: str) -> Dockerfile:
    """Parse instructions (line continuations joined, comments dropped) into stages."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continued instruction are ignored by Docker
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "Dockerfile ends inside a line continuation"

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM, got {keyword}"
            key, _, default = args.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append((keyword, args))
    return Dockerfile(global_args, stages)


def exec_form(args: str) -> list[str]:
    """The JSON-array (exec) form of CMD/ENTRYPOINT; fails on the shell form."""
    parsed = yaml.safe_load(args)
    assert isinstance(parsed, list), f"use the exec form [...], got: {args}"
    return parsed


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """Translate a .dockerignore pattern (Go filepath.Match plus `**`) into a regex."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(f"^{out}$")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context (last matching pattern wins; a
    pattern matching a parent directory matches everything below it)."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        regex = _dockerignore_regex(pattern.strip("/"))
        if any(regex.match(c) for c in candidates):
            excluded = not negate
    return excluded
