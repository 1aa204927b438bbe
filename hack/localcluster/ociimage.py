"""Tiny OCI image archives made from local files (stdlib only).

There is no registry here, so the real node's images are made on the machine and imported with
`ctr images import`: the pod sandbox's `pause` (built by hack/build-node.sh) and the test tier's
busybox. One uncompressed layer, an OCI image layout in a tar, named through the
`io.containerd.image.name` annotation that `ctr images import` reads.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


@dataclass(frozen=True)
class Entry:
    """One file of the layer: its path in the image and where its bytes come from."""

    path: str  # absolute path in the image, e.g. "/bin/busybox"
    source: Path | None = None  # a file on this machine, or
    data: bytes = b""  # the bytes themselves
    mode: int = 0o755
    symlink: str | None = None  # a symbolic link to this target instead of a file


@dataclass(frozen=True)
class ImageSpec:
    """What goes into the image config."""

    name: str  # full reference, e.g. "localhost/diloco/pause:1"
    entrypoint: Sequence[str]
    cmd: Sequence[str] = ()
    user: str = ""
    env: Sequence[str] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
    entries: Sequence[Entry] = field(default_factory=tuple)


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(data))


def _dirs_of(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def layer_tar(entries: Sequence[Entry]) -> bytes:
    """The layer: each entry's parent directories (0755), then the entry; fixed mtimes, so
    the same files always give the same digest."""
    buf = io.BytesIO()
    seen: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            for d in _dirs_of(e.path):
                if d not in seen:
                    seen.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                    tar.addfile(info)
            name = e.path.strip("/")
            if e.symlink is not None:
                info = tarfile.TarInfo(name)
                info.type, info.linkname, info.mtime = tarfile.SYMTYPE, e.symlink, 0
                tar.addfile(info)
                continue
            data = e.source.read_bytes() if e.source is not None else e.data
            _add(tar, name, data, e.mode)
    return buf.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_config(spec: ImageSpec, layer_digest: str) -> dict[str, object]:
    config: dict[str, object] = {"Entrypoint": list(spec.entrypoint), "Env": list(spec.env)}
    if spec.cmd:
        config["Cmd"] = list(spec.cmd)
    if spec.user:
        config["User"] = spec.user
    return {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }


def write_archive(spec: ImageSpec, dest: Path) -> Path:
    """Write the OCI image layout of `spec` as a tar at dest (for `ctr images import`)."""
    layer = layer_tar(spec.entries)
    layer_digest = _digest(layer)
    config = json.dumps(image_config(spec, layer_digest), sort_keys=True).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, "digest": _digest(config), "size": len(config)},
            "layers": [{"mediaType": LAYER_TYPE, "digest": layer_digest, "size": len(layer)}],
        },
        sort_keys=True,
    ).encode()
    tag = spec.name.rsplit(":", 1)[1] if ":" in spec.name.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": MANIFEST_TYPE,
                "digest": _digest(manifest),
                "size": len(manifest),
                "annotations": {
                    "io.containerd.image.name": spec.name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", json.dumps(index).encode())
        for blob in (layer, config, manifest):
            _add(tar, "blobs/sha256/" + _digest(blob).split(":", 1)[1], blob)
    return dest


def pause_image(pause_binary: Path, name: str) -> ImageSpec:
    """The pod sandbox image: the pause binary as /pause, run as nobody like upstream's."""
    return ImageSpec(
        name=name,
        entrypoint=["/pause"],
        user="65535:65535",
        entries=[Entry("/pause", source=pause_binary)],
    )


def busybox_image(busybox: Path, name: str, applets: Sequence[str]) -> ImageSpec:
    """A static busybox as /bin/busybox with a link per applet (e.g. sh, nslookup, wget)."""
    links = [Entry(f"/bin/{a}", symlink="busybox") for a in applets]
    return ImageSpec(
        name=name,
        entrypoint=["/bin/sh"],
        entries=[Entry("/bin/busybox", source=busybox), *links, Entry("/tmp/.keep", data=b"")],
    )
