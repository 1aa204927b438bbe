"""bench/RESULTS.md stays one page naming every product benchmark bench/README.md lists, and every
citation of a dated log entry (`bench/log/DAY.md, "HEADING..."`) names a section that exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _products() -> list[str]:
    readme = (BENCH / "README.md").read_text()
    block = readme.split("```sh", 1)[1].split("```", 1)[0]
    return re.findall(r"python -m bench\.(\w+)\b", block)


def test_results_is_one_page_with_a_section_per_product_benchmark() -> None:
    text = (BENCH / "RESULTS.md").read_text()
    assert len(text.splitlines()) <= 400
    headings = set(re.findall(r"^## (\S+)$", text, flags=re.M))
    products = _products()
    assert len(products) >= 10, products
    for name in products:
        assert (BENCH / f"{name}.py").is_file(), name
        assert name in headings, f"bench/RESULTS.md has no section '## {name}'"


def test_results_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", (BENCH / "RESULTS.md").read_text()):
        assert (BENCH / target).exists(), target


def test_citations_of_the_log_name_a_section_of_that_day() -> None:
    files = subprocess.run(
        ["git", "grep", "-l", "bench/log/20"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    cite = re.compile(r'bench/log/(\d{4}-\d{2}-\d{2})\.md`?,?\s*\(?"([^"]+)"?')
    found = 0
    for name in files:
        text = (ROOT / name).read_text()
        for day, quoted in cite.findall(text):
            log = BENCH / "log" / f"{day}.md"
            assert log.is_file(), f"{name}: {log} does not exist"
            key = re.sub(r"\s*#?\s+", " ", quoted).split("...")[0].strip().rstrip(",")
            heads = [h for h in log.read_text().splitlines() if h.startswith("## ")]
            assert any(key in h for h in heads), f"{name}: no section {key!r} in {day}.md"
            found += 1
    assert found
