"""Install the project into the running virtual environment with the CPU build of torch where the
platform allows (the Makefile's installs: `make demo`, `make test`, `make bench`).

    .venv/bin/python hack/venv_install.py EXTRAS        e.g. trainer,local (make demo) or dev

PyPI's torch for Linux x86_64 is the CUDA build (torch, triton and the nvidia-* libraries: about
5 GB installed), which a CPU laptop or the demo never uses. So torch is installed first, in this
order, and the project's install then finds it already there:

1. already in the environment (CI's .ci/run installs one from its wheel folder): kept;
2. TORCH_WHEELS=DIR holds a torch wheel (as for hack/build-images.sh): that torch from it (its
   dependencies from PyPI);
3. on Linux x86_64: from the PyTorch CPU index (TORCH_CPU_INDEX, default PYTORCH_CPU_INDEX);
   when that index cannot be reached (a registry-only network), a line says so and torch comes
   from PyPI with the rest (the CUDA build): slower and larger, but the install still works;
4. elsewhere (macOS: PyPI's wheels are CPU builds already; Linux aarch64): from PyPI with the rest.

Then `pip install -e '.[EXTRAS]'`. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_SPEC = "torch>=2.2"  # pyproject.toml's range
# A reachable index answers in seconds; an unreachable one should not hold the install for the
# minutes of pip's default retries.
INDEX_TIMEOUT_S = 20
INDEX_RETRIES = 1
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class TorchStep:
    """How torch gets installed before the project: a pip command, or none (why, for the log)."""

    why: str
    pip_args: tuple[str, ...] = ()  # empty: nothing to run; torch comes with the project's install
    fallback: str = ""  # said when the command fails and the install goes on without it


def torch_step(
    *,
    have_torch: bool,
    system: str,
    machine: str,
    wheels: str,
    wheel_version: str = "",
    cpu_index: str = PYTORCH_CPU_INDEX,
) -> TorchStep:
    """The torch step for this environment (the module docstring's order); `wheel_version` is
    the version of the torch wheels in `wheels` (pinned, so PyPI's build never wins)."""
    if have_torch:
        return TorchStep("torch is already installed: kept")
    if wheels:
        return TorchStep(
            f"torch {wheel_version} from TORCH_WHEELS={wheels}",
            ("install", "--find-links", wheels, f"torch=={wheel_version}"),
        )
    if system == "Linux" and machine in ("x86_64", "AMD64"):
        return TorchStep(
            f"torch's CPU build from {cpu_index}",
            (
                "install",
                "--index-url",
                cpu_index,
                "--timeout",
                str(INDEX_TIMEOUT_S),
                "--retries",
                str(INDEX_RETRIES),
                TORCH_SPEC,
            ),
            fallback=f"{cpu_index} could not be reached: torch comes from PyPI with the rest "
            "(its Linux x86_64 wheel is the CUDA build, about 5 GB installed)",
        )
    return TorchStep(f"torch from PyPI ({system} {machine}: its wheel needs no CUDA libraries)")


Runner = Callable[[Sequence[str]], int]


def _pip(args: Sequence[str]) -> int:
    return subprocess.run([sys.executable, "-m", "pip", *args], check=False).returncode


def install(extras: str, step: TorchStep, run: Runner = _pip, *, project: Path = ROOT) -> int:
    """Torch's step, then the project with its extras; pip's exit code (0: installed)."""
    print(f"venv_install: {step.why}", flush=True)
    if step.pip_args and run(step.pip_args) != 0:
        if not step.fallback:
            return 1
        print(f"venv_install: {step.fallback}", flush=True)
    target = f"{project}[{extras}]" if extras else str(project)
    return run(["install", "--quiet", "-e", target])


def wheel_version(wheels: Path) -> str:
    """The newest version among the torch wheels in a folder ("" when there is none); a wheel's
    name is torch-VERSION-PYTHON-ABI-PLATFORM.whl."""
    versions = {p.name.split("-")[1] for p in wheels.glob("torch-*.whl")}
    return max(versions, key=_version_key, default="")


def _version_key(version: str) -> tuple[int, ...]:
    release = version.split("+")[0]
    return tuple(int(x) if x.isdigit() else 0 for x in release.split("."))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extras", help="the project's extras, comma-separated (e.g. trainer,local)")
    args = parser.parse_args(argv)
    wheels = os.environ.get("TORCH_WHEELS", "")
    version = wheel_version(Path(wheels)) if wheels else ""
    if wheels and not version:
        print(f"venv_install: TORCH_WHEELS={wheels} holds no torch-*.whl", file=sys.stderr)
        return 2
    step = torch_step(
        have_torch=importlib.util.find_spec("torch") is not None,
        system=platform.system(),
        machine=platform.machine(),
        wheels=wheels,
        wheel_version=version,
        cpu_index=os.environ.get("TORCH_CPU_INDEX") or PYTORCH_CPU_INDEX,
    )
    return install(args.extras, step)


if __name__ == "__main__":
    sys.exit(main())
