"""The documents stay navigable and the README's figures stay sourced.

- every relative link in README.md and docs/**/*.md points at a file that exists, and a link to a
  heading (``file.md#anchor``, ``#anchor``) at a heading that exists, slugged as GitHub does;
- every run page under docs/runs/ is listed in the runs index;
- "Where it stands" quotes only what docs/results.json holds: each row of the README's table is a
  row of the file, with its date, machine and run document, and every number it quotes is one the
  file's row holds; every number of the file's rows is in the run document it names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
RESULTS = json.loads((ROOT / "docs" / "results.json").read_text())["rows"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(path: Path) -> list[str]:
    links = LINK.findall(prose(path.read_text()))
    return [link for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file: lower case, punctuation other
    than hyphens and underscores dropped, spaces as hyphens, repeats numbered -1, -2, ...

    Example: "### The verifier pool: `python -m spade_bench.pool`" ->
    "the-verifier-pool-python--m-spade_benchpool"."""
    text = re.sub(r"^(```|~~~).*?^\1", "", path.read_text(), flags=re.S | re.M)
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return anchors


def anchored_links(path: Path) -> list[tuple[Path, str, str]]:
    """(target file, anchor, the link) for each link to a heading of a markdown file."""
    found = []
    for link in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z]+:", link) or "#" not in link:
            continue
        file, anchor = link.split("#", 1)
        target = path if not file else path.parent / file
        if target.suffix == ".md" and target.exists():
            found.append((target, anchor, link))
    return found


def numbers(text: str) -> set[str]:
    return set(NUMBER.findall(text))


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    missing = [link for link in relative_links(path) if not (path.parent / link.split("#")[0]).exists()]
    assert not missing, f"{path.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_link_to_a_heading_finds_it(path):
    broken = [link for target, anchor, link in anchored_links(path) if anchor not in heading_anchors(target)]
    assert not broken, f"{path.relative_to(ROOT)} links to headings that do not exist: {broken}"


def test_headings_get_githubs_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Design\n\n## Scaling out\n\n```\n# not a heading\n```\n\n### The pool: `python -m spade_bench.pool`\n\n## Scaling out\n"
    )
    assert heading_anchors(page) == {"design", "scaling-out", "the-pool-python--m-spade_benchpool", "scaling-out-1"}
    assert sum(len(anchored_links(path)) for path in DOCUMENTS) > 50  # the documents do link to headings


def test_the_runs_index_lists_every_run():
    index = ROOT / "docs" / "runs" / "README.md"
    listed = {(index.parent / link.split("#")[0]).resolve() for link in relative_links(index)}
    pages = {page.resolve() for page in index.parent.glob("*.md") if page != index}
    assert pages <= listed, sorted(page.name for page in pages - listed)


def where_it_stands() -> list[list[str]]:
    """The data rows of the README's "Where it stands" table, cell by cell."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Where it stands", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def test_where_it_stands_has_a_row_per_results_row():
    assert [row[0] for row in where_it_stands()] == [result["row"] for result in RESULTS]


@pytest.mark.parametrize("result", RESULTS, ids=lambda result: result["row"])
def test_the_readme_quotes_only_what_results_json_holds(result):
    (row,) = [row for row in where_it_stands() if row[0] == result["row"]]
    _, quoted, date, machine, link = row
    assert numbers(quoted) <= numbers(result["result"]), f"the README quotes numbers docs/results.json does not hold: {quoted}"
    assert (date, machine) == (result["date"], result["machine"])
    (target,) = LINK.findall(link)
    assert target.split("#")[0] == result["source"]


@pytest.mark.parametrize("result", RESULTS, ids=lambda result: result["row"])
def test_every_results_number_is_in_its_run_document(result):
    source = ROOT / result["source"]
    assert source.is_file(), result["source"]
    assert result["command"].strip()
    missing = numbers(result["result"]) - numbers(source.read_text())
    assert not missing, f"{result['source']} does not hold {sorted(missing)}"
