"""bench/RESULTS.md stays one page naming every product benchmark bench/README.md lists; every
citation of a dated log entry (`bench/log/DAY.md, "HEADING..."`) names a section that exists, and
every citation of the one page names one of its sections (`bench/RESULTS.md, "NAME"`): none cites
it bare."""

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


# Where the one page may be cited, and must name its section: `bench/RESULTS.md, "NAME"`.
CITED_IN = ["trainer", "operator", "bench", "docs", "README.md", "ARCHITECTURE.md"]
RESULTS_CITE = re.compile(r'bench/RESULTS\.md`?,?\s*\(?"([^"]+)"')
# A mention that names the page as the place the figures are kept, not a figure on it: "figures
# in `bench/RESULTS.md`", "the one-page summary, bench/RESULTS.md, is updated by hand".
PAGE_ITSELF = re.compile(r"figures in `?$|by hand")


def _mentions_of_results() -> list[tuple[str, str, int]]:
    """(file, text, offset) of every `bench/RESULTS.md` in the files that may cite it (the log
    left out: its sections are verbatim records)."""
    files = subprocess.run(
        ["git", "grep", "-l", "bench/RESULTS.md", "--", *CITED_IN, ":!bench/log"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    found = []
    for name in files:
        text = (ROOT / name).read_text()
        found += [(name, text, m.start()) for m in re.finditer(r"bench/RESULTS\.md", text)]
    return found


def _is_bare_citation(text: str, at: int) -> bool:
    """Whether the mention at `at` cites the page without naming a section of it."""
    if RESULTS_CITE.match(text, at):
        return False
    line_start = text.rfind("\n", 0, at) + 1
    line_end = text.find("\n", at)
    before = text[line_start:at]
    after = text[at : line_end if line_end >= 0 else len(text)]
    return not (PAGE_ITSELF.search(before) or PAGE_ITSELF.search(after))


def test_citations_of_results_name_one_of_its_sections() -> None:
    headings = set(re.findall(r"^## (\S+)$", (BENCH / "RESULTS.md").read_text(), flags=re.M))
    named = 0
    for name, text, at in _mentions_of_results():
        cited = RESULTS_CITE.match(text, at)
        if cited:
            assert cited[1] in headings, f"{name}: bench/RESULTS.md has no section {cited[1]!r}"
            named += 1
    assert named


def test_no_citation_of_results_without_a_section() -> None:
    bare = []
    for name, text, at in _mentions_of_results():
        if _is_bare_citation(text, at):
            line = text.count("\n", 0, at) + 1
            bare.append(f"{name}:{line}")
    assert not bare, f'cite a section (bench/RESULTS.md, "NAME" or bench/log/DAY.md): {bare}'


def test_a_bare_citation_is_caught() -> None:
    cited = 'a figure (bench/RESULTS.md, "learner_quality"), the page (figures in bench/RESULTS.md)'
    assert not any(_is_bare_citation(cited, m.start()) for m in re.finditer("bench/RES", cited))
    for bare in ("as measured (bench/RESULTS.md).", "bench/RESULTS.md, decoupled_quality 14:10"):
        assert _is_bare_citation(bare, bare.index("bench/RESULTS.md")), bare


# A scratch folder or a checkout of the machine that ran a benchmark: the project speaks of
# itself only (bench/harness/common.portable_args writes RUN_DIR and repository paths instead).
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:tmp|work|home|root)/")


def test_logs_and_docs_name_no_path_of_the_machine_that_ran_them() -> None:
    pages = [*sorted((BENCH / "log").glob("*.md")), BENCH / "RESULTS.md", BENCH / "README.md"]
    pages += [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md", ROOT / "ARCHITECTURE.md"]
    found = [
        f"{page.relative_to(ROOT)}:{n}"
        for page in pages
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not found, found
