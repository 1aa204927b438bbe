"""hack/local-cluster's certificates (made with the openssl CLI) and kubeconfigs."""

from __future__ import annotations

import base64
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from hack.localcluster.pki import APISERVER_SANS, CLIENTS, LEAVES, kubeconfig_yaml, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cluster") / "pki"
    make_pki(directory)
    return directory


def _openssl(*args: str) -> str:
    return subprocess.run(
        ["openssl", *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def test_layout_ca_one_pair_per_leaf_and_the_sa_keys(pki: Path) -> None:
    leaves = {f"{leaf.name}.{ext}" for leaf in LEAVES for ext in ("crt", "key")}
    expected = {"ca.crt", "ca.key", "ca.srl", "sa.key", "sa.pub"} | leaves
    # No CSR or extension file is left behind.
    assert {p.name for p in pki.iterdir()} == expected
    assert stat.S_IMODE(pki.stat().st_mode) == 0o700
    for key in pki.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key.name
    # Every client of the apiserver has its own certificate.
    assert set(CLIENTS) <= {leaf.name for leaf in LEAVES}


def test_every_leaf_is_signed_by_the_ca_with_its_subject(pki: Path) -> None:
    ca = str(pki / "ca.crt")
    for leaf in LEAVES:
        cert = str(pki / f"{leaf.name}.crt")
        assert _openssl("verify", "-CAfile", ca, cert) == f"{cert}: OK"
        subject = _openssl("x509", "-in", cert, "-noout", "-subject", "-nameopt", "compat")
        assert subject == f"subject={leaf.subject}"


def test_apiserver_serves_loopback_and_the_in_cluster_names(pki: Path) -> None:
    text = _openssl("x509", "-in", str(pki / "apiserver.crt"), "-noout", "-ext", "subjectAltName")
    names = {n.strip().replace("IP Address:", "IP:") for n in text.splitlines()[1].split(",")}
    assert names == set(APISERVER_SANS)
    assert {"IP:127.0.0.1", "IP:10.96.0.1", "DNS:kubernetes.default.svc"} <= names


def test_sa_public_key_matches_its_private_key(pki: Path) -> None:
    derived = _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout")
    assert derived == (pki / "sa.pub").read_text().strip()


def test_kubeconfig_embeds_the_ca_and_client_certificate(pki: Path) -> None:
    text = kubeconfig_yaml(
        "c1", "https://127.0.0.1:6443", pki / "ca.crt", "admin",
        cert=pki / "admin.crt", key=pki / "admin.key",
    )  # fmt: skip
    doc = yaml.safe_load(text)
    (cluster,) = doc["clusters"]
    assert cluster["cluster"]["server"] == "https://127.0.0.1:6443"
    ca = base64.b64decode(cluster["cluster"]["certificate-authority-data"])
    assert ca == (pki / "ca.crt").read_bytes()
    (user,) = doc["users"]
    assert base64.b64decode(user["user"]["client-key-data"]) == (pki / "admin.key").read_bytes()
    assert doc["current-context"] == "c1"
    assert "namespace" not in doc["contexts"][0]["context"]


def test_service_account_kubeconfig_carries_the_token_and_namespace(pki: Path) -> None:
    user = "system:serviceaccount:ns1:sa1"
    doc = yaml.safe_load(
        kubeconfig_yaml("c1", "https://x", pki / "ca.crt", user, token="t0k", namespace="ns1")
    )
    assert doc["users"] == [{"name": user, "user": {"token": "t0k"}}]
    assert doc["contexts"][0]["context"] == {"cluster": "c1", "user": user, "namespace": "ns1"}
