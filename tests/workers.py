"""What the worker tests share: assignments and plans for real worker processes, a
rendezvous store, snapshot runs, whether a process lives, a tiny Llama configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import (
    LlamaConfig,
)

from elasticpp.plan import (
    ClusterSpec,
    Layout,
    ModelSpec,
    build_plan,
    load_device_spec,
)
from elasticpp.train.config import TrainConfig
from elasticpp.train.worker.launch import kill_all, run_local, spawn_workers

MODEL = ModelSpec("t4", num_layers=4, hidden_size=32, num_heads=4, vocab_size=256, seq_len=16)


def make_plan(layout: str, generation: int = 3):  # type: ignore[no-untyped-def]
    L = Layout.parse(layout)
    plan = build_plan(
        MODEL,
        ClusterSpec.uniform(1, L.world_size, load_device_spec("cpu")),
        L,
        global_batch=8,
        micro_batch=2,
    )
    return plan.with_generation(generation)


def assignment(plan: Any, rank: int, port: int, job: TrainConfig, **extra: Any) -> dict[str, Any]:
    return {
        "format_version": 1,
        "plan": plan.to_dict(),
        "rank": rank,
        "store_host": "127.0.0.1",
        "store_port": port,
        "store_prefix": f"gen{plan.generation}",
        "job": job.to_dict(),
        "start_step": 0,
        "resume_dir": None,
        "snapshot_dir": None,
        "snapshot_every": 1,
        "backend": "gloo",
        "device": "cpu",
        "num_threads": 1,
        **extra,
    }


def rendezvous_store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


MODEL_SNAPSHOT_WHEN_BUSY = ModelSpec(
    "wide", num_layers=2, hidden_size=128, num_heads=4, vocab_size=32768, seq_len=8
)


STEPS = 8


def run_snapshots(
    tmp_path: Path, model: ModelSpec = MODEL_SNAPSHOT_WHEN_BUSY, steps: int = STEPS, **rule: Any
) -> dict[int, list[int]]:
    """Train `model` at pp=2 over real workers with the snapshot `rule` (run_local's
    snapshot_* arguments); the steps each rank wrote, in order."""
    plan = build_plan(
        model,
        ClusterSpec.uniform(1, 2, load_device_spec("cpu")),
        Layout.parse("pp=2,tp=1,dp=1"),
        global_batch=4,
        micro_batch=2,
    )
    written: dict[int, list[int]] = {0: [], 1: []}

    def on_snapshot(ev: dict[str, Any]) -> None:
        written[int(ev["rank"])].append(int(ev["step"]))

    workers = spawn_workers(2, tmp_path / "logs", tag="rank")
    try:
        run_local(
            plan,
            TrainConfig(seed=0, steps=steps),
            workers,
            snapshot_dir=tmp_path / "snap",
            num_threads=1,
            on_snapshot=on_snapshot,
            **rule,
        )
    finally:
        kill_all(workers)
    return written


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def tiny_llama_config(**changes: Any) -> LlamaConfig:
    """A small random Llama with grouped-query attention (4 query heads, 2 key/value heads)
    and the byte vocabulary, as the tests' reference models use."""
    return LlamaConfig(
        **{
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
            **changes,
        }
    )
