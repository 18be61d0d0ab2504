"""Every relative link in the README and the docs reaches a file that exists and, where it names
one, a heading of that file, with anchors made as GitHub makes them."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "benchmarks" / "README.md",
        ROOT / "deploy" / "README.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, spaces to hyphens, and every character that
    is not a letter, a mark, a digit, a hyphen or an underscore dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    kept = []
    for char in text:
        if char == " ":
            kept.append("-")
        elif char in "-_" or unicodedata.category(char)[0] in "LMN":
            kept.append(char)
    return "".join(kept)


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(page.read_text()):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The targets of its links and images (a link's text may span lines)."""
    return LINK.findall("\n".join(prose(page.read_text())))


def test_the_slug_is_githubs() -> None:
    assert slug("A transformer language model: AdamW against AdamW + K-FAC") == (
        "a-transformer-language-model-adamw-against-adamw--k-fac"
    )
    assert slug("`kfac: auto`: the strategy chosen for you") == (
        "kfac-auto-the-strategy-chosen-for-you"
    )
    assert slug("K-FAC's own step size: `update: quadratic-model`") == (
        "k-facs-own-step-size-update-quadratic-model"
    )


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# There\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#there) [b](other.md#not-a-heading) [c](missing.md)\n")
    assert broken(page) == ["other.md#not-a-heading: no such heading", "missing.md: no such file"]


def broken(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: no such heading")
    return problems


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(ROOT / "README.md")}
    assert {page for page in PAGES if page.parent.name == "docs"} <= linked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_a_heading(page: Path) -> None:
    assert broken(page) == []
