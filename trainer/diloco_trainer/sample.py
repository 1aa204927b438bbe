"""`diloco sample`: text from a trained built-in model (model.preset), for a person to read.

Sources (what `diloco run` and `diloco export` leave):
- a run folder of `diloco run` (runs/NAME/: spec.json and syncer/), a syncer state dir, its
  checkpoints/ dir or one ckpt-* dir: the exact global weights of the newest checkpoint, the job
  from the spec.json beside them;
- an export file (MODEL.safetensors, `diloco export`), or a folder holding exactly one: the job
  from the file's metadata (`spec`, which `diloco export` records from the run's spec.json or
  --config).

The tokenizer is the job's: bytes (the default) need nothing; a subword tokenizer is read from
MODEL.tokenizer.json beside an export file (`diloco export --config`), else from
data.tokenizer.path (type file), else trained again on the corpus (type bpe; data.source must be
readable here, as for `diloco export --config`).

Sampling is autoregressive: each next token is drawn from softmax(logits / temperature) over the
top-k logits (temperature 0: the most likely token, greedy), the context cropped to the model's
inner.seqLen. The draws use a torch.Generator seeded with --seed, so a seed gives the same text.

Memory: one copy of the model (fp32, on the CPU unless --device says otherwise); the weights read
from a checkpoint are loaded into it and dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import Tensor, nn

from diloco_trainer.api.spec import ConfigError, JobSpec, load_spec, parse_spec
from diloco_trainer.export import ExportError, find_spec, from_checkpoint, run_folder_state_dir
from diloco_trainer.models.model import GPT, build_model
from diloco_trainer.models.sources import DOC_SEPARATOR
from diloco_trainer.models.tokenizer import (
    ByteTokenizer,
    SubwordTokenizer,
    load_tokenizer_file,
)

EXPORT_SUFFIX = ".safetensors"
TOKENIZER_SUFFIX = ".tokenizer.json"  # what `diloco export --config` writes beside MODEL


class SampleError(ValueError):
    """The source cannot be sampled (missing weights, a user model, a lost tokenizer); the
    message names what and how to fix it. Exit 2: the input is the problem."""


@dataclass
class SampleSource:
    """What sampling needs: the weights, the job they belong to, and where they came from."""

    weights: dict[str, Tensor]
    spec: JobSpec
    source: str  # the file or checkpoint read, for the header line
    tokenizer_file: Path | None  # MODEL.tokenizer.json beside an export file, when there


def _export_file(path: Path) -> Path | None:
    """The export file `path` names: itself, or the one *.safetensors in a folder."""
    if path.is_file():
        return path
    found = sorted(path.glob(f"*{EXPORT_SUFFIX}")) if path.is_dir() else []
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise SampleError(f"{path} holds several export files ({names}); name one")
    return found[0] if found else None


def _from_export(file: Path) -> SampleSource:
    try:
        with safetensors.safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
        weights = safetensors.torch.load_file(str(file))
    except Exception as err:  # safetensors raises its own types for a file that is not one
        raise SampleError(f"{file} is not a safetensors file: {err}") from None
    if "spec" not in meta:
        raise SampleError(
            f"{file} does not record its job (no 'spec' in its metadata): export it again from "
            "the run folder (diloco export runs/NAME -o FILE), or with --config JOB"
        )
    try:
        spec = parse_spec(json.loads(meta["spec"]))
    except (json.JSONDecodeError, TypeError) as err:
        raise SampleError(f"{file}: its metadata's spec is not JSON: {err}") from None
    name = file.name.removesuffix(EXPORT_SUFFIX)
    tokenizer = file.with_name(f"{name}{TOKENIZER_SUFFIX}")
    return SampleSource(weights, spec, str(file), tokenizer if tokenizer.is_file() else None)


def _from_checkpoints(path: Path) -> SampleSource:
    state_dir = run_folder_state_dir(path)
    try:
        weights, meta = from_checkpoint(state_dir)
    except ExportError as err:
        raise SampleError(
            f"{path} holds no weights: {err}. Train first (diloco run), or name an export file"
        ) from None
    spec_file = find_spec(state_dir)
    if spec_file is None:
        raise SampleError(
            f"{path}: no spec.json beside the checkpoint, so the model's shape and tokenizer "
            "are unknown; sample its run folder (runs/NAME) or an export of it"
        )
    return SampleSource(weights, load_spec(spec_file), meta["source"], None)


def load_source(source: Path) -> SampleSource:
    """The weights and job of a run folder, a checkpoint, or an export file/folder."""
    if not source.exists():
        raise SampleError(f"{source} does not exist")
    export = _export_file(source)
    if export is not None:
        return _from_export(export)
    return _from_checkpoints(source)


def codec_for(loaded: SampleSource) -> ByteTokenizer | SubwordTokenizer:
    """The job's tokenizer (module docstring: where a subword one is found)."""
    tok = loaded.spec.data.tokenizer
    if tok.type == "bytes":
        return ByteTokenizer()
    if loaded.tokenizer_file is not None:
        return load_tokenizer_file(str(loaded.tokenizer_file))
    if tok.type == "file":
        assert tok.path is not None  # the spec validates this
        if not Path(tok.path).is_file():
            raise SampleError(
                f"data.tokenizer.path: {tok.path} is not readable here; export with --config "
                "JOB to write MODEL.tokenizer.json beside the weights"
            )
        return load_tokenizer_file(tok.path)
    # A BPE trained on the corpus: trained again on it, exactly as the job's processes did.
    from diloco_trainer.models.data import corpus_for

    try:
        trained = corpus_for(loaded.spec.data).tokenizer
    except ConfigError as err:
        raise SampleError(
            f"data.tokenizer (bpe) is trained on data.source, which cannot be read here ({err}); "
            "export with --config JOB where it can, to write MODEL.tokenizer.json"
        ) from None
    assert isinstance(trained, SubwordTokenizer)
    return trained


