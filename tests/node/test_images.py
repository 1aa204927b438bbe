"""The images built from the Dockerfile run as the chart and the operator run their pods.

hack/build-images.sh builds the operator and trainer images here without a Docker daemon
(buildah, a base image made with debootstrap) and writes OCI archives; these tests unpack each
archive with umoci and run it with runc as a pod of the chart or of a job would: uid/gid 65532
(with fsGroup 65532 as a supplementary group), a read-only root filesystem, a writable tmpfs at
/tmp (the emptyDir), no capabilities and no privilege escalation. Nothing here needs the
cluster. When a tool or root is missing, or the build fails, the tests fail saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .builds import BUILD_TIMEOUT, run_build

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 120.0
UID = 65532  # the chart's and the operator's runAsUser/runAsGroup/fsGroup
TOOLS = ("buildah", "debootstrap", "umoci", "runc")
BUILD_TOOLS = ("gcc", "cc", "g++", "make", "ld")  # none of these may be in a final image

# The first build of the images takes 5-10 minutes on 2 cores, inside the first test's set-up.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 600)


@dataclass(frozen=True)
class Bundle:
    """An unpacked image: the OCI runtime bundle umoci made and the image's config."""

    path: Path
    image_config: dict


@pytest.fixture(scope="module")
def image_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of operator.tar and trainer.tar (built now unless cached)."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (debootstrap, buildah's chroot isolation and runc need it)")
    if missing:
        pytest.fail(
            "building and running the images needs: "
            + ", ".join(missing)
            + " (`make images` installs them from Debian: hack/build-images.sh)"
        )
    log_path = tmp_path_factory.mktemp("images") / "build-images.log"
    return run_build(request.config, "build-images.sh", log_path)


def _unpack(archive: Path, work: Path) -> Bundle:
    """The archive's OCI layout, unpacked by umoci into a runtime bundle."""
    layout = work / "layout"
    with tarfile.open(archive) as tar:
        tar.extractall(layout, filter="tar")
    index = json.loads((layout / "index.json").read_text())
    (manifest,) = index["manifests"]
    ref = manifest["annotations"]["org.opencontainers.image.ref.name"]
    assert manifest["annotations"]["io.containerd.image.name"] == ref  # `ctr images import`
    subprocess.run(
        ["umoci", "unpack", "--image", f"{layout}:{ref}", str(work / "bundle")],
        check=True,
        capture_output=True,
        timeout=600,
    )
    blob = layout / "blobs" / "sha256" / manifest["digest"].removeprefix("sha256:")
    config_digest = json.loads(blob.read_text())["config"]["digest"]
    config = json.loads(
        (layout / "blobs/sha256" / config_digest.removeprefix("sha256:")).read_text()
    )
    shutil.rmtree(layout)  # the blobs are in the bundle now
    return Bundle(path=work / "bundle", image_config={"ref": ref, **config})


@pytest.fixture(scope="module")
def operator_bundle(image_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bundle]:
    work = tmp_path_factory.mktemp("operator-image")
    yield _unpack(image_dir / "operator.tar", work)
    shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def trainer_bundle(image_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bundle]:
    work = tmp_path_factory.mktemp("trainer-image")
    yield _unpack(image_dir / "trainer.tar", work)
    shutil.rmtree(work, ignore_errors=True)


def pod_like_spec(spec: dict, args: list[str]) -> dict:
    """umoci's runtime spec, made as the chart's securityContext and secure_workload make pods:
    runAsUser/runAsGroup 65532, fsGroup 65532, readOnlyRootFilesystem, an emptyDir at /tmp,
    allowPrivilegeEscalation false, capabilities drop ALL."""
    out = json.loads(json.dumps(spec))
    process = out["process"]
    process.update(args=args, terminal=False, noNewPrivileges=True, cwd="/tmp")
    process["user"] = {"uid": UID, "gid": UID, "additionalGids": [UID]}
    process["capabilities"] = {
        k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")
    }
    out["root"]["readonly"] = True
    mounts = [m for m in out["mounts"] if m["destination"] != "/tmp"]
    tmpfs = ["nosuid", "nodev", "mode=1777", "size=65536k"]
    mounts.append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": tmpfs})
    out["mounts"] = mounts
    return out


