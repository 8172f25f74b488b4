"""On a CUDA device: `elasticpp train` trains the CPU curve, and a worker killed mid-run
recovers under the agent with the uninterrupted CUDA run's curve. Skipped, saying so, where
torch sees no CUDA device (CI has none); run them on a GPU machine with `pytest tests/gpu`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from elasticpp.agent.localcluster import LocalCluster
from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a torch without CUDA support
        return False


pytestmark = pytest.mark.skipif(not _cuda(), reason="no CUDA device visible to torch")

STEPS = 60
# Long enough on a GPU that the kill lands while the workers still train (the tiny model
# steps in milliseconds there).
KILL_STEPS = 300
SPEC: dict[str, Any] = {
    "name": "cuda",
    "model": "tiny",
    "global_batch": 12,
    "micro_batch": 2,
    "steps": STEPS,
    "seed": 3,
    "min_nodes": 1,
    "max_nodes": 1,
    "lease_ttl_s": 3,
    "join_settle_s": 0.5,
    "hang_timeout_s": 20,
}


def _device_model() -> str | dict[str, float]:
    """The job spec's planner device for the visible GPU (an agent with CUDA workers refuses
    the default `cpu` model)."""
    import torch

    from elasticpp.plan.specs import gpu_device_model

    props = torch.cuda.get_device_properties(0)
    return gpu_device_model(props.name, props.total_memory / 2**30)


def _train(out: Path, device: str, steps: int = STEPS) -> dict[int, float]:
    subprocess.run(
        [
            sys.executable, "-m", "elasticpp.cli.main", "train", "--model", "tiny",
            "--device", device, "--layout", "pp=1,tp=1,dp=1", "--global-batch", "12",
            "--micro-batch", "2", "--steps", str(steps), "--seed", "3", "--metrics", str(out),
        ],
        check=True,
        timeout=300,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return {int(r["step"]): float(r["loss"]) for r in map(json.loads, out.read_text().splitlines())}


def _max_rel(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


@pytest.mark.timeout(600)
def test_one_gpu_trains_the_cpu_curve(tmp_path: Path) -> None:
    # fp32 on CUDA runs its matmuls in TF32 (10-bit mantissa), so the bound is bf16's (1e-3,
    # the layout tests' bf16 loss bound). With TF32 off the curves agreed to 7e-8 on an H100;
    # with it on they have not been measured yet.
    cuda = _train(tmp_path / "cuda.jsonl", "cuda")
    cpu = _train(tmp_path / "cpu.jsonl", "cpu")
    assert _max_rel(cuda, cpu) <= 1e-3


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "snapshots",
    [{"snapshot_every": 1}, {}],
    ids=["snapshot-every-step", "snapshot-time-rule-default"],
)
def test_a_worker_killed_on_cuda_recovers_under_the_agent_on_the_same_curve(
    tmp_path: Path, no_orphans: None, snapshots: dict[str, int]
) -> None:
    # Every step snapshotted: at most the step in flight is recomputed. The default time rule
    # (a snapshot every 2 s once the writer is free): the curve is the same, more is recomputed.
    reference = _train(tmp_path / "ref.jsonl", "cuda", KILL_STEPS)
    spec = SPEC | {"steps": KILL_STEPS, "device": _device_model()} | snapshots
    lc = LocalCluster(tmp_path / "job", spec, nodes=1, slots=1, device="cuda")
    try:
        lc.start()
        lc.wait_for(lambda: lc.max_step() >= 8, 240, "step 8")
        with grpc.insecure_channel(lc.nodes[0].address) as ch:
            status = agent_pb2_grpc.AgentServiceStub(ch).GetStatus(
                agent_pb2.GetStatusRequest(), timeout=10
            )
        training = [w.pid for w in status.workers if w.state == "running"]
        assert training, status
        os.kill(training[0], signal.SIGKILL)
        lc.wait_finished(300)
        curve = {step: loss for step, (loss, _gen) in lc.curve().items()}
        assert _max_rel(curve, reference) <= 1e-6
        recoveries = [t for t in lc.timelines() if "failure" in str(t["reason"])]
        assert recoveries, lc.timelines()
        if snapshots:
            assert all(int(t["steps_recomputed"]) <= 1 for t in recoveries), recoveries
    finally:
        lc.close()


def _saved(save: Path, stop: int, every: int, model: Path) -> dict[int, dict[str, Any]]:
    """Each saved step's state: {step: {piece/tensor name: fp32 tensor}}."""
    from safetensors.torch import load_file

    subprocess.run(
        [
            sys.executable, "-m", "elasticpp.cli.main", "train", "--model", str(model),
            "--device", "cuda", "--layout", "pp=1,tp=1,dp=1", "--global-batch", "8",
            "--micro-batch", "2", "--steps", "5", "--stop-at", str(stop), "--seed", "5",
            "--save", str(save), "--save-every", str(every),
        ],
        check=True,
        timeout=300,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return {
        int(d.name.split("-")[-1]): {
            f"{p.name}/{k}": t for p in d.glob("*.safetensors") for k, t in load_file(p).items()
        }
        for d in save.iterdir()
        if d.is_dir()
    }


def _distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.timeout(600)
def test_a_snapshot_holds_its_steps_state_while_the_next_step_runs_beside_its_copy(
    tmp_path: Path,
) -> None:
    # The device-to-host copy of a snapshot runs on a side stream beside the next step's
    # forward and backward; only that step's update waits for it. Each snapshot of a run
    # that snapshots every step must be the state of the same run stopped at that step
    # (whose final state nothing overwrites), up to CUDA's run-to-run noise (atomics in backward):
    # far closer to it than to the state one update later. A model whose state takes a
    # while to copy (~0.6 GB), so a copy that raced the update would show.
    model = tmp_path / "model.json"
    model.write_text(
        json.dumps(
            {
                "name": "copy-race",
                "family": "llama",
                "num_layers": 4,
                "hidden_size": 1024,
                "num_heads": 16,
                "num_kv_heads": 8,
                "ffn_hidden_size": 4096,
                "vocab_size": 8192,
                "seq_len": 256,
            }
        )
    )
    every = _saved(tmp_path / "every", 5, 1, model)
    assert sorted(every) == [1, 2, 3, 4, 5]
    for stop in (2, 4):
        final = _saved(tmp_path / f"stop-{stop}", stop, 0, model)
        assert sorted(final) == [stop]
        one_update = _distance(every[stop + 1], final[stop])
        assert one_update > 0
        assert _distance(every[stop], final[stop]) <= 0.01 * one_update