def build_sampler_model(loaded: SampleSource, device: str = "cpu") -> GPT:
    """The built-in GPT of the job with the weights loaded (its shape read from them)."""
    spec = loaded.spec
    if spec.model.entrypoint:
        raise SampleError(
            f"model.entrypoint {spec.model.entrypoint!r}: diloco sample generates only from the "
            "built-in GPT (model.preset); load these weights into your own model with "
            "safetensors.torch.load_file and sample with your code"
        )
    emb = loaded.weights.get("tok_emb.weight")
    pos = loaded.weights.get("pos_emb.weight")
    if emb is None or pos is None:
        raise SampleError(
            f"{loaded.source}: no tok_emb/pos_emb weights, so not the built-in GPT of "
            f"model.preset {spec.model.preset!r}"
        )
    # The shape from the weights: a tokenizer's vocabulary is the embedding's rows.
    model = build_model(spec.model.preset, pos.shape[0], emb.shape[0])
    try:
        model.load_state_dict(loaded.weights)
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        raise SampleError(
            f"{loaded.source}: the weights do not fit model.preset {spec.model.preset!r}: {first}"
        ) from None
    try:
        return model.to(device).eval()
    except RuntimeError as err:  # an unknown or absent device
        raise SampleError(f"--device {device}: {err}") from None


def token_probs(logits: Tensor, temperature: float, top_k: int) -> Tensor:
    """The distribution of the next token from the last position's logits (V,) at a temperature
    > 0: softmax(logits / temperature) over the top_k largest logits (0 or >= V: all of them;
    logits tied with the k-th stay in)."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def next_token(logits: Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One draw from token_probs; at temperature 0 the most likely token (greedy)."""
    if temperature == 0:
        return int(torch.argmax(logits).item())
    probs = token_probs(logits, temperature, top_k)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    tokens: int,
    *,
    block_size: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> list[int]:
    """`tokens` new token ids after `prompt` (which must not be empty)."""
    if not prompt:
        raise SampleError("--prompt encodes to no tokens")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(tokens):
        context = torch.tensor([ids[-block_size:]], dtype=torch.long, device=device)
        logits = model(context)[0, -1]
        ids.append(next_token(logits, temperature, top_k, generator))
    return ids[len(prompt) :]


def main(args: argparse.Namespace) -> int:
    """`diloco sample SOURCE`: exit 0 with the text on stdout, 2 when the source or a flag
    cannot be used (the message says which)."""
    try:
        if args.tokens < 1:
            raise SampleError(f"--tokens must be >= 1, got {args.tokens}")
        if args.temperature < 0:
            raise SampleError(f"--temperature must be >= 0, got {args.temperature}")
        if args.top_k < 0:
            raise SampleError(f"--top-k must be >= 0 (0: all tokens), got {args.top_k}")
        loaded = load_source(Path(args.source))
        model = build_sampler_model(loaded, args.device)
        codec = codec_for(loaded)
        # Default prompt: the start of a document (the separator the corpus puts between them).
        prompt_text = args.prompt if args.prompt is not None else DOC_SEPARATOR.decode()
        prompt = codec.encode_text(prompt_text)
        new = generate(
            model,
            prompt,
            args.tokens,
            block_size=model.config.block_size,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
    except (SampleError, ConfigError) as err:
        print(f"diloco sample: {err}", file=sys.stderr)
        return 2
    spec = loaded.spec
    print(
        f"# {spec.model.preset} from {loaded.source}; tokens: {spec.data.tokenizer.type}; "
        f"temperature {args.temperature}, top-k {args.top_k}, seed {args.seed}",
        file=sys.stderr,
    )
    text = (args.prompt or "") + codec.decode(new)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0
