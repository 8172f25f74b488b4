"""Every relative link of the README and the docs reaches a file that exists and, with an
anchor, a heading that file has (GitHub's anchors): a section renamed, cut or moved to
another file leaves no reader at a dead end. The README was cut into docs/*.md once; this
is what keeps the pointers true."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of `doc`'s headings: lower case, punctuation dropped, spaces as
    '-', a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", doc.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_reaches_a_file_and_a_heading_it_has() -> None:
    dead = []
    checked = 0
    for doc in docs():
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            checked += 1
            if not file.exists():
                dead.append(f"{doc.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                dead.append(f"{doc.name}: {target} (no such heading)")
    assert checked > 50, "no links found: the pattern is out of date"
    assert dead == []


def test_the_anchors_follow_githubs_rule() -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    assert "on-a-gpu-benchgpupy-testsgpu" in anchors(doc)
    assert "leaders-resolve-and-plan-at-scale-benchresolvepy" in anchors(doc)


def test_no_doc_points_into_a_readme_section_by_name() -> None:
    """The README is short now: a pointer such as `README, "Benchmarks"` names a section
    that moved to docs/. Links, which the test above checks, replace them."""
    pointer = re.compile(r"README(?:'s|,) \"([^\"]+)\"")
    named = [(d.name, m.group(1)) for d in docs() for m in pointer.finditer(d.read_text())]
    assert named == []
