"""`diloco export`: the global weights as one safetensors file, loadable with plain torch.

From a checkpoint (the syncer's state dir, its checkpoints/ dir or one ckpt-* dir): the exact
global weights θ the syncer evaluates and checkpoints. The directory is only read: a syncer may
still be writing into it (unfinished checkpoints are hidden temporary directories, never chosen).

From a running syncer (an http(s) URL and its bearer token): every fragment pulled in full, as
learners receive them. With sync.pullCompression none these are θ; with a pull codec they are the
weights learners hold (θ_pub), within the codec's rounding of θ. Fragments merge independently, so
the pull is repeated until the versions read match the syncer's status afterwards: the file is one
consistent snapshot.

With syncer.shards (docs/shards.md): from a sharded run's state dir (shard-0/, shard-1/, ...
beside each other, as `diloco run` keeps them), each fragment is taken from the newest checkpoint
of the shard that owns it; from running shards (their URLs comma-separated, in shard order), each
fragment is pulled from its shard and the versions checked against every shard's status.

The file holds the model's parameters by name (`model.named_parameters()`), fp32 unless --dtype
says otherwise, and metadata (job, outer step, versions, eval loss) that `safetensors` keeps:
`model.load_state_dict(safetensors.torch.load_file(path))` restores a model built as the job
built it. With --config JOB, a job with a subword tokenizer (data.tokenizer) also gets its
tokenizer.json written beside the weights.

A run folder of `diloco run` (runs/NAME/: spec.json and syncer/) is a source too. The metadata
then also holds what loading the weights needs (job_metadata: the preset or entrypoint,
inner.seqLen, the tokenizer, the whole spec), from the run's spec.json (or --config).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch

from diloco_trainer.api.contract import TOKEN_FILE, ContractError, read_token
from diloco_trainer.api.manifest import CheckpointManifest
from diloco_trainer.api.protocol import SyncerError
from diloco_trainer.api.sharding import fragments_of, shard_dirs, shard_of
from diloco_trainer.api.spec import ConfigError, load_spec
from diloco_trainer.syncer.storage import (
    CHECKPOINTS_DIR,
    MANIFEST_FILE,
    list_checkpoints,
    load_checkpoint,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SNAPSHOT_TRIES = 5  # pulls of every fragment until one matches the status read after it


class ExportError(RuntimeError):
    """Nothing to export from the given source; the message says why."""


def find_checkpoint(path: Path) -> Path:
    """The checkpoint directory `path` names: itself (a ckpt-* dir), or the newest complete one
    under a state dir or its checkpoints/ dir."""
    if (path / MANIFEST_FILE).is_file():
        return path
    state_dir = path.parent if path.name == CHECKPOINTS_DIR else path
    found = list_checkpoints(state_dir)
    if not found:
        raise ExportError(
            f"{path} holds no checkpoint (expected a ckpt-* directory with {MANIFEST_FILE}, or a "
            f"syncer state dir with {CHECKPOINTS_DIR}/)"
        )
    return found[-1]


def _eval_loss_at(manifest: CheckpointManifest, outer_step: int) -> float | None:
    for entry in reversed(manifest.eval_history):
        if entry.outer_step == outer_step and entry.eval_loss is not None:
            return entry.eval_loss
    return None


def _shard_dirs(path: Path) -> list[Path]:
    try:
        return shard_dirs(path) if path.is_dir() else []
    except ValueError as err:
        raise ExportError(str(err)) from None


def from_shard_checkpoints(state_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The exact global weights of a sharded syncer: each fragment from the newest checkpoint
    of the shard that owns it (api/sharding.py), and metadata describing them."""
    dirs = _shard_dirs(state_dir)
    weights: dict[str, torch.Tensor] = {}
    versions: dict[int, int] = {}
    steps, sources, job = [], [], ""
    for shard, shard_dir in enumerate(dirs):
        ckpt_dir = find_checkpoint(shard_dir)
        try:
            ckpt = load_checkpoint(ckpt_dir)
        except ValueError as err:
            raise ExportError(str(err)) from None
        fragments = ckpt.document.fragments
        if fragments is None:
            raise ExportError(f"{ckpt_dir}: its manifest does not list the fragments' names")
        for f in fragments_of(shard, len(dirs), len(fragments)):
            weights.update({name: ckpt.weights[name] for name in fragments[f]})
            versions[f] = ckpt.document.versions[f]
        steps.append(ckpt.outer_step)
        sources.append(str(ckpt_dir.resolve()))
        job = ckpt.document.job_name
    meta = {
        "source": ",".join(sources),
        "weights": "exact",
        "outerStep": str(min(steps)),  # the least-merged fragment's, as the job's status says
        "versions": json.dumps([versions[f] for f in sorted(versions)]),
        "job": job,
        "shards": str(len(dirs)),
    }
    return weights, meta


