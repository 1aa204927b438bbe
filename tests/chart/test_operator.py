"""templates/operator/: the operator Deployment and its ServiceAccount."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from diloco_trainer.cli import build_parser

from .dockerfile_reader import DOCKERFILE, exec_form, parse_dockerfile
from .helm_tool import Rendered


def _container(out: Rendered) -> dict[str, Any]:
    containers = out.one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def test_deployment_should_run_one_replica_with_recreate_when_default_values(
    render: Callable[..., Rendered],
) -> None:
    spec = render().one("Deployment")["spec"]
    assert spec["replicas"] == 1
    # Without peering two operator pods would reconcile the same jobs during a rolling update.
    assert spec["strategy"] == {"type": "Recreate"}
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()


def test_deployment_should_harden_security_context_when_default_values(
    render: Callable[..., Rendered],
) -> None:
    out = render()
    pod = out.one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = _container(out)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # A read-only root still needs a writable /tmp.
    mounts = {m["name"]: m["mountPath"] for m in _container(out)["volumeMounts"]}
    assert mounts == {"tmp": "/tmp"}
    volume = next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert volume["emptyDir"]["sizeLimit"] == "64Mi"


def test_deployment_should_set_resources_when_default_values(
    render: Callable[..., Rendered],
) -> None:
    resources = _container(render())["resources"]
    assert resources["requests"] == {"cpu": "100m", "memory": "128Mi"}
    assert resources["limits"]["memory"] == "512Mi"


def test_deployment_should_probe_health_port_when_default_values(
    render: Callable[..., Rendered],
) -> None:
    container = _container(render())
    # Liveness: the event loop answers; readiness: the API server answers the operator.
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert get["port"] == "health", probe
    assert _port(container, "health") == 8080
    assert _port(container, "metrics") == 9090


def test_deployment_should_pass_args_the_cli_accepts_when_default_values(
    render: Callable[..., Rendered],
) -> None:
    container = _container(render())
    assert "command" not in container, "the image's ENTRYPOINT (diloco) must stay"
    args = build_parser().parse_args(container["args"])
    assert args.command == "operator"
    assert args.standalone is True
    assert args.health_port == _port(container, "health")
    assert args.metrics_port == _port(container, "metrics")
    assert args.namespace == []


def test_deployment_should_follow_ports_when_ports_changed(
    render: Callable[..., Rendered],
) -> None:
    container = _container(render({"operator": {"healthPort": 18080, "metricsPort": 19090}}))
    args = build_parser().parse_args(container["args"])
    assert (args.health_port, args.metrics_port) == (18080, 19090)
    assert (_port(container, "health"), _port(container, "metrics")) == (18080, 19090)


def test_deployment_should_watch_listed_namespaces_when_watch_namespaces_set(
    render: Callable[..., Rendered],
) -> None:
    container = _container(render({"watchNamespaces": ["team-a", "team-b"]}))
    assert build_parser().parse_args(container["args"]).namespace == ["team-a", "team-b"]


def test_deployment_should_append_extra_args_and_env_when_given(
    render: Callable[..., Rendered],
) -> None:
    container = _container(
        render({"operator": {"extraArgs": ["--flag"], "env": [{"name": "X", "value": "1"}]}})
    )
    assert container["args"][-1] == "--flag"
    # Appended after the operator's own variables (DILOCO_OPERATOR_*).
    assert container["env"][-1] == {"name": "X", "value": "1"}
    assert [e["name"] for e in container["env"]].count("X") == 1


def test_deployment_should_use_app_version_tag_when_tag_unset(
    render: Callable[..., Rendered], chart_meta: dict[str, Any]
) -> None:
    container = _container(render())
    expected = f"ghcr.io/diloco-operator/diloco-operator:{chart_meta['appVersion']}"
    assert container["image"] == expected
    assert container["imagePullPolicy"] == "IfNotPresent"


def test_deployment_should_use_given_tag_when_tag_set(render: Callable[..., Rendered]) -> None:
    image = {"repository": "local/op", "tag": "dev", "pullPolicy": "Never"}
    container = _container(render({"image": image}))
    assert container["image"] == "local/op:dev"
    assert container["imagePullPolicy"] == "Never"


def test_deployment_should_pin_digest_when_digest_set(render: Callable[..., Rendered]) -> None:
    digest = "sha256:" + "ab" * 32
    container = _container(render({"image": {"tag": "dev", "digest": digest}}))
    assert container["image"] == f"ghcr.io/diloco-operator/diloco-operator@{digest}"


def test_deployment_should_schedule_as_told_when_placement_given(
    render: Callable[..., Rendered],
) -> None:
    toleration = {"key": "infra", "operator": "Exists", "effect": "NoSchedule"}
    pod = render(
        {
            "operator": {
                "nodeSelector": {"pool": "system"},
                "tolerations": [toleration],
                "priorityClassName": "system-cluster-critical",
            },
            "image": {"pullSecrets": [{"name": "regcred"}]},
        }
    ).one("Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["tolerations"] == [toleration]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_serviceaccount_should_run_the_deployment_when_created(
    render: Callable[..., Rendered],
) -> None:
    out = render({"serviceAccount": {"annotations": {"iam": "role"}}})
    account = out.one("ServiceAccount")
    assert account["metadata"]["annotations"] == {"iam": "role"}
    pod = out.one("Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_serviceaccount_should_not_render_when_create_false(
    render: Callable[..., Rendered],
) -> None:
    out = render({"serviceAccount": {"create": False, "name": "mine"}})
    assert out.of_kind("ServiceAccount") == []
    pod = out.one("Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mine"
    binding = out.one("ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == "mine"


def test_deployment_should_start_with_the_operator_image_cmd_when_rendered(
    render: Callable[..., Rendered],
) -> None:
    dockerfile = parse_dockerfile(DOCKERFILE.read_text())
    chain = dockerfile.chain("operator")
    image_cmd = exec_form(next(c for s in chain for c in reversed(s.args_of("CMD"))))
    args = _container(render())["args"]
    # args replace the image's CMD: they must name the same subcommand, after the ENTRYPOINT.
    assert args[: len(image_cmd)] == image_cmd


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def test_deployment_should_tell_operator_its_network_policy_options_when_default_values(
    render: Callable[..., Rendered],
) -> None:
    out = render()
    env = _env(_container(out))
    assert env["DILOCO_OPERATOR_NETWORK_POLICIES"] == "true"
    assert env["DILOCO_OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # The labels jobs' NetworkPolicies admit are the operator pods' own.
    pairs = dict(p.split("=", 1) for p in env["DILOCO_OPERATOR_POD_LABELS"].split(","))
    pod_labels = out.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pairs and pairs.items() <= pod_labels.items()
    assert "app.kubernetes.io/component" in pairs


def test_deployment_should_turn_network_policies_off_when_value_false(
    render: Callable[..., Rendered],
) -> None:
    out = render(
        {"networkPolicy": {"enabled": False}, "operator": {"env": [{"name": "X", "value": "1"}]}}
    )
    env = _env(_container(out))
    assert env["DILOCO_OPERATOR_NETWORK_POLICIES"] == "false" and env["X"] == "1"
