"""The licence pyproject.toml declares is the one the repository and its wheel carry."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
# The SHA-256 of the Apache License 2.0 as the ASF publishes it
# (https://www.apache.org/licenses/LICENSE-2.0.txt), byte for byte.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_the_repository_carries_the_apache_2_licence_pyproject_declares() -> None:
    licence = ROOT / "LICENSE"
    assert hashlib.sha256(licence.read_bytes()).hexdigest() == APACHE_2_SHA256
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639), not a table
    assert project["license-files"] == ["LICENSE"]


@pytest.mark.timeout(120)
def test_the_wheel_ships_the_licence_and_says_so_in_its_metadata(tmp_path: Path) -> None:
    # Built from a copy: a build writes build/ and *.egg-info next to its sources.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "elasticpp", src / "elasticpp", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", str(src), "-w", str(out)],
        check=True, timeout=110,
    )  # fmt: skip
    [wheel] = out.glob("elasticpp-*.whl")
    with zipfile.ZipFile(wheel) as z:
        [info] = {n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA")}
        shipped = z.read(f"{info}/licenses/LICENSE")
        metadata = Parser().parsestr(z.read(f"{info}/METADATA").decode())
    assert hashlib.sha256(shipped).hexdigest() == APACHE_2_SHA256
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
