"""The licence pyproject.toml declares is the one the repository carries (the wheel's:
tests/unit/test_packaging.py)."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

from tests.records import APACHE_2_SHA256

ROOT = Path(__file__).parents[2]


def test_the_repository_carries_the_apache_2_licence_pyproject_declares() -> None:
    licence = ROOT / "LICENSE"
    assert hashlib.sha256(licence.read_bytes()).hexdigest() == APACHE_2_SHA256
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639), not a table
    assert project["license-files"] == ["LICENSE"]
