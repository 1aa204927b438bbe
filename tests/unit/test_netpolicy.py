"""The real node's NetworkPolicy enforcer (hack/localcluster/netpolicy.py): its command line,
its credentials and its RBAC, without starting it (tests/node/test_network_policy.py does)."""

from __future__ import annotations

import stat
from pathlib import Path

from hack.localcluster import netpolicy
from hack.localcluster.settings import NETWORK_POLICIES, NODE_COMPONENTS, NODE_NAME


def test_netpolicy_is_a_node_component_started_last() -> None:
    # Started after kube-proxy (realnode.start_real_node), so stopped first by `down`.
    assert netpolicy.NAME == NETWORK_POLICIES == "network-policies"
    assert NODE_COMPONENTS[-2:] == ["kube-proxy", NETWORK_POLICIES]


def test_netpolicy_argv_wraps_the_enforcer_in_its_own_mount_namespace(tmp_path: Path) -> None:
    argv = netpolicy.enforcer_argv("/usr/bin/unshare", tmp_path, tmp_path / "sa", 10255)
    assert argv[:5] == ["/usr/bin/unshare", "--mount", "--propagation", "private", "--"]
    assert argv[5:7] == ["sh", "-c"] and argv[7] == netpolicy.MOUNT_SCRIPT
    # $0 is a label, $1 the credentials directory, then the enforcer's own command line.
    assert argv[8:11] == ["netpol", str(tmp_path / "sa"), str(tmp_path / "kube-network-policies")]
    flags = argv[11:]
    assert f"--hostname-override={NODE_NAME}" in flags
    assert "--nfqueue-id=98" in flags
    assert "--metrics-bind-address=127.0.0.1:10255" in flags
    assert not any(f.startswith("--fail-open") for f in flags)  # fail-closed: see the module


def test_netpolicy_mount_script_binds_the_credentials_where_in_cluster_config_reads() -> None:
    script = netpolicy.MOUNT_SCRIPT
    assert script.startswith("set -e;")
    assert "mount -t tmpfs" in script and " /run;" in script
    assert f'mount --bind -o ro "$sa_dir" {netpolicy.SA_MOUNT}' in script
    assert script.endswith('exec "$@"')


def test_netpolicy_rbac_may_only_list_and_watch_what_it_evaluates() -> None:
    objects = dict((obj["kind"], (path, obj)) for path, obj in netpolicy.rbac_objects())
    assert set(objects) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    rules = objects["ClusterRole"][1]["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip
    assert granted == {
        ("", "pods", "list"), ("", "pods", "watch"),
        ("", "namespaces", "list"), ("", "namespaces", "watch"),
        ("networking.k8s.io", "networkpolicies", "list"),
        ("networking.k8s.io", "networkpolicies", "watch"),
    }  # fmt: skip
    binding = objects["ClusterRoleBinding"][1]
    assert binding["roleRef"]["name"] == objects["ClusterRole"][1]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "diloco-network-policies", "namespace": "kube-system"}
    ]
    assert objects["ServiceAccount"][0] == "/api/v1/namespaces/kube-system/serviceaccounts"


def test_netpolicy_credentials_are_readable_by_root_only(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_bytes(b"CA")
    directory = tmp_path / "sa"
    netpolicy.write_credentials(directory, "tok", ca)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert (directory / "token").read_text() == "tok"
    assert (directory / "ca.crt").read_bytes() == b"CA"
    assert (directory / "namespace").read_text() == "kube-system"
