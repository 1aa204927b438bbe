"""Reading a job file as `diloco run` and `diloco check` do: a DiLoCoJob manifest, or its bare
spec, with every refusal naming the file and the field.

api/spec.load_spec is what the pods use (the operator has checked the manifest by then); a person
at a terminal gets more here: the file and line of a YAML error, "not a DiLoCoJob" for another
kind, an empty file refused rather than run with defaults that never stop, the quorum compared
with the fields the user set, and a relative data path taken from the config file's folder (the
learners run in another directory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from diloco_trainer.api.spec import ConfigError, JobSpec, parse_spec

# The operator's API version (diloco_operator/api.py; the trainer imports nothing of it).
API_VERSION = "diloco.dev/v1alpha1"
KIND = "DiLoCoJob"
MANIFEST_HINT = f"apiVersion: {API_VERSION}, kind: {KIND}, metadata.name and spec"
_DEFAULTS = JobSpec()  # the values of the fields a user leaves out
# metadata.name as the CRD's rule has it (operator/diloco_operator/crd.py, _ROOT_RULES): it names
# Services and StatefulSets, NAME[-PREFIX]-island-I within 52 characters (I < 512).
NAME_PATTERN = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 52 - len("-island-511")


@dataclass(frozen=True)
class JobFile:
    """A job read from a file: its name, its spec (paths resolved) and where it came from."""

    name: str
    spec: JobSpec
    path: Path | None  # None for the built-in demo job


def read_yaml(path: Path) -> Any:
    """The YAML document in `path`; ConfigError naming the file (and line) when it cannot be."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a YAML DiLoCoJob manifest expected)") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None


def spec_document(path: Path, doc: Any) -> tuple[str, dict[str, Any]]:
    """(job name, spec mapping) of a manifest or bare spec; ConfigError for anything else."""
    if doc is None:
        raise ConfigError(f"{path}: the file is empty; a DiLoCoJob manifest needs {MANIFEST_HINT}")
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{path}: expected a DiLoCoJob manifest (a mapping), got a {type(doc).__name__}"
        )
    kind = doc.get("kind")
    if kind is None and not ({"apiVersion", "metadata", "spec"} & doc.keys()):
        return bare_spec_name(path), doc  # a bare spec
    if kind != KIND:
        got = repr(kind) if kind is not None else "missing"
        raise ConfigError(f"{path}: kind: {got} is not a {KIND} (expected {MANIFEST_HINT})")
    if doc.get("apiVersion") != API_VERSION:
        raise ConfigError(
            f"{path}: apiVersion: {doc.get('apiVersion')!r} is not {API_VERSION!r} for a {KIND}"
        )
    spec = doc.get("spec")
    if spec is None:
        raise ConfigError(f"{path}: spec: missing; a {KIND} needs a spec")
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: spec: expected a mapping, got a {type(spec).__name__}")
    metadata = doc.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if name is None or name == "":
        raise ConfigError(
            f"{path}: metadata.name: missing; a {KIND} needs a name (lowercase letters, digits "
            "and '-', starting with a letter), e.g. metadata: {name: my-job}"
        )
    problem = name_problem(name, spec)
    if problem is not None:
        raise ConfigError(f"{path}: {problem}")
    return str(name), spec


def name_problem(name: object, spec: dict[str, Any]) -> str | None:
    """metadata.name against the rules the cluster applies to it (the CRD's), None when fine."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        return (
            f"metadata.name: {name!r} is not a valid name: use lowercase letters, digits and "
            "'-', starting with a letter and ending with a letter or digit (it names the "
            "job's Services and pods; e.g. 'my-job')"
        )
    prefix = _section(spec, "islands").get("namePrefix") or ""
    size = len(name) + (len(prefix) + 1 if isinstance(prefix, str) and prefix else 0)
    if size > MAX_NAME:
        return (
            f"metadata.name: {name!r} is too long: metadata.name plus islands.namePrefix may "
            f"have {MAX_NAME} characters (pods are named NAME[-PREFIX]-island-I)"
        )
    return None


def bare_spec_name(path: Path) -> str:
    """A bare spec's job name: its file's stem made a valid name ('My_Job.yaml' -> 'my-job');
    'job' when nothing of it is left."""
    name = re.sub(r"[^a-z0-9-]+", "-", path.stem.lower())
    name = re.sub(r"^[^a-z]+", "", name).rstrip("-")[:MAX_NAME].rstrip("-")
    return name or "job"


def _section(spec: dict[str, Any], key: str) -> dict[str, Any]:
    value = spec.get(key)
    return value if isinstance(value, dict) else {}


def quorum_problem(spec: dict[str, Any]) -> str | None:
    """sync.quorum against islands.count as the user wrote them (None when fine, or when the
    model's own check applies: a multi-region job's totalShards, another field's type).

    The model's message names islands.totalShards too, which a single-cluster job never sets."""
    islands, sync, syncer = (
        _section(spec, "islands"),
        _section(spec, "sync"),
        _section(spec, "syncer"),
    )
    if islands.get("totalShards") or syncer.get("endpoint"):
        return None
    quorum = sync.get("quorum", _DEFAULTS.sync.quorum)
    count = islands.get("count", _DEFAULTS.islands.count)
    if isinstance(quorum, int) and isinstance(count, int) and quorum > count >= 1:
        return (
            f"sync.quorum ({quorum}) must be <= islands.count ({count}): a merge waits for "
            f"{quorum} islands' pushes and the job has {count}"
        )
    return None


def resolve_paths(spec: JobSpec, folder: Path) -> JobSpec:
    """data.source and data.tokenizer.path relative to `folder` (the config file's), so a job
    runs the same from any directory; built-in sources and absolute paths are kept."""
    data = spec.data
    if not data.source.startswith("builtin:") and not Path(data.source).is_absolute():
        data.source = str((folder / data.source).resolve())
    path = data.tokenizer.path
    if path is not None and not Path(path).is_absolute():
        data.tokenizer.path = str((folder / path).resolve())
    return spec


def model_problem(spec: dict[str, Any]) -> str | None:
    """model.preset and model.entrypoint both set: the preset would be ignored."""
    model = _section(spec, "model")
    if model.get("entrypoint") and model.get("preset") is not None:
        return (
            f"model.preset ({model['preset']}) and model.entrypoint ({model['entrypoint']}) are "
            "both set: the entrypoint builds the model and the preset would be ignored; remove "
            "one of them"
        )
    return None


def load_job_file(config: str | Path) -> JobFile:
    """The job in `config`, checked as a document (not yet its data or model)."""
    path = Path(config)
    name, raw = spec_document(path, read_yaml(path))
    problem = quorum_problem(raw) or model_problem(raw)
    if problem is not None:
        raise ConfigError(f"{path}: {problem}")
    try:
        spec = parse_spec(raw)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    return JobFile(name=name, spec=resolve_paths(spec, path.resolve().parent), path=path)
