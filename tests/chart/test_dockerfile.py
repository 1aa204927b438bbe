"""Static checks of the Dockerfile and .dockerignore (there is no Docker engine on CI machines).

The Dockerfile is parsed into stages; the assertions are the promises the chart and the operator
rely on: the `operator` and `trainer` targets exist, run as the chart's non-root uid, start
`diloco` with the subcommand the chart and the operator expect, and the operator image has no
torch.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from .dockerfile_reader import (
    DOCKERFILE,
    DOCKERIGNORE,
    REPO,
    Dockerfile,
    dockerignored,
    exec_form,
    parse_dockerfile,
)

VALUES = REPO / "charts" / "diloco-operator" / "values.yaml"
FINAL_STAGES = ("operator", "trainer")


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


def test_dockerfile_should_define_operator_and_trainer_targets_when_parsed(
    dockerfile: Dockerfile,
) -> None:
    names = [s.name for s in dockerfile.stages]
    assert "operator" in names and "trainer" in names, names


@pytest.mark.parametrize("target", FINAL_STAGES)
def test_dockerfile_should_run_as_chart_uid_when_target_built(
    dockerfile: Dockerfile, target: str
) -> None:
    users = [u for stage in dockerfile.chain(target) for u in reversed(stage.args_of("USER"))]
    assert users, f"{target} never sets USER (it would run as root)"
    uid = users[0].split(":")[0]
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0, f"{target} runs as {users[0]!r}"
    pod = yaml.safe_load(VALUES.read_text())["operator"]["podSecurityContext"]
    assert int(uid) == pod["runAsUser"], "image uid and the chart's runAsUser differ"


def test_dockerfile_should_pin_base_images_when_pulled(dockerfile: Dockerfile) -> None:
    names = {s.name for s in dockerfile.stages}
    external = [dockerfile.resolve(s.base) for s in dockerfile.stages if s.base not in names]
    assert external, "no external base image found"
    for image in external:
        assert "$" not in image, f"base image {image!r} uses an ARG without a default"
        reference, _, tag = image.rpartition(":")
        assert reference and "/" not in tag, f"base image {image!r} has no tag"
        assert tag != "latest", f"base image {image!r} is not pinned"
        assert re.match(r"^\d+\.\d+\.\d+", tag), f"base tag {tag!r} is not a full version"


def test_dockerfile_should_not_install_torch_when_target_is_operator(
    dockerfile: Dockerfile,
) -> None:
    runs = [r for stage in dockerfile.chain("operator") for r in stage.args_of("RUN")]
    assert not [r for r in runs if "torch" in r.lower()], runs
    assert any("[operator]" in r for r in runs), "operator stage does not install the extra"
    assert not any("[trainer]" in r or "[dev]" in r for r in runs), runs


def test_dockerfile_should_choose_torch_index_when_variant_given(dockerfile: Dockerfile) -> None:
    trainer = dockerfile.stage("trainer")
    build_args = dict(a.partition("=")[::2] for a in trainer.args_of("ARG"))
    # Empty by default: torch from PyPI in pyproject.toml's range (tests/node/test_images.py).
    assert build_args.get("TORCH_VARIANT") == "", build_args
    installs = [r for r in trainer.args_of("RUN") if "torch" in r]
    assert any(
        "--index-url" in r and "download.pytorch.org/whl/${TORCH_VARIANT}" in r for r in installs
    ), installs


@pytest.mark.parametrize("target", FINAL_STAGES)
def test_dockerfile_should_leave_build_tools_out_when_target_built(
    dockerfile: Dockerfile, target: str
) -> None:
    chain = dockerfile.chain(target)
    assert "builder" not in [s.name for s in chain], f"{target} is built FROM the builder"
    runs = " ".join(r for stage in chain for r in stage.args_of("RUN"))
    for tool in ("gcc", "build-essential", "apt-get install", "make "):
        assert tool not in runs, f"{target} installs {tool!r}"


def test_dockerfile_should_start_subcommands_the_chart_and_operator_use_when_run(
    dockerfile: Dockerfile,
) -> None:
    from diloco_trainer.cli import build_parser

    parser = build_parser()
    expected = {"operator": ["operator"], "trainer": ["learner"]}
    for target, cmd in expected.items():
        chain = dockerfile.chain(target)
        entry = next(e for stage in chain for e in reversed(stage.args_of("ENTRYPOINT")))
        last_cmd = next(c for stage in chain for c in reversed(stage.args_of("CMD")))
        assert exec_form(entry) == ["diloco"], target
        assert exec_form(last_cmd) == cmd, target
        # The CLI accepts the default command: the image starts without extra args.
        assert parser.parse_args(cmd).command == cmd[0]


def test_dockerignore_should_keep_copied_sources_and_drop_local_state_when_building(
    dockerfile: Dockerfile,
) -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [
        src.rstrip("/")
        for stage in dockerfile.stages
        for args in stage.args_of("COPY")
        if "--from" not in args
        for src in shlex.split(args)[:-1]
    ]
    assert sources, "no COPY from the build context"
    for src in sources:
        assert not dockerignored(src, patterns), f"COPY {src} is excluded by .dockerignore"
        assert (REPO / src).exists(), f"COPY {src}: no such path in the repository"
    assert not dockerignored("trainer/diloco_trainer/cli.py", patterns)
    for local in (
        ".venv/bin/python",
        ".git/HEAD",
        "runs/summary.json",
        "tests/unit/test_x.py",
        "trainer/diloco_trainer/__pycache__/cli.cpython-311.pyc",
        "diloco_operator.egg-info/PKG-INFO",
    ):
        assert dockerignored(local, patterns), f"{local} would be sent to the Docker daemon"


def _extra_distributions(extra: str) -> set[str]:
    """Distributions an extra of the installed project requires (from its metadata)."""
    names = set()
    for requirement in importlib.metadata.requires("diloco-operator") or []:
        if re.search(rf"extra\s*==\s*['\"]{extra}['\"]", requirement):
            names.add(re.split(r"[<>=!~\[; (]", requirement, maxsplit=1)[0].lower())
    return names


def test_operator_image_should_start_without_trainer_packages_when_torch_absent() -> None:
    # The operator image installs only the [operator] extra: every package the [trainer] extra
    # adds on top (torch, safetensors, ...) is made unimportable, then the operator is imported.
    trainer_only = _extra_distributions("trainer") - _extra_distributions("operator")
    assert "torch" in trainer_only, trainer_only
    modules = sorted(name.replace("-", "_") for name in trainer_only)
    code = (
        "import sys\n"
        f"for name in {modules!r}: sys.modules[name] = None\n"
        "import diloco_operator.main, diloco_operator.handlers, diloco_operator.crd\n"
        "from diloco_trainer.cli import build_parser\n"
        "assert build_parser().parse_args(['operator', '--standalone']).standalone\n"
        "print('imported without trainer packages')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "imported without trainer packages" in result.stdout