def from_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The exact global weights of a checkpoint and metadata describing them (of every shard's
    newest checkpoint when `path` is a sharded syncer's state dir)."""
    if _shard_dirs(path):
        return from_shard_checkpoints(path)
    ckpt_dir = find_checkpoint(path)
    try:
        ckpt = load_checkpoint(ckpt_dir)
    except ValueError as err:
        raise ExportError(str(err)) from None
    meta = {
        "source": str(ckpt_dir.resolve()),
        "weights": "exact",
        "outerStep": str(ckpt.outer_step),
        "versions": json.dumps(ckpt.document.versions),
        "job": ckpt.document.job_name,
    }
    loss = _eval_loss_at(ckpt.document, ckpt.outer_step)
    if loss is not None:
        meta["evalLoss"] = repr(loss)
    return dict(ckpt.weights), meta  # read from the file once


async def pull_snapshot(
    url: str, token: str, ca_file: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every fragment of a running syncer's global weights, one consistent version set."""
    # Imported here: the learner's client is only needed for this source.
    from diloco_trainer.core.payloads import PulledFragment
    from diloco_trainer.learner.syncer_client import SyncerClient

    async with SyncerClient(url, token, ca_file, retry_deadline=30.0) as client:
        # Several URLs: syncer shards; each fragment is pulled from its own, and the status
        # reads every shard (api/client.py).
        shards = client.shard_clients()
        for _ in range(SNAPSHOT_TRIES):
            status = await client.status()
            weights: dict[str, torch.Tensor] = {}
            versions: list[int] = []
            for f in range(status.fragments):
                pulled = await shards[shard_of(f, len(shards))].pull_fragment(f)
                assert isinstance(pulled, PulledFragment)  # no `have`: always the full weights
                weights.update(pulled.tensors)
                versions.append(pulled.version)
            after = await client.status()
            if after.versions == versions:
                meta = {
                    "source": url,
                    "weights": "exact" if after.pull_compression == "none" else "published",
                    "outerStep": str(after.outer_step),
                    "versions": json.dumps(versions),
                    "job": after.job_name,
                }
                return weights, meta
    raise ExportError(
        f"the syncer at {url} merged during each of {SNAPSHOT_TRIES} pulls; try again"
    )


def write_weights(
    weights: Mapping[str, torch.Tensor],
    out: Path,
    metadata: Mapping[str, str],
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write the weights (floating ones cast to dtype) as one safetensors file, atomically."""
    tensors = {
        name: (t.to(dtype) if t.is_floating_point() else t).detach().contiguous().clone()
        for name, t in sorted(weights.items())
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    safetensors.torch.save_file(tensors, str(tmp), metadata={"format": "pt", **metadata})
    tmp.replace(out)


def final_weights_note(state_dir: Path) -> str | None:
    """Where a finished local run's weights are and how to extract them (None: no checkpoint)."""
    if _shard_dirs(state_dir):
        return (
            f"final weights: the syncer shards' checkpoints under {state_dir}; extract them "
            f"with\n  diloco export {state_dir} -o model.safetensors"
        )
    found = list_checkpoints(state_dir)
    if not found:
        return None
    latest = found[-1]
    return (
        f"final weights: {latest} (syncer checkpoint); extract them with\n"
        f"  diloco export {latest} -o model.safetensors"
    )


def write_tokenizer(config: Path, out: Path) -> Path | None:
    """The subword tokenizer of the job in `config` as tokenizer.json beside `out` (the model
    is useless without it); None when the job's tokens are bytes or its model is its own.

    A trained BPE (data.tokenizer.type bpe) is trained again here, on the same corpus, exactly
    as every process of the job trained it: data.source must be readable here too."""
    from diloco_trainer.models.data import corpus_for
    from diloco_trainer.models.tokenizer import SubwordTokenizer, load_tokenizer_file

    spec = load_spec(config)
    kind = spec.data.tokenizer.type
    if spec.model.entrypoint or kind == "bytes":
        return None
    if kind == "file":
        assert spec.data.tokenizer.path is not None  # the spec validates this
        tok = load_tokenizer_file(spec.data.tokenizer.path)
    else:
        trained = corpus_for(spec.data).tokenizer
        assert isinstance(trained, SubwordTokenizer)
        tok = trained
    path = out.with_name(f"{out.name.removesuffix('.safetensors')}.tokenizer.json")
    tok.save(path)
    return path


# A run folder of `diloco run` (runs/NAME/): the syncer's state dir and the job's spec in it.
RUN_SYNCER_DIR = "syncer"
RUN_SPEC_FILE = "spec.json"


def run_folder_state_dir(path: Path) -> Path:
    """The syncer state dir `path` names: a run folder's syncer/ (runs/NAME/), else itself."""
    inner = path / RUN_SYNCER_DIR
    if (path / RUN_SPEC_FILE).is_file() and inner.is_dir():
        return inner
    return path


def find_spec(path: Path) -> Path | None:
    """The job's spec.json beside a checkpoint: in the run folder above a ckpt-* dir, its
    checkpoints/ dir, the state dir or the run folder itself (None when there is none)."""
    for folder in (path, *list(path.resolve().parents)[:3]):
        candidate = folder / RUN_SPEC_FILE
        if candidate.is_file():
            return candidate
    return None


def job_metadata(config: Path) -> dict[str, str]:
    """What loading the weights needs, from the job's spec: the model (preset or entrypoint),
    inner.seqLen (the position table's size), the tokenizer, and the whole spec as JSON."""
    spec = load_spec(config)
    meta = {
        "seqLen": str(spec.inner.seq_len),
        "tokenizer": spec.data.tokenizer.type,
        "spec": spec.to_json(),
    }
    if spec.model.entrypoint:
        meta["entrypoint"] = spec.model.entrypoint
    else:
        meta["preset"] = spec.model.preset
    if spec.data.tokenizer.type != "bytes":
        meta["tokenizerFile"] = "MODEL.tokenizer.json (diloco export --config JOB)"
    return meta


def _token(args: argparse.Namespace) -> str:
    path = args.token_file or os.environ.get(TOKEN_FILE)
    if not path:
        raise ExportError(
            f"a syncer URL needs its bearer token: --token-file FILE or ${TOKEN_FILE}"
        )
    try:
        return read_token(Path(path))
    except ContractError as err:
        raise ExportError(str(err)) from None


def main(args: argparse.Namespace) -> int:
    """`diloco export SOURCE -o FILE`: exit 0, 1 when nothing could be exported, 2 on bad input."""
    source: str = args.source
    out = Path(args.output)
    try:
        if source.startswith(("http://", "https://")):
            weights, meta = asyncio.run(pull_snapshot(source, _token(args), args.ca_file))
        else:
            if not Path(source).exists():
                print(f"diloco export: {source} does not exist", file=sys.stderr)
                return 2
            state_dir = run_folder_state_dir(Path(source))
            weights, meta = from_checkpoint(state_dir)
            spec_file = Path(args.config) if args.config else find_spec(state_dir)
            if spec_file is not None:
                meta.update(job_metadata(spec_file))
        if source.startswith(("http://", "https://")) and args.config:
            meta.update(job_metadata(Path(args.config)))
        write_weights(weights, out, meta, DTYPES[args.dtype])
        tokenizer = write_tokenizer(Path(args.config), out) if args.config else None
    except ConfigError as err:
        print(f"diloco export: {err}", file=sys.stderr)
        return 2
    except (ExportError, SyncerError) as err:
        print(f"diloco export: {err}", file=sys.stderr)
        return 1
    count = sum(t.numel() for t in weights.values())
    print(
        f"wrote {out}: {len(weights)} tensors, {count:,} parameters ({args.dtype}), "
        f"outer step {meta['outerStep']} from {meta['source']}"
    )
    if "preset" in meta:
        print(
            f"model: {meta['preset']}, inner.seqLen {meta['seqLen']}, tokens: {meta['tokenizer']}"
        )
    if tokenizer is not None:
        print(f"wrote {tokenizer}: the job's tokenizer (tokenizers.Tokenizer.from_file)")
    return 0
