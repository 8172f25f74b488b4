"""The docs' pointers into the README ("the README's "Benchmarks"") name sections it has: a
section renamed or cut leaves no reader at a dead end."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POINTER = re.compile(r"README(?:'s|,) \"([^\"]+)\"")


def test_every_readme_section_the_docs_name_exists() -> None:
    headings = [
        line.lstrip("#").strip()
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("#")
    ]
    named = {
        (doc.name, m.group(1))
        for doc in sorted((ROOT / "docs").glob("*.md"))
        for m in POINTER.finditer(doc.read_text())
    }
    assert named, "no pointer into the README found: the pattern is out of date"
    dead = sorted((doc, name) for doc, name in named if not any(name in h for h in headings))
    assert dead == []
