"""`elasticpp train` end to end: bad input, save/resume across layouts, failures, signals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from elasticpp.checkpoint.manifest import verify_step_dir
from elasticpp.checkpoint.tensors import load_units
from elasticpp.proctree import descendants, worker_processes
from elasticpp.train.worker.launch import wait_gone
from elasticpp.waiting import wait_until

MODEL_SPEC = {
    "name": "t4",
    "num_layers": 4,
    "hidden_size": 32,
    "num_heads": 4,
    "vocab_size": 256,
    "seq_len": 16,
}


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "t4.json"
    path.write_text(json.dumps(MODEL_SPEC))
    return path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "elasticpp.cli.main", "train", *args]


def common(model_file: Path, layout: str, steps: int, metrics: Path) -> list[str]:
    return [
        "--model",
        str(model_file),
        "--layout",
        layout,
        "--global-batch",
        "8",
        "--micro-batch",
        "2",
        "--steps",
        str(steps),
        "--seed",
        "5",
        "--lr",
        "3e-3",
        "--metrics",
        str(metrics),
    ]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def children_of(pid: int) -> list[int]:
    """The command's worker processes (forked from its worker template, not the template)."""
    return worker_processes(pid)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layout", "pp=1,tp=3,dp=1"], "does not divide num_heads"),
        (["--layout", "pp=5,tp=1,dp=1"], "at most one stage a layer"),
        (["--layout", "dp=4", "--global-batch", "6", "--micro-batch", "2"], "too small"),
        (["--global-batch", "9", "--micro-batch", "2"], "not a multiple"),
        (["--model", "no-such-model"], "unknown model"),
        (["--layout", "pp=two"], "must be an integer"),
        (["--dropout", "1.5"], "dropout"),
        (["--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
        (["--resume", "/nonexistent-dir-of-elasticpp"], "--resume"),
    ],
)
def test_bad_input_exits_2_with_one_line_before_any_worker_starts(
    tmp_path: Path, model_file: Path, args: list[str], message: str
) -> None:
    log_dir = tmp_path / "logs"
    base = ["--model", str(model_file), "--log-dir", str(log_dir)]
    proc = subprocess.run(
        cli(*base, *args), capture_output=True, text=True, timeout=50, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not log_dir.exists()  # no worker was ever started


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("data", "args", "message"),
    [
        ("t.bin", ["--data-dtype", "uint16"], "token id 300 at position 3"),
        ("t.bin", [], "or give the dtype with --data-dtype"),
        ("short.bin", ["--data-dtype", "uint16"], "has 10 tokens"),
        ("t.txt", ["--data-dtype", "uint16"], "data_dtype 'uint16' applies to a token file"),
        ("t.txt", ["--no-shuffle"], "data_shuffle false applies to token files"),
        ("t.txt", ["--corpus-max-bytes", "100"], "corpus_max_bytes 100"),
        ("t32.bin", ["--data-dtype", "uint16"], "holds uint32 ids (its sidecar"),
        ("t32.bin", [], "vocabulary of 300 tokens"),
    ],
)
def test_bad_data_exits_2_with_one_line_before_any_worker_starts(
    tmp_path: Path, model_file: Path, data: str, args: list[str], message: str
) -> None:
    ids = np.arange(100, dtype="<u2")
    ids[3] = 300
    ids.tofile(tmp_path / "t.bin")
    np.arange(10, dtype="<u2").tofile(tmp_path / "short.bin")
    np.arange(100, dtype="<u4").tofile(tmp_path / "t32.bin")
    sidecar = {"format_version": 1, "dtype": "uint32", "tokens": 100, "vocab_size": 300}
    (tmp_path / "t32.bin.json").write_text(json.dumps(sidecar))
    (tmp_path / "t.txt").write_bytes(b"x" * 200)
    log_dir = tmp_path / "logs"
    base = ["--model", str(model_file), "--log-dir", str(log_dir), "--data", data]
    proc = subprocess.run(
        cli(*base, *args), capture_output=True, text=True, timeout=50, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not log_dir.exists()


@pytest.mark.timeout(150)
def test_save_under_one_layout_and_resume_under_another_continues_the_curve(
    tmp_path: Path, model_file: Path
) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    save, save2 = tmp_path / "save", tmp_path / "save2"

    scratch = tmp_path / "tmp"  # the runs' temporary directory: worker logs without --log-dir
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            cli(*args), capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
        )

    p = run(
        *common(model_file, "pp=2,tp=2,dp=1", 6, first), "--save", str(save), "--save-every", "3"
    )
    assert p.returncode == 0, p.stderr
    # A run that ends well leaves no worker logs behind (torch may keep its own caches there).
    assert [d for d in scratch.iterdir() if d.name.startswith("elasticpp-")] == []
    assert sorted(d.name for d in save.iterdir()) == ["step-0000000003", "step-0000000006"]
    manifest = verify_step_dir(save / "step-0000000003")
    assert manifest.step == 3 and manifest.is_full_model()
    assert {e.key.tp_size for e in manifest.pieces} == {2}
    # Resume the tp=2 state at step 3 under pp=1,dp=2; stop after step 5 and save there.
    resume_args = [
        "--resume",
        str(save / "step-0000000003"),
        "--stop-at",
        "5",
        "--save",
        str(save2),
    ]
    p = run(*common(model_file, "pp=1,tp=1,dp=2", 6, second), *resume_args)
    assert p.returncode == 0, p.stderr
    assert "stopped at step 5" in p.stdout
    assert verify_step_dir(save2 / "step-0000000005").is_full_model()
    expected, resumed = read_metrics(first), read_metrics(second)
    assert [r["step"] for r in resumed] == [3, 4]
    for b in resumed:
        a = expected[b["step"]]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
        assert b["lr"] == a["lr"]
    assert {r["layout"] for r in resumed} == {"pp=1,tp=1,dp=2"}


