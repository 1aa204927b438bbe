"""Thin async edge to the Kubernetes API for the sync of a job.

The official client is synchronous; every call runs in a worker thread so kopf's event loop keeps
serving other jobs. Reads are few: pods and children come from the watches (observed.py); lists
happen only when a job is first synced and on the slow resync. Objects go in and come out as
plain dicts in API (camelCase) form, the same form the pure builders produce. Children are
written with server-side apply under one field manager, forcing only over the job's own
objects: a child the job does not own yet is created (children.py), never applied over.

Every call has a deadline: a connect and a read timeout on the request itself, and CALL_DEADLINE
over the whole call. The client's API discovery passes no timeout of its own, so its requests get
the same connect and read timeouts (TimedDynamicClient): against a server that accepts and never
answers, discovery ends with an error instead of holding its thread for ever, one more thread
for every retry. Discovery is held in memory only (MemoryDiscoverer): the client's default reads
and writes a file named by the API server's URL in the shared temporary directory, so a file left
by another process (an earlier operator, another server once at that address) answered discovery
in place of the server. Each outcome tells probes.API_HEALTH whether the API server answers,
which the operator's readiness reports.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import os
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.discovery import LazyDiscoverer
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError

from diloco_operator import api, metrics
from diloco_operator.probes import API_HEALTH
from diloco_operator.resources import JOB_LABEL, MANAGER

T = TypeVar("T")

_API_VERSIONS = {
    "ConfigMap": "v1",
    "Service": "v1",
    "Secret": "v1",
    "Pod": "v1",
    "StatefulSet": "apps/v1",
    "Deployment": "apps/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    api.KIND: api.API_VERSION,
}


@dataclass(frozen=True)
class Listing:
    """The answer to a list: the objects (with their kind) and the list's resourceVersion."""

    items: list[dict[str, Any]]
    version: str | None


# Worker threads for API calls, and HTTP connections to keep for them (one per thread). The
# threads are the Kube's own, not the event loop's default executor: aiohttp resolves the syncers'
# host names there, and 1,000 jobs' status polls must neither wait behind API calls nor hold
# threads the API calls need.
API_THREADS = 32
_THREADS = ThreadPoolExecutor(max_workers=API_THREADS, thread_name_prefix="k8s-api")  # lazy
# Seconds to connect to the API server and to wait for each read of an answer; a whole call
# (retries of the client included) ends after CALL_DEADLINE.
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 30.0
CALL_DEADLINE = 45.0
PROBE_TIMEOUT = 5.0  # the readiness probe's read timeout
# Failures that mean "the API server did not answer" (an HTTP error status is an answer).
_UNANSWERED = (urllib3.exceptions.HTTPError, OSError, asyncio.TimeoutError)


def _as_dict(_client: Any, data: Any) -> Any:
    """DynamicClient serializer: the decoded JSON as it is."""
    return data


class MemoryDiscoverer(LazyDiscoverer):
    """The client's lazy discovery, cached in this process's memory only: it never writes its
    cache file, and it is given one no process has written (`_unwritten_cache_file`), so every
    operator process discovers from the API server it talks to. (A read-only container could not
    write the file anyway.)"""

    def _write_cache(self) -> None:
        return None


def _unwritten_cache_file() -> str:
    """A cache path that does not exist and is never written (MemoryDiscoverer): the client
    reads a cache file when its path exists."""
    return os.path.join(tempfile.gettempdir(), f"diloco-operator-discovery-{uuid.uuid4().hex}")


class TimedDynamicClient(DynamicClient):
    """DynamicClient whose every request has the connect and read timeouts of the operator's
    calls unless the caller gives its own: discovery (at construction and when a kind is first
    looked up) calls `request` without one, and urllib3 would then wait for ever. Its discovery
    is the process's own (MemoryDiscoverer)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        super().__init__(
            api_client, cache_file=_unwritten_cache_file(), discoverer=MemoryDiscoverer
        )

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        params.setdefault("_request_timeout", (CONNECT_TIMEOUT, READ_TIMEOUT))
        return super().request(method, path, body=body, **params)


class ApiUnavailable(RuntimeError):
    """The API server did not answer a call in time (or the connection failed)."""


def load_config() -> client.ApiClient:
    """In-cluster service account when there is one, else KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = API_THREADS
    return client.ApiClient(configuration)


