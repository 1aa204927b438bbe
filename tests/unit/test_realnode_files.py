"""The real node's pure parts (hack/localcluster): config files, OCI archives, mount ordering."""

from __future__ import annotations

import hashlib
import json
import tarfile
import tomllib
from pathlib import Path

from hack.localcluster.mounts import mount_points, under
from hack.localcluster.nodeconfig import (
    NodePaths,
    cni_conflist,
    containerd_toml,
    corefile,
    kube_dns_objects,
    kubelet_config,
)
from hack.localcluster.nodeteardown import cni_masquerade_rules, kubelet_hooks
from hack.localcluster.ociimage import Entry, ImageSpec, write_archive
from hack.localcluster.settings import CLUSTER_DNS_IP, NODE_TAINT_KEY, PAUSE_IMAGE

PORTS = {
    "kubelet": 20001,
    "kubelet_healthz": 20002,
    "kube_proxy_healthz": 20003,
    "kube_proxy_metrics": 20004,
    "coredns_health": 20005,
    "coredns_ready": 20006,
    "containerd_stream": 20007,
}


def test_containerd_toml_keeps_everything_under_the_node_dir(tmp_path: Path) -> None:
    paths = NodePaths(tmp_path / "node")
    config = tomllib.loads(containerd_toml(paths, tmp_path / "bin", "/usr/sbin/runc", 20007))
    assert config["version"] == 4
    assert config["root"].startswith(str(paths.root)) and config["state"].startswith(
        str(paths.root)
    )
    assert config["plugins"]["io.containerd.server.v1.grpc"]["address"] == str(paths.socket)
    runtime = config["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["netns_mounts_under_state_dir"] is True
    runc = runtime["containerd"]["runtimes"]["runc"]["options"]
    assert runc == {
        "BinaryName": "/usr/sbin/runc",
        "Root": str(paths.runc_root),
        "SystemdCgroup": False,
    }
    assert runtime["cni"]["conf_dir"] == str(paths.cni_conf_dir)
    images = config["plugins"]["io.containerd.cri.v1.images"]
    assert images["pinned_images"]["sandbox"] == PAUSE_IMAGE
    assert "io.containerd.nri.v1.nri" in config["disabled_plugins"]
    assert len(str(paths.socket)) < 108


def test_kubelet_config_runs_on_cgroup_v1_tainted(tmp_path: Path) -> None:
    config = kubelet_config(NodePaths(tmp_path), "192.0.2.2", PORTS, tmp_path / "ca.crt")
    assert config["failCgroupV1"] is False and config["cgroupDriver"] == "cgroupfs"
    assert config["clusterDNS"] == [CLUSTER_DNS_IP]
    assert config["registerWithTaints"][0]["key"] == NODE_TAINT_KEY
    assert config["port"] == 20001 and config["address"] == "192.0.2.2"
    assert config["authentication"]["anonymous"]["enabled"] is False


def test_cni_and_dns_objects_point_at_the_node(tmp_path: Path) -> None:
    paths = NodePaths(tmp_path)
    bridge = cni_conflist(paths)["plugins"][0]
    assert bridge["ipam"]["dataDir"] == str(paths.cni_data_dir)
    service, endpoints = (obj for _, obj in kube_dns_objects("192.0.2.2"))
    assert service["spec"]["clusterIP"] == CLUSTER_DNS_IP and "selector" not in service["spec"]
    assert endpoints["endpoints"][0]["addresses"] == ["192.0.2.2"]
    assert "bind 192.0.2.2" in corefile(paths, "192.0.2.2", PORTS)


def test_oci_archive_is_a_valid_layout(tmp_path: Path) -> None:
    spec = ImageSpec(
        name="localhost/x/y:1",
        entrypoint=["/bin/hi"],
        entries=[Entry("/bin/hi", data=b"#!/bin/sh\n"), Entry("/bin/sh", symlink="hi")],
    )
    archive = write_archive(spec, tmp_path / "img.tar")
    with tarfile.open(archive) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    index = json.loads(files["index.json"])
    desc = index["manifests"][0]
    assert desc["annotations"]["io.containerd.image.name"] == "localhost/x/y:1"
    for name, blob in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(blob).hexdigest() == name.rsplit("/", 1)[1]
    manifest = json.loads(files["blobs/sha256/" + desc["digest"].split(":")[1]])
    layer = files["blobs/sha256/" + manifest["layers"][0]["digest"].split(":")[1]]
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    assert config["config"]["Entrypoint"] == ["/bin/hi"]
    assert config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]]
    assert write_archive(spec, tmp_path / "again.tar").read_bytes() == archive.read_bytes()
    assert layer  # non-empty layer


def test_mounts_under_a_dir_deepest_first() -> None:
    info = (
        "22 1 0:1 / / rw - ext4 /dev/vda rw\n"
        "30 22 0:2 / /d/node rw - tmpfs t rw\n"
        "31 30 0:3 / /d/node/a\\040b/c rw - tmpfs t rw\n"
        "32 30 0:4 / /d/nodex rw - tmpfs t rw\n"
    )
    points = mount_points(info)
    assert "/d/node/a b/c" in points
    assert under(points, Path("/d/node")) == ["/d/node/a b/c", "/d/node"]


def test_teardown_finds_only_our_iptables_rules() -> None:
    listing = (
        "Chain POSTROUTING (policy ACCEPT)\n"
        "num  target     prot opt source               destination\n"
        '1 CNI-aaa all -- 10.245.0.2 0.0.0.0/0 /* name: "diloco-real-node" id: "x" */\n'
        '2 CNI-bbb all -- 10.88.0.2 0.0.0.0/0 /* name: "podman" id: "y" */\n'
        '3 CNI-ccc all -- 10.245.0.3 0.0.0.0/0 /* name: "diloco-real-node" id: "z" */\n'
    )
    assert cni_masquerade_rules(listing) == [(3, "CNI-ccc"), (1, "CNI-aaa")]
    rules = (
        "-N KUBE-FIREWALL\n"
        "-A INPUT -j KUBE-FIREWALL\n"
        "-A OUTPUT -j KUBE-FIREWALL\n"
        "-A FORWARD -j DOCKER-USER\n"
        "-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -j DROP\n"
    )
    assert kubelet_hooks(rules) == [
        ["INPUT", "-j", "KUBE-FIREWALL"],
        ["OUTPUT", "-j", "KUBE-FIREWALL"],
    ]
