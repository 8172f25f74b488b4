"""An agent running CUDA workers refuses a job spec whose planner device is `cpu` (the
default): the planner would size every plan for 8 GiB CPU slots, e.g. recompute activations
that a GPU has room for, and the job would run slower than it should without a word."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elasticpp.cli import agent as agent_cli
from elasticpp.errors import ConfigError
from elasticpp.plan.specs import DEVICE_PRESETS, DeviceSpec, gpu_device_model, gpu_preset

SPEC = """name: dev
model: tiny
global_batch: 4
micro_batch: 2
steps: 4
seed: 0
min_nodes: 1
max_nodes: 1
"""


@pytest.mark.timeout(120)
def test_cuda_agent_with_the_default_cpu_device_model_exits_2_naming_it(tmp_path: Path):
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)
    proc = subprocess.run(
        [
            sys.executable, "-m", "elasticpp.cli.main", "agent", "--etcd", "127.0.0.1:1",
            "--job-spec", str(spec), "--node-id", "n0", "--state-dir", str(tmp_path / "s"),
            "--device", "cuda", "--slots", "1", "--listen", "127.0.0.1:0", "--metrics-port", "0",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "device is 'cpu'" in proc.stderr and "h100-80g" in proc.stderr, proc.stderr
    assert not (tmp_path / "s").exists()  # refused before it touched anything


@pytest.mark.parametrize("device", ["cpu", "CPU"])
def test_the_cpu_model_is_refused_for_cuda_workers(device: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(agent_cli, "_gpu_identity", lambda: ("NVIDIA H200", 139.8))
    with pytest.raises(ConfigError, match=r"job spec j\.yaml: device is 'cpu'.*device: h200"):
        agent_cli.check_device_model(device, Path("j.yaml"))


def test_an_unmodelled_gpu_is_told_to_give_its_figures(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(agent_cli, "_gpu_identity", lambda: ("NVIDIA L40S", 44.4))
    with pytest.raises(ConfigError, match=r"NVIDIA L40S \(44 GiB\): give its figures"):
        agent_cli.check_device_model("cpu", Path("j.yaml"))


@pytest.mark.parametrize("device", ["h100-80g", "a100-40g", {"memory_gib": 48, "peak_tflops": 362}])
def test_a_gpu_model_is_accepted(device: str | dict[str, float]):
    agent_cli.check_device_model(device, Path("j.yaml"))


@pytest.mark.parametrize(
    ("name", "memory_gib", "preset"),
    [
        ("NVIDIA H200", 139.8, "h200"),
        ("NVIDIA H100 80GB HBM3", 79.1, "h100-80g"),
        ("NVIDIA H100 NVL", 93.6, "h100-80g"),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 39.4, None),  # a MIG slice: not the preset
        ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80g"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40g"),
        ("Tesla V100-SXM2-32GB", 31.7, None),
    ],
)
def test_gpu_preset_by_cuda_name(name: str, memory_gib: float, preset: str | None):
    assert gpu_preset(name, memory_gib) == preset
    assert preset is None or preset in DEVICE_PRESETS


def test_a_gpu_without_a_preset_gets_figures_a_job_spec_accepts():
    assert gpu_device_model("NVIDIA H200", 139.8) == "h200"
    figures = gpu_device_model("NVIDIA L40S", 44.4)
    assert isinstance(figures, dict) and figures["memory_gib"] == 44.4
    DeviceSpec("custom", **figures)  # what the job spec builds from them
    agent_cli.check_device_model(figures, Path("j.yaml"))
