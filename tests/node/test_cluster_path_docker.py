"""The `docker` that tests/node/test_cluster_path.py puts on PATH: docs/cluster.md builds and
pushes images with `docker`, and the real node has neither a Docker daemon nor a registry.

It is run as a program (`docker build ...`, `docker push NAME`), never imported by pytest for
tests (this module has none). What it does instead of Docker, and what it checks so that a
command the page gets wrong fails here as it would with Docker:

  build --target T [--build-arg K=V ...] -t NAME CONTEXT
      CONTEXT/Dockerfile must have a stage `AS T` and an `ARG K` for every build argument;
      NAME is remembered as stage T. The image itself is the one hack/build-images.sh built
      from the same Dockerfile (the test loaded it into the node as DILOCO_SHIM_IMAGE_<T>).
  push NAME
      NAME must have been built; the node's containerd gets NAME as a second name of that
      image, so pods that name NAME find it on the node without pulling (the kubelet pulls an
      image with a version tag only when it is missing).

Every call is appended to $DILOCO_SHIM_DIR/calls.log; what was built is kept in
$DILOCO_SHIM_DIR/built.json.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def fail(message: str) -> int:
    print(f"docker (test stand-in): {message}", file=sys.stderr)
    return 1


def parse_build(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """`docker build`'s options (--target, -t, --build-arg) and its positional arguments."""
    options: dict[str, str] = {}
    positional: list[str] = []
    it = iter(args)
    for arg in it:
        if arg in ("--target", "-t", "--tag"):
            options["tag" if arg != "--target" else "target"] = next(it)
        elif arg == "--build-arg":
            key = next(it).split("=", 1)[0]
            options[f"arg:{key}"] = key
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg}")
        else:
            positional.append(arg)
    return options, positional


def build(args: list[str], state: Path) -> int:
    try:
        options, positional = parse_build(args)
    except (ValueError, StopIteration) as e:
        return fail(f"build: {e or 'an option without its value'}")
    if len(positional) != 1 or "tag" not in options or "target" not in options:
        return fail(f"build needs --target, -t and one context: {args}")
    dockerfile = Path(positional[0]) / "Dockerfile"
    if not dockerfile.is_file():
        return fail(f"build: no Dockerfile in {positional[0]}")
    text = dockerfile.read_text()
    target = options["target"]
    if not re.search(rf"^FROM\s+\S+\s+AS\s+{re.escape(target)}\s*$", text, re.M | re.I):
        return fail(f"build: {dockerfile} has no stage {target}")
    for key in (v for k, v in options.items() if k.startswith("arg:")):
        if not re.search(rf"^ARG\s+{re.escape(key)}(=|\s|$)", text, re.M):
            return fail(f"build: {dockerfile} has no ARG {key}")
    built = json.loads(state.read_text()) if state.exists() else {}
    built[options["tag"]] = target
    state.write_text(json.dumps(built))
    return 0


def push(args: list[str], state: Path) -> int:
    built = json.loads(state.read_text()) if state.exists() else {}
    if len(args) != 1 or args[0] not in built:
        return fail(f"push: {args} was not built here (built: {sorted(built)})")
    source = os.environ[f"DILOCO_SHIM_IMAGE_{built[args[0]]}"]
    ctr = json.loads(os.environ["DILOCO_SHIM_CTR"])  # [ctr, --address, SOCK, --namespace, ...]
    result = subprocess.run([*ctr, "images", "tag", "--force", source, args[0]], check=False)
    return result.returncode


def main(argv: list[str]) -> int:
    shim_dir = Path(os.environ["DILOCO_SHIM_DIR"])
    with open(shim_dir / "calls.log", "a") as log:
        log.write(" ".join(argv) + "\n")
    state = shim_dir / "built.json"
    if argv[:1] == ["build"]:
        return build(argv[1:], state)
    if argv[:1] == ["push"]:
        return push(argv[1:], state)
    return fail(f"only build and push are stood in for, not {argv[:1]}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