def run_in(bundle: Bundle, args: list[str], state: Path) -> subprocess.CompletedProcess[str]:
    """Run ARGS in the bundle with runc (its own state dir), as a pod of the chart would."""
    config_path = bundle.path / "config.json"
    original = bundle.path / "config.umoci.json"
    if not original.exists():
        shutil.copy(config_path, original)
    spec = json.loads(original.read_text())
    config_path.write_text(json.dumps(pod_like_spec(spec, args)))
    name = f"diloco-image-test-{uuid.uuid4().hex[:8]}"
    return subprocess.run(
        ["runc", "--root", str(state), "run", "--bundle", str(bundle.path), name],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


@pytest.fixture(scope="module")
def runc_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runc-state")


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


# --------------------------------------------------------------------------------- pure checks


def test_dockerfile_torch_range_matches_pyproject() -> None:
    """The trainer stage's default torch is the trainer extra's range from PyPI, not a pin of
    its own from another index."""
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    args = dict(re.findall(r"^ARG (TORCH_\w+)=(.*)$", dockerfile, re.M))
    (extra,) = re.findall(r'^\s*"(torch[<>=!~][^"]*)"', pyproject, re.M)
    assert args["TORCH_SPEC"] == f'"{extra}"'
    assert args["TORCH_VARIANT"] == args["TORCH_INDEX_URL"] == args["TORCH_FIND_LINKS"] == ""


# ------------------------------------------------------------------------------ the images


def test_images_archives_carry_full_names(
    image_dir: Path, operator_bundle: Bundle, trainer_bundle: Bundle
) -> None:
    """`ctr images import` names an image after the archive's io.containerd.image.name (umoci
    and skopeo after its ref name): both are the full name, the one the chart and jobs use."""
    env = dict(
        line.split("=", 1) for line in (image_dir / "images.env").read_text().splitlines() if line
    )
    assert operator_bundle.image_config["ref"] == env["OPERATOR_IMAGE"]
    assert trainer_bundle.image_config["ref"] == env["TRAINER_IMAGE"]
    for bundle in (operator_bundle, trainer_bundle):
        config = bundle.image_config["config"]
        assert config["User"] == f"{UID}:{UID}"
        assert config["Entrypoint"] == ["diloco"]


@pytest.mark.parametrize("which", ["operator", "trainer"])
def test_images_hold_no_build_tools(which: str, request: pytest.FixtureRequest) -> None:
    bundle: Bundle = request.getfixturevalue(f"{which}_bundle")
    rootfs = bundle.path / "rootfs"
    found = [
        str(d / tool)
        for d in (rootfs / "usr/bin", rootfs / "usr/local/bin", rootfs / "opt/venv/bin")
        for tool in BUILD_TOOLS
        if (d / tool).exists()
    ]
    assert found == []
    assert (rootfs / "opt/venv/bin/diloco").exists()
    # Build-time mounts (the builder's wheels, local torch wheels) leave nothing behind.
    assert not (rootfs / "wheels").exists()
    assert list((rootfs / "mnt").iterdir()) == []


def test_images_trainer_runs_read_only_as_65532(trainer_bundle: Bundle, runc_state: Path) -> None:
    out = _ok(run_in(trainer_bundle, ["diloco", "--version"], runc_state))
    assert re.search(r"\d+\.\d+\.\d+", out)
    out = _ok(run_in(trainer_bundle, ["diloco", "syncer", "--help"], runc_state))
    assert "syncer" in out
    probe = (
        "import os, torch; print(os.getuid(), os.getgid(), sorted(os.getgroups()));"
        "open('/tmp/x', 'w').write('ok');"
        "print(os.access('/opt', os.W_OK), torch.tensor([1.0, 2.0]).sum().item())"
    )
    out = _ok(run_in(trainer_bundle, ["python", "-c", probe], runc_state))
    assert out.split("\n")[:2] == [f"{UID} {UID} [{UID}]", "False 3.0"]


def test_images_operator_runs_read_only_without_torch(
    operator_bundle: Bundle, runc_state: Path
) -> None:
    out = _ok(run_in(operator_bundle, ["diloco", "operator", "--help"], runc_state))
    assert "operator" in out
    probe = (
        "import importlib.util as u, os;"
        "print(os.getuid(), u.find_spec('torch') is None, u.find_spec('kopf') is not None)"
    )
    out = _ok(run_in(operator_bundle, ["python", "-c", probe], runc_state))
    assert out.strip() == f"{UID} True True"
    proc = run_in(operator_bundle, ["python", "-c", "open('/etc/x', 'w')"], runc_state)
    assert proc.returncode != 0 and "Read-only file system" in proc.stderr
