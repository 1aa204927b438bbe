"""What the operator keeps about each job between syncs: one JobRuntime record per job.

Everything is rebuilt after a restart: the job, its pods and its children come back through the
watches' initial listings (and the first sync's lists), membership decisions from the syncer's
reported states. Nothing here talks to the API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco_trainer.api.client import SyncerJsonClient
from diloco_trainer.api.credentials import Issuer
from diloco_trainer.api.documents import SyncerStatus

from diloco_operator import api
from diloco_operator.desired import DesiredChildren
from diloco_operator.health import MembershipDecisions, PodView, pod_view
from diloco_operator.kube import Kube
from diloco_operator.merge_waits import MergeWaits
from diloco_operator.observed import ObjectCache, child_view, resource_version
from diloco_operator.resources import NetworkOptions
from diloco_operator.syncer_view import SyncerView

JobKey = tuple[str, str]  # (namespace, name)
ChildKey = tuple[str, str]  # (kind, name)
DELETED = "DELETED"


@dataclass
class SyncerConnection:
    """The job's syncer as last seen: the HTTP client, its status document or the error."""

    client: SyncerJsonClient | None = None
    client_key: tuple[str, str, str | None] | None = None  # (url, credential, CA Secret)
    status: SyncerStatus | None = None  # /v1/status, None when not reached
    # Island states the syncer acknowledged since `status` was read (syncer_view.py).
    acknowledged: dict[str, str] = field(default_factory=dict)
    error: str | None = "not contacted yet"
    failures: int = 0  # unanswered status polls in a row
    retry_at: float = 0.0  # time.monotonic() before which the status is not polled again

    @property
    def view(self) -> SyncerView | None:
        """What the policies read: the status and the states set since; None when not reached."""
        if self.status is None:
            return None
        return SyncerView(self.status, dict(self.acknowledged))

    def read(self, status: SyncerStatus) -> None:
        """The syncer answered with this status (it shows every state set before it)."""
        self.status, self.error = status, None
        self.acknowledged.clear()

    def lost(self, error: str) -> None:
        """The syncer did not answer: no status until it does, and why."""
        self.status, self.error = None, error
        self.acknowledged.clear()

    def acknowledge(self, island: str, state: str) -> None:
        """The syncer took island `island`'s new state (shown until the next read)."""
        if self.status is not None:
            self.acknowledged[island] = state

    async def drop_client(self) -> None:
        """Close the client, so that the next call reads the token and CA Secrets again."""
        if self.client is not None:
            await self.client.close()
        self.client = self.client_key = None


@dataclass
class JobCredentials:
    """The job's credential as last read (credential_secrets.py), and what was derived from it."""

    checked: bool = False  # read since the last resync (or the last failed syncer call)
    issuer: Issuer | None = None
    error: str | None = None  # why there is no issuer
    reported: str | None = None  # the last credential problem posted as an Event
    rotation: str = ""  # the rotate-credentials value the issuer was read for
    written: str | None = None  # hash of the island credentials Secret last written

    def forget(self) -> None:
        """Read the token Secret again on the next sync (and re-check the islands' Secret)."""
        self.checked, self.written = False, None


