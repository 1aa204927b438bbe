"""An in-memory stand-in for diloco_operator.kube.Kube that records every call."""

from __future__ import annotations

import base64
import copy
from datetime import UTC, datetime
from typing import Any

from diloco_operator.kube import Listing
from diloco_operator.times import rfc3339


def job_body(name: str = "demo", *, uid: str = "uid-1", **spec: Any) -> dict[str, Any]:
    """A DiLoCoJob object as the API server returns it (remote syncer unless told otherwise)."""
    return {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {
            "name": name,
            "namespace": "ns1",
            "uid": uid,
            "generation": 1,
            "resourceVersion": "10",
            "creationTimestamp": rfc3339(datetime.now(UTC)),
        },
        "spec": {
            "image": "trainer:1",
            "islands": {"count": 2, "replicas": 1},
            "syncer": {"endpoint": "http://127.0.0.1:9", "tokenSecretName": "tok"},
            **spec,
        },
    }


def ready_pod(name: str, island: str, job: str = "demo", version: int = 50) -> dict[str, Any]:
    """A Running, Ready learner pod of `island`."""
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns1",
            "resourceVersion": str(version),
            "labels": {"diloco.dev/job": job, "diloco.dev/island": island},
        },
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


class FakeKube:
    """Children, pods and the job in dicts; `calls` lists (method, detail) in order."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job: dict[str, Any] | None = copy.deepcopy(job)
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.secrets: dict[str, dict[str, Any]] = {}  # by name, data decoded
        self.calls: list[tuple[str, str]] = []
        self._version = 100

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def methods(self) -> list[str]:
        """The names of the methods called, in order."""
        return [method for method, _ in self.calls]

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get_job", name))
        return copy.deepcopy(self.job)

    async def patch_job_status(
        self, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any] | None:
        self.calls.append(("patch_job_status", status["phase"]))
        if self.job is None:
            return None
        self.job["status"] = {k: v for k, v in status.items() if v is not None}
        self.job["metadata"]["resourceVersion"] = self._next_version()
        return copy.deepcopy(self.job)

    async def delete_job(self, namespace: str, name: str, uid: str) -> None:
        self.calls.append(("delete_job", name))
        self.job = None

    async def list_labelled(self, kind: str, namespace: str, job_name: str) -> Listing:
        self.calls.append(("list_labelled", kind))
        if kind == "Pod":
            items = list(self.pods.values())
        else:
            items = [o for (k, _), o in self.objects.items() if k == kind]
        return Listing(items=copy.deepcopy(items), version=str(self._version))

    async def apply(self, obj: dict[str, Any], *, force: bool = False) -> dict[str, Any]:
        self.calls.append(("apply", f"{obj['kind']}/{obj['metadata']['name']}"))
        return self._store(obj)

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Secret":
            data = dict(obj.get("stringData") or {})
            data.update(
                {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
            )
            self.secrets[obj["metadata"]["name"]] = {**copy.deepcopy(obj), "data": data}
            return copy.deepcopy(obj)
        stored = copy.deepcopy(obj)
        stored["metadata"]["resourceVersion"] = self._next_version()
        stored["metadata"]["generation"] = 1
        if obj["kind"] == "StatefulSet":
            stored["status"] = {"observedGeneration": 1, "readyReplicas": 0}
        self.objects[(obj["kind"], obj["metadata"]["name"])] = stored
        return copy.deepcopy(stored)

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        self.calls.append(("delete", f"{kind}/{name}"))
        self.objects.pop((kind, name), None)

    def _find(self, kind: str, name: str) -> dict[str, Any] | None:
        if kind == "Secret":
            return self.secrets.get(name)
        return self.objects.get((kind, name))

    async def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        self.calls.append(("create", f"{obj['kind']}/{obj['metadata']['name']}"))
        if self._find(obj["kind"], obj["metadata"]["name"]) is not None:
            return None
        return self._store(obj)

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", f"{kind}/{name}"))
        found = self._find(kind, name)
        return copy.deepcopy(found) if found is not None else None

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("read_secret", name))
        found = self.secrets.get(name)
        return copy.deepcopy(found) if found is not None else None

    async def patch_secret(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.calls.append(("patch_secret", name))
        secret = self.secrets[name]
        secret["metadata"].setdefault("annotations", {}).update(
            (patch.get("metadata") or {}).get("annotations") or {}
        )
        for key, value in (patch.get("data") or {}).items():
            secret["data"][key] = base64.b64decode(value).decode()
