"""`elasticpp plan` as a user runs it: a real subprocess, its output and its exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elasticpp.plan import Plan

EXAMPLE = [
    "--nodes", "16", "--gpus-per-node", "8", "--device", "a100-80g",
    "--model", "gpt-175b", "--global-batch", "1536",
]  # fmt: skip
SUMMARY_FIELDS = {
    "pp", "tp", "dp", "micro_batch", "microbatches", "stages", "recompute", "gpus_used",
    "est_step_seconds", "bubble_fraction", "memory_gib",
}  # fmt: skip


def _plan(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "plan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _check_summary(obj: dict, global_batch: int, layers: int) -> None:
    assert set(obj) >= SUMMARY_FIELDS
    assert obj["pp"] * obj["tp"] * obj["dp"] == obj["gpus_used"]
    assert len(obj["microbatches"]) == obj["dp"]
    assert sum(obj["microbatches"]) * obj["micro_batch"] == global_batch
    assert len(obj["stages"]) == obj["pp"]
    assert [i for a, b in obj["stages"] for i in range(a, b)] == list(range(layers))
    assert obj["bubble_fraction"] == pytest.approx(
        (obj["pp"] - 1) / (max(obj["microbatches"]) + obj["pp"] - 1)
    )
    assert obj["memory_gib"] > 0 and obj["est_step_seconds"] > 0


@pytest.mark.timeout(60)
def test_json_output_has_the_plan_and_the_runner_ups(tmp_path: Path):
    out_file = tmp_path / "plan.json"
    proc = _plan(*EXAMPLE, "--json", "--top", "3", "--plan-out", str(out_file))
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    _check_summary(obj, 1536, 96)
    assert obj["tp"] <= 8 and obj["gpus_used"] <= 128 and obj["memory_gib"] <= 80
    assert len(obj["alternatives"]) == 3
    for alt in obj["alternatives"]:
        _check_summary(alt, 1536, 96)
        assert alt["est_step_seconds"] >= obj["est_step_seconds"]
    full = Plan.from_json(out_file.read_text(encoding="utf-8"))  # validates the placement
    assert (full.pp, full.tp, full.dp) == (obj["pp"], obj["tp"], obj["dp"])
    assert _plan(*EXAMPLE, "--json", "--top", "3").stdout == proc.stdout  # deterministic


@pytest.mark.timeout(60)
def test_human_output_is_a_readable_table():
    proc = _plan(*EXAMPLE, "--top", "2")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for word in ("layout", "micro-batches", "est. step time", "bubble", "memory per GPU"):
        assert word in text
    assert "next best (2)" in text
    assert proc.stderr == ""


@pytest.mark.timeout(60)
def test_spec_file_seq_len_override_and_uneven_nodes(tmp_path: Path):
    spec = tmp_path / "mini.yaml"
    spec.write_text(
        "num_layers: 6\nhidden_size: 256\nnum_heads: 4\nvocab_size: 1000\nseq_len: 128\n",
        encoding="utf-8",
    )
    args = ["--model", str(spec), "--seq-len", "64", "--global-batch", "10", "--device", "cpu"]
    proc = _plan(*args, "--node-gpus", "2,1,3", "--micro-batch", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    _check_summary(obj, 10, 6)
    assert obj["micro_batch"] == 1 and obj["gpus"] == 6 and obj["model"] == "mini"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nodes", "0"], "--nodes"),
        (["--gpus-per-node", "0"], "--gpus-per-node"),
        (["--model", "gpt-9000"], "unknown model"),
        (["--device", "tpu-v9"], "unknown device"),
        (["--global-batch", "0"], "--global-batch"),
        (["--global-batch", "6", "--micro-batch", "4"], "not a multiple of micro-batch"),
        (["--nodes", "1", "--gpus-per-node", "1"], "smallest memory need"),
        (["--seq-len", "0"], "--seq-len"),
        (["--top", "-1"], "--top"),
        (["--node-gpus", "8,x"], "--node-gpus"),
        (["--node-gpus", "0,0"], "no healthy GPU"),
        (["--nodes", "many"], "argument --nodes: expected a whole number"),
    ],
)
@pytest.mark.timeout(60)
def test_bad_input_is_one_line_on_stderr_and_exit_code_2(args, needle):
    proc = _plan(*EXAMPLE, *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]
