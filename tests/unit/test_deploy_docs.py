"""docs/deploy.md's table of chart values says the defaults values.yaml has: every row whose
keys and defaults are literals (`a` / `.b` pairs included) is compared with the chart."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy.md"
VALUES = ROOT / "helm" / "elasticpp" / "values.yaml"
LITERAL = re.compile(r"^`([^`]*)`$")


def _table_rows() -> list[tuple[list[str], list[str]]]:
    """(keys, defaults) of the rows of the values table whose cells are literals only."""
    text = DOC.read_text()
    start = text.index("**Values**")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("key", "---"):
            continue
        keys = [LITERAL.match(k.strip()) for k in cells[0].split(" / ")]
        defaults = [LITERAL.match(d.strip()) for d in cells[1].split(" / ")]
        if all(keys) and all(defaults) and len(keys) == len(defaults):
            rows.append(([k.group(1) for k in keys if k], [d.group(1) for d in defaults if d]))
    return rows


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def _lookup(values: dict[str, Any], key: str) -> Any:
    node: Any = values
    for part in key.split("."):
        assert isinstance(node, dict) and part in node, f"docs/deploy.md names {key}: no such value"
        node = node[part]
    return node


def test_the_documented_defaults_are_the_charts() -> None:
    values = yaml.safe_load(VALUES.read_text())
    rows = _table_rows()
    assert len(rows) >= 10, f"only {len(rows)} rows of literals found: the table moved?"
    wrong = []
    for keys, defaults in rows:
        base = keys[0].rpartition(".")[0]
        for key, default in zip(keys, defaults, strict=True):
            path = f"{base}{key}" if key.startswith(".") else key
            actual = _shown(_lookup(values, path))
            if actual != default:
                wrong.append(f"{path}: docs say {default!r}, values.yaml has {actual!r}")
    assert wrong == []