def save_llama(path: Path, intermediate_size: int = 96) -> Path:
    """A small random Hugging Face Llama (byte vocabulary), saved as a model directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.timeout(200)
def test_a_run_of_a_hugging_face_directory_resumes_on_the_uninterrupted_curve(
    tmp_path: Path,
) -> None:
    model = save_llama(tmp_path / "llama")
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    save = tmp_path / "save"

    def run(metrics: Path, *args: str) -> subprocess.CompletedProcess[str]:
        base = [*common(model, "pp=1,tp=1,dp=1", 4, metrics), "--seq-len", "16"]
        return subprocess.run(
            cli(*base, *args), capture_output=True, text=True, timeout=150, cwd=tmp_path
        )

    # Uninterrupted, from the directory's weights, saving step 2 on the way.
    p = run(first, "--save", str(save), "--save-every", "2")
    assert p.returncode == 0, p.stderr
    # The same --model continues from the checkpoint: its weights win over the directory's.
    p = run(second, "--resume", str(save / "step-0000000002"))
    assert p.returncode == 0, p.stderr
    expected, resumed = read_metrics(first), read_metrics(second)
    assert [r["step"] for r in resumed] == [2, 3]
    for b in resumed:
        a = expected[b["step"]]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
    # A checkpoint of another model is refused before any worker starts, naming what differs;
    # --init-from and --resume together still are.
    other = save_llama(tmp_path / "llama-wide", intermediate_size=128)
    log_dir = tmp_path / "logs"
    for args, message in [
        (
            ["--model", str(other), "--resume", str(save / "step-0000000002")],
            "ffn_hidden_size 96 (checkpoint) vs 128 (--model)",
        ),
        (["--init-from", str(model), "--resume", str(save)], "--resume continues one"),
    ]:
        p = run(tmp_path / "c.jsonl", *args, "--log-dir", str(log_dir))
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], p.stderr
    assert not log_dir.exists()


@pytest.mark.timeout(120)
def test_bf16_trains_across_stages_and_saves_fp32_state(tmp_path: Path, model_file: Path) -> None:
    metrics, save = tmp_path / "m.jsonl", tmp_path / "save"
    p = subprocess.run(
        cli(
            *common(model_file, "pp=2,tp=1,dp=1", 2, metrics),
            "--precision",
            "bf16",
            "--save",
            str(save),
        ),
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in read_metrics(metrics)] == [0, 1]
    step_dir = save / "step-0000000002"
    manifest = verify_step_dir(step_dir)
    loaded = load_units(step_dir, manifest.units, 0, 1)
    dtypes = {t.dtype for unit in loaded.values() for t in unit.tensors.values()}
    # Master weights and AdamW moments are fp32 under bf16 compute, and so is what is saved.
    assert dtypes == {torch.float32}


def start_long_run(tmp_path: Path, model_file: Path, metrics: Path) -> subprocess.Popen[str]:
    """A run with no end and no --log-dir: its worker logs go to a directory under tmp/."""
    args = common(model_file, "pp=2,tp=1,dp=1", 100000, metrics)
    (tmp_path / "tmp").mkdir()
    return subprocess.Popen(
        cli(*args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
    )


def wait_for_steps(proc: subprocess.Popen[str], metrics: Path, timeout_s: float) -> None:
    def alive() -> None:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""

    stepped = wait_until(
        lambda: metrics.exists() and bool(read_metrics(metrics)), timeout_s, each=alive
    )
    assert stepped, "no step within the deadline"


def cleanup(proc: subprocess.Popen[str], workers: list[int]) -> None:
    """Teardown: whatever the test left, kill it (workers lead their own groups)."""
    for pid in [proc.pid, *workers]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.mark.timeout(120)
def test_a_killed_worker_ends_the_command_non_zero_within_seconds_leaving_no_process(
    tmp_path: Path, model_file: Path
) -> None:
    metrics = tmp_path / "m.jsonl"
    proc = start_long_run(tmp_path, model_file, metrics)
    workers: list[int] = []
    try:
        wait_for_steps(proc, metrics, 90)
        workers = children_of(proc.pid)
        assert len(workers) == 2
        everything = descendants(proc.pid)  # the workers and their template
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=30)
        assert rc not in (0, 2)
        assert time.monotonic() - killed < 20
        # Whichever the launcher hears of first is reported: the killed rank's exit, or the
        # survivor's failed collective. Either way one line names a rank.
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert "exited with code" in err or "rank 0:" in err, err
        assert wait_gone(everything, 10) == []
        # A failed run keeps its worker logs, and says where they are.
        (kept,) = (tmp_path / "tmp").glob("elasticpp-train-*")
        assert f"worker logs are in {kept}" in err
        assert sorted(p.name for p in kept.iterdir() if p.suffix == ".log")
    finally:
        cleanup(proc, workers)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_kills_every_worker(
    tmp_path: Path, model_file: Path, sig: signal.Signals
) -> None:
    metrics = tmp_path / "m.jsonl"
    proc = start_long_run(tmp_path, model_file, metrics)
    workers: list[int] = []
    try:
        wait_for_steps(proc, metrics, 90)
        workers = children_of(proc.pid)
        assert len(workers) == 2
        everything = descendants(proc.pid)  # the workers and their template
        proc.send_signal(signal.SIGUSR1)  # prints the threads' stacks; training goes on
        proc.send_signal(sig)
        assert proc.stderr is not None
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # where it is stuck, for the failure message
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)  # the dump is written at once
            proc.kill()
            pytest.fail(f"no exit 30 s after signal {sig}; its stacks:\n{proc.stderr.read()}")
        assert rc in (130, 143)
        assert "most recent call first" in proc.stderr.read()
        assert wait_gone(everything, 10) == []
    finally:
        cleanup(proc, workers)
