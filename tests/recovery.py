"""What the tests of whole jobs share: the recovery job, its uninterrupted reference curve
(the `references` fixture, served to every test by tests/integration/conftest.py), the
loss-curve check and a scrape of an agent's metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.soak import SLICED_DEVICE
from elasticpp.agent.localcluster import LocalCluster

STEPS = 14


RECOVERY_SPEC: dict[str, Any] = {
    "name": "itest",
    "model": "tiny",
    "global_batch": 12,
    "micro_batch": 2,
    "steps": STEPS,
    "seed": 3,
    "min_nodes": 1,
    "max_nodes": 3,
    "lease_ttl_s": 3,
    "join_settle_s": 0.5,
    "hang_timeout_s": 6,
    # A slot modelled without per-message latency, so that the planner picks tensor-parallel
    # layouts and recoveries move TP-sliced state (the calibrated `cpu` preset would choose
    # pure data parallelism for this model).
    "device": SLICED_DEVICE,
}


def _train_reference(out: Path, steps: int) -> dict[int, float]:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticpp.cli.main",
            "train",
            "--model",
            "tiny",
            "--layout",
            "pp=1,tp=1,dp=1",
            "--global-batch",
            str(RECOVERY_SPEC["global_batch"]),
            "--micro-batch",
            str(RECOVERY_SPEC["micro_batch"]),
            "--steps",
            str(steps),
            "--seed",
            str(RECOVERY_SPEC["seed"]),
            "--metrics",
            str(out),
        ],
        check=True,
        timeout=240,
    )
    return {int(r["step"]): float(r["loss"]) for r in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], dict[int, float]]:
    """The uninterrupted curve of the job with `steps` steps (the LR schedule depends on it)."""
    cache: dict[int, dict[int, float]] = {}

    def get(steps: int) -> dict[int, float]:
        if steps not in cache:
            out = tmp_path_factory.mktemp("ref") / f"ref-{steps}.jsonl"
            cache[steps] = _train_reference(out, steps)
        return cache[steps]

    return get


@pytest.fixture
def reference(references: Callable[[int], dict[int, float]]) -> dict[int, float]:
    return references(STEPS)


def assert_same_curve(
    lc: LocalCluster,
    reference: dict[int, float],
    earlier: dict[int, tuple[float, int]] | None = None,
) -> None:
    curve = {**(earlier or {}), **lc.curve()}
    assert sorted(curve) == list(range(len(reference))), f"steps trained: {sorted(curve)}"
    for step, (loss, _gen) in curve.items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (
            f"step {step}: elastic loss {loss} vs uninterrupted {reference[step]}"
        )


def scrape(port: int) -> dict[str, float]:
    """Unlabelled view of an agent's /metrics: metric name -> value of its last sample."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out
