"""hack/local-cluster's component command lines: each listens where state.json says, reads its
files from the cluster directory, and is checked for health on its own port."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from hack.localcluster import up
from hack.localcluster.components import component_argv, health_checks
from hack.localcluster.errors import ClusterError
from hack.localcluster.settings import COMPONENTS, ENTRY_POINT, PORT_KEYS
from hack.localcluster.state import Cluster

PORTS = {
    "etcd": 21001,
    "etcd_peer": 21002,
    "apiserver": 21003,
    "controller_manager": 21004,
    "scheduler": 21005,
    "kwok": 21006,
}
# The port each component itself listens on (etcd's peer port aside).
OWN_PORT = {
    "etcd": "etcd",
    "kube-apiserver": "apiserver",
    "kube-controller-manager": "controller_manager",
    "kube-scheduler": "scheduler",
    "kwok": "kwok",
}


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv[1:] if "=" in a)


@pytest.fixture
def argv(tmp_path: Path) -> dict[str, list[str]]:
    return component_argv(tmp_path / "cluster", PORTS, tmp_path / "bin")


def test_every_component_runs_its_own_binary_in_start_order(
    argv: dict[str, list[str]], tmp_path: Path
) -> None:
    assert list(argv) == COMPONENTS
    for name, args in argv.items():
        assert args[0] == str(tmp_path / "bin" / name)
        flags = [a.split("=", 1)[0] for a in args[1:]]
        assert len(flags) == len(set(flags)), f"{name} repeats a flag: {args}"


def test_etcd_and_apiserver_agree_on_the_etcd_ports(argv: dict[str, list[str]]) -> None:
    etcd = _flags(argv["etcd"])
    assert etcd["listen-client-urls"] == etcd["advertise-client-urls"] == "http://127.0.0.1:21001"
    peer = "http://127.0.0.1:21002"
    assert etcd["listen-peer-urls"] == etcd["initial-advertise-peer-urls"] == peer
    assert etcd["initial-cluster"] == f"local={peer}"
    assert _flags(argv["kube-apiserver"])["etcd-servers"] == "http://127.0.0.1:21001"


def test_each_component_listens_on_its_port_and_is_checked_there(
    argv: dict[str, list[str]],
) -> None:
    checks = health_checks(PORTS)
    assert list(checks) == COMPONENTS
    for name, check in checks.items():
        port = PORTS[OWN_PORT[name]]
        assert urlsplit(check.url).port == port, name
        assert urlsplit(check.url).hostname == "127.0.0.1"
        listens = [a for a in argv[name] if re.search(rf"[:=]{port}$", a)]
        assert listens, f"{name} does not listen on {port}: {argv[name]}"
    # Only the apiserver wants the admin client certificate.
    assert [n for n, c in checks.items() if c.admin] == ["kube-apiserver"]


def test_files_come_from_the_cluster_directory(argv: dict[str, list[str]], tmp_path: Path) -> None:
    directory = tmp_path / "cluster"
    for name, args in argv.items():
        for key, value in _flags(args).items():
            if value.startswith("/"):
                assert Path(value).is_relative_to(directory), f"{name} --{key}={value}"
    kcm = _flags(argv["kube-controller-manager"])
    kubeconfig = str(directory / "kube-controller-manager.kubeconfig")
    assert kcm["kubeconfig"] == kcm["authentication-kubeconfig"] == kubeconfig
    assert kcm["cluster-signing-key-file"] == str(directory / "pki" / "ca.key")
    assert _flags(argv["kwok"])["config"] == str(directory / "kwok-stages.yaml")
    assert _flags(argv["etcd"])["data-dir"] == str(directory / "etcd")


def test_fixed_ports_are_kept_and_the_rest_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[int, set[int]]] = []

    def pick(count: int, taken: set[int]) -> list[int]:
        asked.append((count, taken))
        return [30000 + i for i in range(count)]

    monkeypatch.setattr(up, "pick_ports", pick)
    monkeypatch.setattr(up, "port_is_free", lambda port: True)
    chosen = up.choose_ports({"apiserver": 6443, "etcd": 0})
    assert list(chosen) == PORT_KEYS
    assert chosen["apiserver"] == 6443
    assert asked == [(len(PORT_KEYS), {6443})]
    assert len(set(chosen.values())) == len(PORT_KEYS)

    monkeypatch.setattr(up, "port_is_free", lambda port: port != 6443)
    with pytest.raises(ClusterError, match=re.escape("port 6443 on 127.0.0.1 is already in use")):
        up.choose_ports({"apiserver": 6443, "etcd": 0})


def test_watchdog_gets_the_owner_and_the_processes_up_front(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    c.state = {"processes": {"etcd": {"pid": 123, "exe": "/bin/etcd", "start": 9}}}
    argv = up.watchdog_argv(c, owner_pid=999_999_999)  # no such process: start time unknown
    assert argv[:3] == [sys.executable, str(ENTRY_POINT), "_watchdog"]
    assert dict(zip(argv[3::2], argv[4::2], strict=True)) == {
        "--dir": str(tmp_path.resolve()),
        "--owner-pid": "999999999",
        "--owner-start": "0",
        "--processes": json.dumps(c.processes(), sort_keys=True),
    }
