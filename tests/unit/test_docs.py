"""The README is a front door and the docs say what the code does: the README's size, every
relative link in README.md and docs/, the README's layout block against the tree, and every error
message docs/troubleshooting.md quotes against the source."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
TROUBLESHOOTING = DOCS / "troubleshooting.md"
MAX_README_BYTES = 12_500
SOURCE_ROOMS = ("splitstage", "splitter", "pipelines", "tasks", "flows")
# Every top-level room the README's layout block must name.
ROOMS = (
    "splitter/",
    "splitstage/config/",
    "splitstage/storage/",
    "splitstage/data/",
    "pipelines/",
    "tasks/",
    "flows/",
    "deployments/",
    "infra/",
    "tests/",
    "bench/",
    "docs/",
)
MIN_QUOTED_ROWS = 20

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
NAMED = re.compile(r"^[\w.-]+(/|\.py|\.sh|\.yaml|\.c)$")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Link targets that are paths in this repository (no URL, no in-page anchor)."""
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def layout_block(text: str) -> list[str]:
    """The lines of the README's fenced block that lists the rooms (its first line: splitter/)."""
    for block in FENCE.findall(text):
        lines = block.splitlines()
        if lines and lines[0].startswith("splitter/"):
            return lines
    raise AssertionError("README.md has no fenced layout block starting with 'splitter/'")


def layout_names(lines: list[str]) -> dict[str, list[str]]:
    """Each unindented line's room (its first word) -> the files and folders the line names
    within that room (words such as `files.py` or `k8s/`, stripped of punctuation)."""
    named: dict[str, list[str]] = {}
    for line in lines:
        if not line.strip() or line[0].isspace():
            continue
        room, *words = line.split()
        inside = [w.strip("(),;:`") for w in words]
        named[room] = [w for w in inside if NAMED.match(w)]
    return named


def quoted_rows(text: str) -> list[tuple[str, list[str]]]:
    """Table rows whose first cell quotes message fragments in backticks: (row, fragments)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        first = line[1:].split(" | ", 1)[0]
        rows.append((line, [f.strip() for f in re.findall(r"`([^`]+)`", first)]))
    return rows


@cache
def source_strings() -> tuple[str, ...]:
    """Every source file's text plus its string literals (implicit concatenation joined; the
    literal parts of f-strings), so a message split over lines is found whole."""
    found: list[str] = []
    for room in SOURCE_ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            found.append(text)
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.append(node.value)
    return tuple(found)


def in_source(fragment: str) -> bool:
    return any(fragment in text for text in source_strings())


def test_readme_is_a_front_door():
    size = README.stat().st_size
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes (limit {MAX_README_BYTES})"


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(page: Path):
    broken = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t).resolve() for t in relative_links(README.read_text())}
    pages = {p.resolve() for p in DOCS.rglob("*.md")}
    assert not pages - linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_layout_block_matches_the_tree():
    named = layout_names(layout_block(README.read_text()))
    missing = [room for room in ROOMS if room not in named]
    assert not missing, f"rooms the README's layout block does not list: {missing}"
    absent = [room for room in named if not (ROOT / room).exists()]
    absent += [f"{room}{name}" for room, names in named.items() for name in names]
    absent = [p for p in absent if not (ROOT / p).exists()]
    assert not absent, f"the README's layout block names what the tree lacks: {absent}"


def test_troubleshooting_messages_are_in_the_code():
    rows = quoted_rows(TROUBLESHOOTING.read_text())
    assert len(rows) >= MIN_QUOTED_ROWS, f"only {len(rows)} rows quote a message"
    stale = [(frag, row[:80]) for row, frags in rows for frag in frags if not in_source(frag)]
    assert not stale, f"quoted messages no longer in the source: {stale}"


# The checkers themselves: each must be able to fail.


def test_link_checker_sees_broken_and_skips_urls():
    text = "[a](docs/nope.md) [b](https://example.com/x.md) [c](#anchor) [d](README.md#top)"
    assert relative_links(text) == ["docs/nope.md", "README.md"]
    assert not (ROOT / "docs/nope.md").exists()


def test_layout_parser_names_rooms_and_their_files():
    lines = ["pipelines/   seam (family.py, nope.py); demo/ ghost/", "   indented (skip.py)"]
    named = layout_names(lines)
    assert named == {"pipelines/": ["family.py", "nope.py", "demo/", "ghost/"]}
    assert not (ROOT / "pipelines/ghost").exists() and not (ROOT / "pipelines/nope.py").exists()


def test_message_checker_finds_joined_literals_and_rejects_others():
    rows = quoted_rows("| `no metadata.csv or metadata.jsonl` / `zz never said zz` | c | f |")
    assert rows[0][1] == ["no metadata.csv or metadata.jsonl", "zz never said zz"]
    assert in_source(rows[0][1][0])
    assert not in_source(rows[0][1][1])  # tests/ is not searched, so this file does not count
