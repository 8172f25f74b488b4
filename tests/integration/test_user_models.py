"""A user's model definition (`package.module:function`, the documented example in
docs/examples/byte_conv.py: a convolutional network, not a transformer) trains the same curve
under any layout; a wrong reference or a broken declaration is refused before any worker
starts, naming what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def _run(
    args: list[str], pythonpath: list[Path], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    return subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _curve(tmp_path: Path, layout: str) -> list[float]:
    metrics = tmp_path / f"{layout}.jsonl"
    done = _run(
        [
            "train", "--model", "byte_conv:build", "--model-option", "depth=4",
            "--layout", layout, "--global-batch", "8", "--micro-batch", "2", "--steps", "4",
            "--dropout", "0.1", "--seed", "2", "--metrics", str(metrics),
        ],
        [EXAMPLES],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.mark.timeout(400)
def test_a_user_model_trains_the_same_curve_under_three_layouts(tmp_path: Path) -> None:
    reference = _curve(tmp_path, "pp=1,tp=1,dp=1")
    assert len(reference) == 4
    for layout in ("pp=2,tp=2,dp=1", "pp=1,tp=2,dp=2"):
        assert _curve(tmp_path, layout) == pytest.approx(reference, rel=1e-5), layout


BROKEN = """
from elasticpp.train.model.contract import Boundary, ModelDef, Param, Split, Unit

def ident(ctx, p, x):
    return x

def bad_split():
    return None

def build(options):
    kind = options.get("kind")
    if kind == "not-a-model":
        return {"units": []}
    if kind == "raises":
        raise ValueError("width must be even")
    bias = Param("b", (4,), Split.ROW)  # a ROW split needs a matrix
    return ModelDef("broken", (Unit("in", (), ident),), (Unit("mix", (bias,), ident),),
                    (Unit("out", (), ident),), Boundary((8, 4)), 256, 8)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        ("no_such_module:build", [], "no module no_such_module"),
        ("user_broken:missing", [], "has no 'missing'"),
        ("user_broken:build", [], "unit mix parameter 'b': a ROW split needs a matrix"),
        (
            "user_broken:build",
            ["--model-option", "kind=not-a-model"],
            "returned dict, not a ModelDef",
        ),
        ("user_broken:build", ["--model-option", "kind=raises"], "width must be even"),
    ],
)
def test_a_wrong_model_reference_is_refused_before_any_worker_starts(
    tmp_path: Path, model: str, options: list[str], message: str
) -> None:
    (tmp_path / "user_broken.py").write_text(BROKEN)
    logs = tmp_path / "logs"
    done = _run(["train", "--model", model, *options, "--log-dir", str(logs)], [tmp_path], 60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert not logs.exists() or not any(logs.iterdir())  # no worker ever started


@pytest.mark.timeout(120)
def test_the_agent_refuses_a_broken_model_at_startup_with_exit_code_2(tmp_path: Path) -> None:
    (tmp_path / "user_broken.py").write_text(BROKEN)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: j\nmodel: user_broken:build\nglobal_batch: 4\nmicro_batch: 2\nsteps: 2\n"
        "seed: 0\nmin_nodes: 1\nmax_nodes: 1\n"
    )
    done = _run(
        [
            "agent", "--etcd", "127.0.0.1:1", "--job-spec", str(spec), "--node-id", "n0",
            "--state-dir", str(tmp_path / "state"), "--listen", "127.0.0.1:0",
            "--metrics-port", "0",
        ],
        [tmp_path],
        60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "ROW split needs a matrix" in done.stderr
