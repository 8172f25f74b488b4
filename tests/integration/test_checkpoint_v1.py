"""A version-1 checkpoint (written by elasticpp 0.1.0, kept in tests/data/checkpoint-v1) still
loads, under another layout, and continues the curve that version recorded; a fresh run of
today's code trains that same curve (the built-in `gpt` family's defaults did not move it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elasticpp.checkpoint.manifest import read_manifest, verify_step_dir
from elasticpp.plan.specs import default_units

DATA = Path(__file__).resolve().parents[1] / "data" / "checkpoint-v1"
STEP_DIR = DATA / "step-0000000003"


def _train(tmp_path: Path, layout: str, *extra: str) -> dict[int, dict]:
    metrics = tmp_path / f"metrics-{layout}.jsonl"
    cmd = [
        sys.executable, "-m", "elasticpp.cli.main", "train",
        "--model", str(DATA / "model.yaml"), "--layout", layout,
        "--global-batch", "4", "--micro-batch", "2", "--steps", "6", "--seed", "3",
        "--dropout", "0.1", "--metrics", str(metrics), *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r for r in rows}


def _reference() -> dict[int, float]:
    data = json.loads((DATA / "curve.json").read_text())
    return {int(k): v for k, v in data["losses"].items()}


def test_version_1_manifest_reads_as_the_builtin_unit_names() -> None:
    manifest = read_manifest(STEP_DIR)
    assert manifest.format_version == 1
    assert manifest.units == default_units(2)
    assert verify_step_dir(STEP_DIR).is_full_model()


@pytest.mark.timeout(180)
def test_version_1_checkpoint_resumes_under_another_layout_on_its_recorded_curve(
    tmp_path: Path,
) -> None:
    reference = _reference()
    resumed = _train(tmp_path, "pp=1,tp=1,dp=2", "--resume", str(STEP_DIR))
    assert sorted(resumed) == [3, 4, 5]
    for step, row in resumed.items():
        assert row["loss"] == pytest.approx(reference[step], rel=1e-5), step


@pytest.mark.timeout(180)
def test_todays_gpt_trains_the_curve_version_1_recorded(tmp_path: Path) -> None:
    reference = _reference()
    fresh = _train(tmp_path, "pp=2,tp=2,dp=1")
    assert [fresh[s]["loss"] for s in range(6)] == pytest.approx(
        [reference[s] for s in range(6)], rel=1e-6
    )
