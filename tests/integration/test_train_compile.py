"""`elasticpp train --compile` (torch.compile of every block) trains the eager curve: the
compiled kernels fuse the same arithmetic, so the losses agree to float32 rounding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _curve(tmp_path: Path, *extra: str) -> list[float]:
    metrics = tmp_path / f"m{len(extra)}.jsonl"
    subprocess.run(
        [
            sys.executable, "-m", "elasticpp.cli.main", "train", "--model", "llama-tiny",
            "--layout", "pp=2,tp=1,dp=1", "--steps", "4", "--metrics", str(metrics), *extra,
        ],
        check=True,
        timeout=600,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return [float(json.loads(line)["loss"]) for line in metrics.read_text().splitlines()]


@pytest.mark.timeout(900)
def test_compiled_blocks_train_the_eager_curve(tmp_path: Path) -> None:
    eager = _curve(tmp_path)
    compiled = _curve(tmp_path, "--compile")
    assert len(compiled) == len(eager) == 4
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager, strict=True)) <= 1e-5
