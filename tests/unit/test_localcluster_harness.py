"""The harness tests/cluster and bench share: polling, readiness, the operator's arguments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hack.localcluster import harness
from hack.localcluster.objects import node_ready


def test_poll_until_returns_the_first_truthy_value() -> None:
    values = iter([None, [], ["pod-a"]])
    assert harness.poll_until(lambda: next(values), timeout=5, interval=0) == ["pod-a"]


def test_poll_until_retries_ignored_errors_and_quotes_the_last_one() -> None:
    calls = 0

    def flaky() -> bool:
        nonlocal calls
        calls += 1
        raise ConnectionError(f"refused #{calls}")

    with pytest.raises(harness.WaitTimeout) as info:
        harness.poll_until(flaky, timeout=0.05, interval=0.01, what="x", ignore=(OSError,))
    assert calls > 1
    assert isinstance(info.value, TimeoutError)
    assert str(info.value) == f"timed out after 0s waiting for x (last error: refused #{calls})"


def test_poll_until_lets_other_errors_through_at_once() -> None:
    calls = 0

    def broken() -> bool:
        nonlocal calls
        calls += 1
        raise KeyError("boom")

    with pytest.raises(KeyError):
        harness.poll_until(broken, timeout=5, interval=0, ignore=(OSError,))
    assert calls == 1


def test_holds_for_counts_the_checks_before_it_broke() -> None:
    answers = iter([True, True, False])
    with pytest.raises(harness.StoppedHolding, match=r"^ready stopped holding after 2 checks$"):
        harness.holds_for(lambda: next(answers), duration=5, interval=0, what="ready")
    harness.holds_for(lambda: True, duration=0.02, interval=0.005)


def _pod(ready: str | None, name: str = "p") -> dict[str, Any]:
    conditions = [{"type": "PodScheduled", "status": "True"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": ready})
    return {"metadata": {"name": name}, "status": {"conditions": conditions}}


def test_pod_readiness_goes_by_the_ready_condition() -> None:
    pods = [_pod("True", "a"), _pod("False", "b"), _pod(None, "c"), {"metadata": {"name": "d"}}]
    assert [p["metadata"]["name"] for p in harness.ready_pods(pods)] == ["a"]
    assert harness.condition_status(pods[1], "Ready") == "False"
    assert harness.condition_status(pods[3], "Ready") is None


def test_ready_patch_sets_both_conditions() -> None:
    patched = harness.ready_patch(False)
    assert not harness.pod_ready(patched)
    assert harness.condition_status(patched, "ContainersReady") == "False"
    assert harness.pod_ready(harness.ready_patch(True))


def test_job_readiness_fields() -> None:
    reachable = {"type": "SyncerReachable", "status": "True"}
    job = {"status": {"islands": {"ready": 2}, "conditions": [reachable]}}
    assert harness.islands_ready(job) == 2
    assert harness.condition_status(job, "SyncerReachable") == "True"
    assert harness.islands_ready({"metadata": {}}) is None


def test_a_node_is_ready_only_without_the_not_ready_taint() -> None:
    node: dict[str, Any] = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert node_ready(node)
    node["spec"] = {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}
    assert not node_ready(node)
    assert not node_ready({"spec": {}, "status": {}})


def test_operator_arguments_get_the_local_ports(tmp_path: Path) -> None:
    args = harness.standalone_operator_args(["ns-a", "ns-b"])
    assert args == ["operator", "--standalone", "--namespace", "ns-a", "--namespace", "ns-b"]
    chart = ["operator", "--health-port", "8080", "--metrics-port", "9090", "--standalone"]
    ports = {"--health-port": 1, "--metrics-port": 2}
    replaced = ["operator", "--health-port", "1", "--metrics-port", "2", "--standalone"]
    assert harness.with_ports(chart, ports) == replaced
    op = harness.OperatorProcess(
        env={}, log_file=tmp_path / "op.log", args=args, health_port=11, metrics_port=12
    )
    assert op.argv() == [harness.DILOCO, *args, "--health-port", "11", "--metrics-port", "12"]
    assert not op.alive and op.log_text() == ""


def test_control_plane_from_its_state_directory(tmp_path: Path) -> None:
    state = {"name": "main", "bin_dir": "/opt/k8s/bin", "ports": {"apiserver": 21003}}
    (tmp_path / "state.json").write_text(json.dumps(state))
    cp = harness.ControlPlane.from_dir(tmp_path)
    assert (cp.name, cp.server) == ("main", "https://127.0.0.1:21003")
    assert cp.kubeconfig == tmp_path / "kubeconfig" and cp.logs_dir == tmp_path / "logs"
    assert cp.env["KUBECONFIG"] == str(tmp_path / "kubeconfig")
    assert cp.env["PATH"].split(":")[0] == "/opt/k8s/bin"
    other = harness.ControlPlane.from_dir(tmp_path, bin_dir=tmp_path / "bin")
    assert other.env["PATH"].split(":")[0] == str(tmp_path / "bin")


def test_failure_summary_is_the_closing_summary_of_up() -> None:
    stderr = "[local-cluster] starting etcd...\n[local-cluster] ERROR: etcd died\n"
    stderr += "[local-cluster] ERROR: up failed after 1 attempt(s):\n  attempt 1: etcd died\n"
    stderr += "[local-cluster] logs of every attempt: /x/logs/attempt-*/\n"
    summary = harness.failure_summary(stderr)
    assert summary.startswith("[local-cluster] ERROR: up failed after 1 attempt(s):")
    assert summary.endswith("attempt-*/") and "starting etcd" not in summary
    assert harness.failure_summary("one\ntwo\n") == "one\ntwo"
