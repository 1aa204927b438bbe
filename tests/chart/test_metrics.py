"""templates/metrics/: the metrics Service and the optional ServiceMonitor."""

from __future__ import annotations

from collections.abc import Callable

from .conftest import NAMESPACE
from .helm_tool import Rendered


def test_service_should_select_operator_metrics_port_when_enabled(
    render: Callable[..., Rendered],
) -> None:
    out = render()
    service = out.one("Service")
    pod = out.one("Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["type"] == "ClusterIP"
    (port,) = service["spec"]["ports"]
    assert port["port"] == 9090
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert port["targetPort"] in ports, "targetPort names no container port"


def test_service_should_not_render_when_disabled(render: Callable[..., Rendered]) -> None:
    assert render({"metrics": {"service": {"enabled": False}}}).of_kind("Service") == []


def test_servicemonitor_should_not_render_when_default_values(
    render: Callable[..., Rendered],
) -> None:
    assert render().of_kind("ServiceMonitor") == []


def test_servicemonitor_should_scrape_metrics_service_when_enabled(
    render: Callable[..., Rendered],
) -> None:
    monitor_values = {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}
    out = render({"metrics": {"serviceMonitor": monitor_values}})
    monitor = out.one("ServiceMonitor")
    service = out.one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "15s"


def test_servicemonitor_should_fail_with_message_when_service_disabled(
    render_error: Callable[..., str],
) -> None:
    error = render_error(
        {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}
    )
    assert "metrics.serviceMonitor.enabled=true needs metrics.service.enabled=true" in error
