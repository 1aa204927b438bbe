"""templates/rbac/: least-privilege ClusterRole or per-namespace Roles, and their bindings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .conftest import NAMESPACE
from .helm_tool import Rendered

# Every permission the operator holds, as (apiGroup, resource) -> verbs. This table is the review
# document for the operator's RBAC: a change to the templates must change it too.
NAMESPACED_GRANTS: dict[tuple[str, str], set[str]] = {
    ("diloco.dev", "dilocojobs"): {"get", "list", "watch", "patch", "delete"},
    ("diloco.dev", "dilocojobs/status"): {"patch"},
    ("apps", "statefulsets"): {"get", "list", "watch", "create", "patch", "delete"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "secrets"): {"get", "create", "patch"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "events"): {"create"},
}
CRD_GRANT = {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}}
NAMESPACE_GRANT = {("", "namespaces"): {"list", "watch"}}
NAMESPACE_SCOPE = {"rbac": {"scope": "namespace"}, "watchNamespaces": ["team-a", "team-b"]}


def grants(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    """Flatten RBAC rules into (apiGroup, resource) -> verbs."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_clusterrole_should_grant_only_operator_verbs_when_cluster_scope(
    render: Callable[..., Rendered],
) -> None:
    role = render().one("ClusterRole", "diloco-diloco-operator")
    assert grants(role["rules"]) == NAMESPACED_GRANTS | CRD_GRANT


def test_clusterrole_should_grant_namespace_watch_when_watching_listed_namespaces(
    render: Callable[..., Rendered],
) -> None:
    # kopf lists and watches namespaces only when it is restricted to some of them.
    role = render({"watchNamespaces": ["team-a"]}).one("ClusterRole", "diloco-diloco-operator")
    assert grants(role["rules"]) == NAMESPACED_GRANTS | CRD_GRANT | NAMESPACE_GRANT


def test_rbac_should_grant_no_wildcards_when_rendered(render: Callable[..., Rendered]) -> None:
    for values in (None, NAMESPACE_SCOPE):
        out = render(values)
        for doc in out.of_kind("ClusterRole") + out.of_kind("Role"):
            for rule in doc["rules"]:
                for key in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[key], (doc["metadata"]["name"], rule)
                # escalate/bind/impersonate would let the operator grant itself more.
                assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule


def test_clusterrolebinding_should_bind_serviceaccount_when_cluster_scope(
    render: Callable[..., Rendered],
) -> None:
    out = render()
    binding = out.one("ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "diloco-diloco-operator",
    }
    account = out.one("ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": NAMESPACE}
    ]


def test_role_should_render_per_namespace_not_clusterroles_when_namespace_scope(
    render: Callable[..., Rendered],
) -> None:
    out = render(NAMESPACE_SCOPE)
    assert out.of_kind("ClusterRole") == []
    assert out.of_kind("ClusterRoleBinding") == []
    roles = out.of_kind("Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert grants(role["rules"]) == NAMESPACED_GRANTS


def test_rolebinding_should_bind_release_serviceaccount_when_namespace_scope(
    render: Callable[..., Rendered],
) -> None:
    out = render(NAMESPACE_SCOPE)
    account = out.one("ServiceAccount")["metadata"]
    bindings = out.of_kind("RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["roleRef"]["name"] == "diloco-diloco-operator"
        # The account lives in the release namespace, not in the watched one.
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["name"], "namespace": NAMESPACE}
        ]


def test_role_should_fail_with_message_when_namespace_scope_without_namespaces(
    render_error: Callable[..., str],
) -> None:
    error = render_error({"rbac": {"scope": "namespace"}})
    assert "rbac.scope=namespace needs watchNamespaces" in error


def test_rbac_should_render_nothing_when_create_false(render: Callable[..., Rendered]) -> None:
    for values in ({"rbac": {"create": False}}, {**NAMESPACE_SCOPE, "rbac": {"create": False}}):
        kinds = set(render(values).kinds())
        assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}, values


def test_user_clusterroles_should_aggregate_into_default_roles_when_cluster_scope(
    render: Callable[..., Rendered],
) -> None:
    out = render()
    edit = out.one("ClusterRole", "diloco-diloco-operator-edit")
    view = out.one("ClusterRole", "diloco-diloco-operator-view")
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert grants(view["rules"])[("diloco.dev", "dilocojobs")] == {"get", "list", "watch"}
    assert "create" in grants(edit["rules"])[("diloco.dev", "dilocojobs")]
    assert grants(edit["rules"])[("diloco.dev", "dilocojobs/scale")] == {"get", "update", "patch"}
    off = render({"rbac": {"aggregateToDefaultRoles": False}})
    assert [r["metadata"]["name"] for r in off.of_kind("ClusterRole")] == ["diloco-diloco-operator"]
