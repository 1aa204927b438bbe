"""Syncer shards (`syncer.shards: N`): which syncer process owns which fragment, and how the
answers of N shards read as the answer of one syncer (torch-free: the operator, `diloco run`,
the learners and every syncer shard use it).

Fragments are dealt round-robin: fragment f belongs to shard f mod N. Fragments are streamed at
staggered steps (sync.fragments), so neighbouring fragments are the ones pushed one after the
other; round-robin puts them on different shards, which spreads both the bytes and the merges.
Every shard holds the whole membership of the job (each island joins, heartbeats and leaves at
every shard): a shard's rounds, quorum and grace window read the islands' liveness locally, so
no merge ever waits on another shard, and a shard restarted from its checkpoint is rejoined by
the islands on its own (a 404 from it) while the others go on merging.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from diloco_trainer.api.documents import CheckpointRef, HeartbeatAnswer, JoinInfo, SyncerStatus

# A request for a fragment that another shard owns: 421 Misdirected Request, with this code and
# a message naming the right shard (the learner was given the wrong list of shard URLs).
WRONG_SHARD_STATUS = 421
ERROR_WRONG_SHARD = "wrong_shard"
# DILOCO_SYNCER_URL holds the shards' URLs in shard order, separated by this.
URL_SEPARATOR = ","


# `diloco run` keeps shard i's state (checkpoints, merge log) in STATE/shard-i of its syncer
# state dir; `diloco export STATE` assembles the model from them.
SHARD_DIR_PREFIX = "shard-"


def shard_state_dir(state_dir: Path, shard: int, shards: int) -> Path:
    """Shard `shard`'s state dir under a job's syncer state dir (the dir itself for one)."""
    return state_dir if shards == 1 else state_dir / f"{SHARD_DIR_PREFIX}{shard}"


def shard_dirs(state_dir: Path) -> list[Path]:
    """The shard state dirs under `state_dir`, in shard order (none: not a sharded syncer's)."""
    found = {}
    for path in state_dir.glob(f"{SHARD_DIR_PREFIX}*"):
        index = path.name.removeprefix(SHARD_DIR_PREFIX)
        if path.is_dir() and index.isdigit():
            found[int(index)] = path
    if found and sorted(found) != list(range(len(found))):
        raise ValueError(f"{state_dir} holds shard dirs {sorted(found)}, not 0..{len(found) - 1}")
    return [found[i] for i in sorted(found)]


def shard_of(fragment: int, shards: int) -> int:
    """The shard that owns `fragment`: round-robin (module docstring)."""
    if shards < 1:
        raise ValueError(f"syncer.shards must be >= 1, got {shards}")
    if fragment < 0:
        raise ValueError(f"fragment must be >= 0, got {fragment}")
    return fragment % shards


def fragments_of(shard: int, shards: int, fragments: int) -> list[int]:
    """The fragments shard `shard` of `shards` owns, in order."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not one of the {shards} syncer shards")
    return list(range(shard, fragments, shards))


def wrong_shard_message(fragment: int, shards: int, shard: int) -> str:
    """What a shard answers a request for a fragment it does not own."""
    owner = shard_of(fragment, shards)
    return (
        f"fragment {fragment} belongs to syncer shard {owner} of {shards}, not to this shard "
        f"({shard}): send it to shard {owner}'s URL (position {owner} of DILOCO_SYNCER_URL)"
    )


def split_urls(value: str) -> list[str]:
    """The shards' URLs from DILOCO_SYNCER_URL (one URL: one syncer, no shards)."""
    urls = [u.strip().rstrip("/") for u in value.split(URL_SEPARATOR)]
    if not all(urls):
        raise ValueError(f"empty URL in the list of syncer shard URLs {value!r}")
    return urls


def join_urls(urls: Sequence[str]) -> str:
    """DILOCO_SYNCER_URL for a learner of a job with these shard URLs (in shard order)."""
    return URL_SEPARATOR.join(urls)


def merge_join(infos: Sequence[JoinInfo]) -> JoinInfo:
    """The join answers of every shard (in shard order) as one: each fragment's version from the
    shard that owns it, the least outer step, finished when every shard is."""
    shards = len(infos)
    first = infos[0]
    versions = [infos[shard_of(f, shards)].versions[f] for f in range(len(first.fragments))]
    return first.model_copy(
        update={
            "versions": versions,
            "outer_step": min(i.outer_step for i in infos),
            "finished": all(i.finished for i in infos),
        }
    )


def merge_heartbeat(answers: Sequence[HeartbeatAnswer]) -> HeartbeatAnswer:
    """The heartbeat answers of every shard (in shard order) as one: the island's state at shard
    0, each fragment's version from its owner, finished when every shard is, the lowest stop
    target."""
    shards = len(answers)
    first = answers[0]
    versions = [answers[shard_of(f, shards)].versions[f] for f in range(len(first.versions))]
    finished = all(a.finished for a in answers)
    # Each shard fixes its stop target from the same heartbeats: the earliest is kept.
    stops = [a.stop_at for a in answers if a.stop_at is not None]
    update = {"versions": versions, "finished": finished, "stop_at": min(stops, default=None)}
    return first.model_copy(update=update)


def _summed(maps: Sequence[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in maps:
        for key, n in m.items():
            out[key] = out.get(key, 0) + n
    return out


def _pending(status: SyncerStatus, fragment: int) -> int:
    return status.pending[fragment] if fragment < len(status.pending) else 0


def _digest(digests: Sequence[str | None]) -> str | None:
    """One digest of the shards' digests (each covers its own weights and momentum)."""
    if any(d is None for d in digests):
        return None
    return hashlib.sha256(",".join(d or "" for d in digests).encode()).hexdigest()


def _checkpoint(refs: Sequence[CheckpointRef | None]) -> CheckpointRef | None:
    """The shards' newest checkpoints as one: the state root `diloco export` assembles the
    model from (STATE of STATE/shard-I/checkpoints/ckpt-N as `diloco run` keeps them, or the one
    path every shard sees its own state at, as a shard's pod does) at the least outer step; the
    least advanced shard's when the paths say neither; None while a shard has none."""
    if any(r is None for r in refs):
        return None
    known = [r for r in refs if r is not None]
    step = min(r.outer_step for r in known)
    dirs = [PurePosixPath(r.path).parent.parent for r in known]  # STATE/checkpoints/ckpt-N
    sharded = [d.name == f"{SHARD_DIR_PREFIX}{i}" for i, d in enumerate(dirs)]
    if all(sharded) and len({d.parent for d in dirs}) == 1:
        return CheckpointRef(path=str(dirs[0].parent), outer_step=step)
    if len(set(dirs)) == 1:
        return CheckpointRef(path=str(dirs[0]), outer_step=step)
    return min(known, key=lambda r: r.outer_step)


def merge_status(statuses: Sequence[SyncerStatus]) -> SyncerStatus:
    """The status documents of every shard (in shard order) read as one syncer's.

    Per fragment (versions, pending) from the shard that owns it; the outer step is the least
    of the shards' (each is the least-merged fragment it owns, so this is the job's least-merged
    fragment); merged tokens the mean over fragments (each shard's own mean weighed by its share
    of the fragments); counts that add up (merges, bytes, pulls, refusals) summed; the islands,
    quorum and evaluation of shard 0 (every shard holds the membership); finished when every
    shard is; the first failure of any shard; the shards' checkpoints as one (_checkpoint); a
    digest of the shards' digests."""
    if len(statuses) == 1:
        return statuses[0]
    shards = len(statuses)
    first = statuses[0]
    n = len(first.versions)
    checkpoints = [s.checkpoint for s in statuses]
    refusals: dict[str, dict[str, int]] = {}
    for s in statuses:
        for island, counts in s.refusals.items():
            refusals[island] = _summed([refusals.get(island, {}), counts])
    merges = sorted((m for s in statuses for m in s.merges), key=lambda m: m.time)
    times = [s.last_merge_time for s in statuses if s.last_merge_time is not None]
    return first.model_copy(
        update={
            "outer_step": min(s.outer_step for s in statuses),
            "versions": [statuses[shard_of(f, shards)].versions[f] for f in range(n)],
            "pending": [_pending(statuses[shard_of(f, shards)], f) for f in range(n)],
            "finished": all(s.finished for s in statuses),
            # each shard's tokens are averaged over its own fragments: weigh by their share
            "tokens": round(
                sum(s.tokens * len(fragments_of(i, shards, n)) for i, s in enumerate(statuses)) / n
            ),
            "merge_count": sum(s.merge_count for s in statuses),
            "bytes_in": sum(s.bytes_in for s in statuses),
            "bytes_out": sum(s.bytes_out for s in statuses),
            "pulls": _summed([s.pulls for s in statuses]),
            "refusals": refusals,
            "merges": merges,
            "last_merge_time": max(times) if times else None,
            "failure": next((s.failure for s in statuses if s.failure), None),
            "digest": _digest([s.digest for s in statuses]),
            "checkpoint": _checkpoint(checkpoints),
        }
    )
