"""`elasticpp train` on token files: the curve follows the tokens, not the layout or the dtype.

Six short runs of the `tiny` model (vocabulary 256) start together: the same ids as a uint16
.bin, a uint32 .bin and a uint32 .npy, shuffled and in file order, under two layouts, and as
three shards of uneven sizes (a directory, and a list given out of order) with their sidecars.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

STEPS = 3
GLOBAL_BATCH = 8
SEQ_LEN = 32  # the tiny preset's
# 20 windows: 24 samples cross two epoch boundaries.
IDS = np.random.default_rng(0).integers(0, 256, size=20 * SEQ_LEN + 1)


def train_args(data: Path, layout: str, metrics: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "elasticpp.cli.main",
        "train",
        "--model",
        "tiny",
        "--layout",
        layout,
        "--global-batch",
        str(GLOBAL_BATCH),
        "--micro-batch",
        "2",
        "--steps",
        str(STEPS),
        "--seed",
        "3",
        "--lr",
        "3e-3",
        "--threads",
        "1",
        "--data",
        str(data),
        "--metrics",
        str(metrics),
        "--log-dir",
        str(metrics.with_suffix(".logs")),
        *extra,
    ]


def write_shards(folder: Path, sizes: list[int]) -> list[str]:
    """IDS split into uint16 .bin shards of `sizes` tokens, each with the sidecar that
    `elasticpp data prepare` writes (the dtype comes from it, not from a flag)."""
    folder.mkdir()
    paths, start = [], 0
    for k, size in enumerate(sizes):
        path = folder / f"part-{k}.bin"
        IDS[start : start + size].astype("<u2").tofile(path)
        sidecar = {"format_version": 1, "dtype": "uint16", "tokens": size, "vocab_size": 256}
        path.with_name(path.name + ".json").write_text(json.dumps(sidecar))
        paths.append(str(path))
        start += size
    return paths


@pytest.mark.timeout(300)
def test_token_files_train_the_same_curve_under_any_layout_and_dtype(tmp_path: Path) -> None:
    IDS.astype("<u2").tofile(tmp_path / "t16.bin")
    IDS.astype("<u4").tofile(tmp_path / "t32.bin")
    np.save(tmp_path / "t32.npy", IDS.astype(np.uint32))
    shards = write_shards(tmp_path / "shards", [301, 17, len(IDS) - 318])
    one, two = "pp=1,tp=1,dp=1", "pp=2,tp=1,dp=2"
    # Each order under both layouts, with both dtypes between them; the shards under both.
    runs = {
        "shuffled-1": ("t16.bin", one, "--data-dtype", "uint16"),
        "shuffled-2": ("t32.bin", two, "--data-dtype", "uint32"),
        "ordered-1": ("t32.npy", one, "--no-shuffle"),
        "ordered-2": ("t16.bin", two, "--data-dtype", "uint16", "--no-shuffle"),
        "shuffled-shards": ("shards", two),
        # A later --data replaces the first: the list, out of order (shards go by name).
        "ordered-shards": ("t16.bin", one, "--data", *shards[::-1], "--no-shuffle"),
    }
    procs = {
        name: subprocess.Popen(
            train_args(tmp_path / data, layout, tmp_path / f"{name}.jsonl", *extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            start_new_session=True,
        )
        for name, (data, layout, *extra) in runs.items()
    }
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=260)
            assert proc.returncode == 0, (name, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()  # the command kills its workers on SIGTERM
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def curve(name: str) -> list[tuple[float, float]]:
        lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        assert [r["step"] for r in records] == list(range(STEPS)), name
        return [(r["loss"], r["grad_norm"]) for r in records]

    def assert_same(a: str, b: str) -> None:
        for (la, ga), (lb, gb) in zip(curve(a), curve(b), strict=True):
            assert lb == pytest.approx(la, rel=1e-5), (a, b)
            assert gb == pytest.approx(ga, rel=1e-5), (a, b)

    assert_same("shuffled-1", "shuffled-2")
    assert_same("ordered-1", "ordered-2")
    assert_same("shuffled-1", "shuffled-shards")
    assert_same("ordered-1", "ordered-shards")
    # The order matters: shuffled and file-order samples give different curves.
    assert curve("shuffled-1")[0][0] != pytest.approx(curve("ordered-1")[0][0], rel=1e-5)
