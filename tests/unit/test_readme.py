"""The README a newcomer reads: links resolve, commands name the example's job, the layout
matches the tree, and the model sizes agree between README, spec and code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from diloco_trainer.api.spec import ModelSpec
from diloco_trainer.models.model import PRESETS, build_model, count_parameters

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples/multi-region/README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name}: {target} points outside the repository"
        assert path.exists(), f"{doc.name}: {target} does not exist"


def test_kubernetes_commands_name_the_job_the_example_creates() -> None:
    # The cluster path's example (README, "Run on Kubernetes").
    example = yaml.safe_load((ROOT / "examples/gpt-on-my-text/job.yaml").read_text())
    name = example["metadata"]["name"]
    text = README.read_text()
    named = re.findall(r"kubectl (?:describe|get|scale|delete) dj (\S+)", text)
    named += re.findall(r"deploy/(\S+)-syncer", text)
    named += re.findall(r"diloco\.dev/job=([\w-]+)", text)
    named += re.findall(r"diloco export --job ([\w-]+)", text)
    # NAME is a placeholder in prose; every concrete name is the example's.
    assert named and set(named) - {"NAME"} == {name}, named
    # The path replaces the example's placeholder registry with the user's.
    assert "diloco submit examples/gpt-on-my-text/job.yaml --registry $REGISTRY" in text
    registry = example["spec"]["image"].rsplit("/", 1)[0]
    assert registry == "ghcr.io/diloco-operator" and f"`{registry}`" in text


def test_layout_names_what_is_in_the_tree() -> None:
    layout = _section(README.read_text(), "Layout")
    rows = {row.split("|")[1].strip(" `"): row for row in layout.splitlines() if row.count("|") > 2}
    for base in ("trainer/diloco_trainer/", "operator/diloco_operator/"):
        pkg = ROOT / base
        names = re.findall(r"`([\w/.-]+(?:/|\.py))`", rows[base].split("|", 2)[2])
        assert names, base
        for item in names:
            found = (pkg / item).exists() or any(pkg.rglob(item.rstrip("/")))
            assert found, f"Layout names {base}{item}, which is not in the tree"
    for room in ("api", "core", "models", "learner", "syncer", "local"):
        assert f"`{room}/`" in rows["trainer/diloco_trainer/"], room
    assert "localcluster/" in rows["hack/"] and (ROOT / "hack/localcluster").is_dir()


def test_quorum_limit_reads_the_same_everywhere() -> None:
    table_row = next(r for r in README.read_text().splitlines() if r.startswith("| `sync.quorum`"))
    assert "islands.count" in table_row and "islands.totalShards" in table_row
    region = (ROOT / "examples/multi-region/README.md").read_text()
    assert "caps it at region A's own" not in region
    assert "up to `islands.totalShards`" in region


def test_model_sizes_agree_between_readme_spec_and_code() -> None:
    description = ModelSpec.model_fields["preset"].description or ""
    in_spec = dict(re.findall(r"(gpt-[\w]+) \(~([\d.]+)M", description))
    in_readme = dict(re.findall(r"`(gpt-[\w]+)` ~([\d.]+)M", README.read_text()))
    assert set(in_spec) == set(in_readme) == set(PRESETS)
    assert in_spec == in_readme
    for preset, millions in in_spec.items():
        with torch.device("meta"):  # shapes only: gpt-1b would allocate 4 GB
            actual = count_parameters(build_model(preset, 64)) / 1e6
        assert abs(actual - float(millions)) <= 0.1 * actual, (preset, actual, millions)