class Kube:
    """The API calls the operator makes, as coroutines."""

    def __init__(self, api_client: client.ApiClient) -> None:
        # Discovery happens here (blocking, each request timed): call once, off the event loop.
        self._dyn = TimedDynamicClient(api_client)
        self._version = client.VersionApi(api_client)
        self._cache: dict[str, Any] = {}

    async def _resource(self, kind: str) -> Any:
        """The API resource of `kind`, looked up once. Lazily, because the CRD may be installed
        after the operator starts; and in an API thread, bounded like any call, because a lookup
        the client has not cached asks the API server (discovery): never on the event loop."""
        if kind not in self._cache:
            lookup = functools.partial(
                self._dyn.resources.get, api_version=_API_VERSIONS[kind], kind=kind
            )
            self._cache[kind] = await self._in_thread(lookup)
        return self._cache[kind]

    @classmethod
    async def connect(cls, api_client: client.ApiClient) -> Kube:
        """Build the client (API discovery) off the event loop."""
        return await asyncio.to_thread(cls, api_client)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        kwargs.setdefault("_request_timeout", (CONNECT_TIMEOUT, READ_TIMEOUT))
        return await self._in_thread(functools.partial(fn, *args, **kwargs))

    async def _in_thread(self, call: Callable[[], T]) -> T:
        """Run `call` in an API thread within CALL_DEADLINE, telling API_HEALTH whether the API
        server answered."""
        try:
            running = asyncio.get_running_loop().run_in_executor(_THREADS, call)
            result = await asyncio.wait_for(running, CALL_DEADLINE)
        except ApiException:
            API_HEALTH.answered()  # an error status is an answer
            raise
        except _UNANSWERED as err:
            API_HEALTH.unanswered(f"{type(err).__name__}: {err}")
            raise ApiUnavailable(f"the API server did not answer: {type(err).__name__}") from err
        API_HEALTH.answered()
        return result

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A DynamicClient call answered as a plain dict, decoded in the worker thread.

        The client's default answer is a ResourceInstance that is built field by field and has
        to be walked again by to_dict(); at 1,000 jobs that walk, on the event loop, took 40% of
        the operator's only core (py-spy). json.loads in the API thread costs a fraction.
        """
        return await self._run(fn, *args, serializer=_as_dict, **kwargs)

    async def ping(self) -> None:
        """Ask the API server for its version (the readiness probe's question)."""
        await self._run(self._version.get_code, _request_timeout=(CONNECT_TIMEOUT, PROBE_TIMEOUT))

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The DiLoCoJob, or None when it is gone."""
        metrics.API_READS.labels(verb="get", kind=api.KIND).inc()
        try:
            obj = await self._call(self._dyn.get, await self._resource(api.KIND), name, namespace)
        except NotFoundError:
            return None
        return obj

    async def patch_job_status(
        self, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Merge-patch the status subresource (None values delete fields); the job as written,
        None when it is gone."""
        resource = (await self._resource(api.KIND)).subresources["status"]
        try:
            obj = await self._call(
                self._dyn.patch,
                resource,
                {"status": status},
                name=name,
                namespace=namespace,
                content_type="application/merge-patch+json",
            )
        except NotFoundError:
            return None
        return obj

    async def delete_job(self, namespace: str, name: str, uid: str) -> None:
        """Delete the job itself (TTL), only if it is still the same object."""
        body = {"preconditions": {"uid": uid}, "propagationPolicy": "Background"}
        with contextlib.suppress(NotFoundError):
            await self._call(
                self._dyn.delete, await self._resource(api.KIND), name, namespace, body=body
            )

    async def list_labelled(self, kind: str, namespace: str, job_name: str) -> Listing:
        """Every object of `kind` labelled with the job (owner checked by the caller)."""
        metrics.API_READS.labels(verb="list", kind=kind).inc()
        result = await self._call(
            self._dyn.get,
            await self._resource(kind),
            namespace=namespace,
            label_selector=f"{JOB_LABEL}={job_name}",
        )
        doc = result
        items = list(doc.get("items") or [])
        for item in items:
            item.setdefault("kind", kind)
        return Listing(items=items, version=(doc.get("metadata") or {}).get("resourceVersion"))

    async def apply(self, obj: dict[str, Any], *, force: bool = False) -> dict[str, Any]:
        """Server-side apply: bring our fields to the desired values; returns the object as
        stored. `force` takes fields back from other managers: only for objects the job owns."""
        result = await self._call(
            self._dyn.server_side_apply,
            await self._resource(obj["kind"]),
            body=obj,
            name=obj["metadata"]["name"],
            namespace=obj["metadata"]["namespace"],
            field_manager=MANAGER,
            force_conflicts=force,
        )
        stored = result
        stored.setdefault("kind", obj["kind"])
        return stored

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete a child (foreground is not needed: its own children are GC'd)."""
        with contextlib.suppress(NotFoundError):
            await self._call(self._dyn.delete, await self._resource(kind), name, namespace)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create the object; the object as stored, None when one with its name exists."""
        try:
            result = await self._call(
                self._dyn.create,
                await self._resource(obj["kind"]),
                body=obj,
                namespace=obj["metadata"]["namespace"],
            )
        except ConflictError:
            return None
        stored = result
        stored.setdefault("kind", obj["kind"])
        return stored

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The named object, None when there is none."""
        metrics.API_READS.labels(verb="get", kind=kind).inc()
        try:
            obj = await self._call(self._dyn.get, await self._resource(kind), name, namespace)
        except NotFoundError:
            return None
        stored = obj
        stored.setdefault("kind", kind)
        return stored

    async def patch_secret(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """Merge-patch a Secret (the generated root token, when it is rotated)."""
        await self._call(
            self._dyn.patch,
            await self._resource("Secret"),
            patch,
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
        )

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Secret with its data decoded ({"data": {key: text}, "metadata": ...}), None when
        there is none."""
        obj = await self.get("Secret", namespace, name)
        if obj is None:
            return None
        data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return {**obj, "data": data}

    async def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        """One decoded value of a Secret, None when the Secret or key is missing."""
        secret = await self.read_secret(namespace, name)
        value = ((secret or {}).get("data") or {}).get(key)
        return value.strip() if value is not None else None
