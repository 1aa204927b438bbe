"""hack/local-cluster's port choice: outside the ephemeral range, never a leased port."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path

import pytest
from diloco_trainer.local import launch

from hack.localcluster import ports
from hack.localcluster.errors import ClusterError
from hack.localcluster.settings import PORT_LEASE_SECONDS


def test_candidates_leave_out_the_ephemeral_range(tmp_path: Path) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("32768\t60999\n")
    assert ports.port_candidates(range_file) == [range(10000, 32768), range(61000, 65536)]


def test_candidates_when_the_ephemeral_range_covers_everything(tmp_path: Path) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024 65535\n")
    assert ports.port_candidates(range_file) == [range(10000, 65536)]


def test_candidates_default_when_the_range_is_unreadable(tmp_path: Path) -> None:
    garbled = tmp_path / "garbled"
    garbled.write_text("not numbers")
    expected = [range(10000, 32768), range(61000, 65536)]
    assert ports.port_candidates(garbled) == expected
    assert ports.port_candidates(tmp_path / "missing") == expected


@pytest.fixture
def leases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private lease file, four candidate ports that all count as free."""
    path = tmp_path / "leases.json"
    monkeypatch.setenv("DILOCO_K8S_PORT_LEASES", str(path))
    monkeypatch.setattr(ports, "port_candidates", lambda: [range(20000, 20004)])
    monkeypatch.setattr(ports, "port_is_free", lambda port: True)
    return path


def test_pick_skips_leased_and_taken_ports_and_leases_its_choice(leases: Path) -> None:
    now = time.time()
    leases.write_text(json.dumps({"20000": now}))
    picked = ports.pick_ports(2, taken={20001})
    assert sorted(picked) == [20002, 20003]
    recorded = json.loads(leases.read_text())
    assert set(recorded) == {"20000", "20002", "20003"}
    assert all(now - 1 <= recorded[p] <= time.time() + 1 for p in ("20002", "20003"))


def test_pick_drops_expired_leases_and_fails_once_every_port_is_leased(leases: Path) -> None:
    leases.write_text(json.dumps({"20000": time.time() - PORT_LEASE_SECONDS - 5}))
    assert sorted(ports.pick_ports(4, taken=set())) == [20000, 20001, 20002, 20003]
    with pytest.raises(ClusterError, match="could not find free loopback ports"):
        ports.pick_ports(1, taken=set())


def test_pick_starts_over_after_a_torn_lease_file(leases: Path) -> None:
    leases.write_text('{"20000": 1')  # a writer killed half-way
    (picked,) = ports.pick_ports(1, taken={20001, 20002, 20003})
    assert picked == 20000
    assert set(json.loads(leases.read_text())) == {"20000"}


def test_fresh_leases_keeps_only_recent_numeric_entries() -> None:
    now = 1_000_000.0
    raw = {"1": now - 10, "2": now - PORT_LEASE_SECONDS - 1, "3": "soon", "4": None}
    assert ports.fresh_leases(raw, now) == {"1": now - 10}
    assert ports.fresh_leases(["not", "a", "map"], now) == {}


def test_free_port_can_be_bound_and_a_bound_port_is_not_free() -> None:
    port = ports.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert not ports.port_is_free(port)


def test_a_local_runs_ports_leave_out_the_ephemeral_range() -> None:
    # `diloco run` picks its syncer and rendezvous ports here; the kernel's own choice (port 0)
    # lies in the ephemeral range, where an outgoing connection can take it before the bind.
    low, high = 32768, 60999
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, launch.EPHEMERAL_RANGE_FILE.read_text().split())
    picked = {launch.free_port() for _ in range(50)}
    assert not any(low <= p <= high for p in picked), sorted(picked)
    assert all(10000 <= p <= 65535 for p in picked)