@dataclass
class JobRuntime:
    """One job's runtime state: what was seen, what was decided, and its background tasks."""

    namespace: str
    name: str
    uid: str | None = None  # None until the job itself is seen (its pods may come first)
    body: dict[str, Any] | None = None  # the newest DiLoCoJob object seen
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one sync at a time
    pods: ObjectCache[str, PodView] = field(default_factory=lambda: ObjectCache(pod_view))
    children: ObjectCache[ChildKey, dict[str, Any]] = field(
        default_factory=lambda: ObjectCache(child_view)
    )
    # Whether pods / children were listed since the last resync, and when that was.
    pods_listed: bool = False
    children_listed: bool = False
    credentials: JobCredentials = field(default_factory=JobCredentials)
    network: NetworkOptions = field(default_factory=NetworkOptions)  # the operator's options
    conflicts: list[str] = field(default_factory=list)  # children whose names others hold
    resynced_at: float = field(default_factory=time.monotonic)
    membership: MembershipDecisions = field(default_factory=MembershipDecisions)
    syncer: SyncerConnection = field(default_factory=SyncerConnection)
    syncer_pods_ready: int = 0  # the job's own syncer pods Ready at the last sync
    rollout: list[str] = field(default_factory=list)  # island StatefulSets rolling or held
    last_reconcile: float = 0.0  # time.monotonic() of the last reconcile of the children
    desired: DesiredChildren = field(default_factory=DesiredChildren)  # the last build
    spec_error: str | None = None  # the last invalid-spec message posted as an Event
    notes: dict[str, str] = field(default_factory=dict)  # one-off Events posted: key -> message
    # The syncer's refusal counts last seen, (island, reason) -> count (refusals.py); None
    # before the first look.
    refusals: dict[tuple[str, str], int] | None = None
    # The islands' waits for merges over the syncer's status reads (merge_waits.py); None before
    # the first read (then taken up from the stored status).
    waits: MergeWaits | None = None
    phase: str | None = None
    pending: bool | None = None  # a requested sync not started: True when it must reconcile
    drain: asyncio.Task[None] | None = None  # runs requested syncs one after another
    timer: asyncio.Task[None] | None = None  # polls the syncer and re-checks every few seconds

    @property
    def key(self) -> JobKey:
        """(namespace, name)."""
        return self.namespace, self.name

    async def see_job(self, body: Mapping[str, Any]) -> bool:
        """Keep the newest DiLoCoJob object; True when `body` was taken.

        A new uid under the same name (deleted and created again) starts the job over; what was
        seen of pods and children stays, and is listed again on the next sync.
        """
        version = resource_version(body)
        uid = body["metadata"]["uid"]
        if self.uid == uid and self.body is not None:
            have = resource_version(self.body)
            if version is not None and have is not None and version < have:
                return False
        if self.uid is not None and self.uid != uid:
            await self._start_over()
        self.uid = uid
        self.body = dict(body)
        return True

    async def _start_over(self) -> None:
        self.membership = MembershipDecisions()
        await self.syncer.drop_client()
        self.syncer, self.syncer_pods_ready = SyncerConnection(), 0
        self.rollout, self.spec_error, self.phase, self.refusals = [], None, None, None
        self.waits = None
        self.credentials, self.conflicts = JobCredentials(), []
        self.last_reconcile = 0.0
        self.start_resync()

    def start_resync(self) -> None:
        """List pods and children again, and read the token Secret, on the next syncs."""
        self.pods_listed = self.children_listed = False
        self.credentials.forget()
        self.resynced_at = time.monotonic()

    def see_pod(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """A watch event of one of the job's pods."""
        name = obj["metadata"]["name"]
        if event_type == DELETED:
            self.pods.delete(name, obj)
        else:
            self.pods.upsert(name, obj)

    def see_child(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """A watch event (or an apply's answer) of one of the job's children."""
        key = (obj["kind"], obj["metadata"]["name"])
        if event_type == DELETED:
            self.children.delete(key, obj)
        else:
            self.children.upsert(key, obj)

    @property
    def orphan(self) -> bool:
        """Nothing left to remember: the job was never seen and none of its objects remain."""
        return self.body is None and not len(self.pods) and not len(self.children)

    async def close(self) -> None:
        """Stop the background tasks (not the one calling this) and close the syncer client."""
        current = asyncio.current_task()
        for task in (self.timer, self.drain):
            if task is not None and task is not current:
                task.cancel()
        await self.syncer.drop_client()


@dataclass
class Registry:
    """The operator's process-wide state: the API edge and one JobRuntime per job."""

    kube: Kube | None = None
    jobs: dict[JobKey, JobRuntime] = field(default_factory=dict)
    network: NetworkOptions = field(default_factory=NetworkOptions)

    def job(self, namespace: str, name: str) -> JobRuntime:
        """The record of a job, created on first sight."""
        key = (namespace, name)
        runtime = self.jobs.get(key)
        if runtime is None:
            runtime = JobRuntime(namespace=namespace, name=name, network=self.network)
            self.jobs[key] = runtime
        return runtime

    def find(self, namespace: str, name: str) -> JobRuntime | None:
        """The record of a job, None when there is none."""
        return self.jobs.get((namespace, name))

    def for_object_event(
        self, namespace: str, job_name: str, event_type: str | None
    ) -> JobRuntime | None:
        """The record a pod or child event belongs to; a deletion creates none."""
        if event_type == DELETED:
            return self.find(namespace, job_name)
        return self.job(namespace, job_name)

    def drop_if_orphan(self, runtime: JobRuntime) -> None:
        """Forget a record that only held objects of a job never seen, once they are gone."""
        if runtime.orphan and self.jobs.get(runtime.key) is runtime:
            del self.jobs[runtime.key]

    async def forget(self, namespace: str, name: str) -> None:
        """The job is gone: stop its tasks and drop its record."""
        runtime = self.jobs.pop((namespace, name), None)
        if runtime is not None:
            await runtime.close()

    def phase_counts(self) -> dict[str, int]:
        """How many known jobs are in each phase (every phase listed)."""
        counts = dict.fromkeys(api.PHASES, 0)
        for runtime in self.jobs.values():
            if runtime.phase in counts:
                counts[runtime.phase] += 1
        return counts

    async def close(self) -> None:
        """Stop every job's tasks and close every syncer client (operator shutdown)."""
        for runtime in list(self.jobs.values()):
            with contextlib.suppress(Exception):
                await runtime.close()
