"""The data-parallel gradient reduction overlaps backward (real processes, gloo).

Two replicas run two steps with small buckets (tests/integration/helpers/buckets_rank.py logs
every all-reduce on the replicas' group): each bucket is all-reduced asynchronously from a
gradient hook while the step's last backward is still running, none after it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elasticpp.plan import ClusterSpec, Layout, ModelSpec, build_plan, load_device_spec

MODEL = ModelSpec("t4", num_layers=4, hidden_size=32, num_heads=4, vocab_size=256, seq_len=16)
HELPER = Path(__file__).parent / "helpers" / "buckets_rank.py"
CAP_BYTES = 16 * 1024  # a block of this model holds ~50 KB of fp32 parameters


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
def test_buckets_are_all_reduced_from_hooks_while_the_last_backward_runs(
    tmp_path: Path,
) -> None:
    layout = Layout.parse("pp=1,tp=1,dp=2")
    plan = build_plan(
        MODEL,
        ClusterSpec.uniform(1, layout.world_size, load_device_spec("cpu")),
        layout,
        global_batch=8,
        micro_batch=2,  # two micro-batches per replica: only the last backward reduces
    )
    (tmp_path / "plan.json").write_text(plan.to_json())
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HELPER),
                str(r),
                str(layout.world_size),
                str(port),
                str(tmp_path / "plan.json"),
                str(tmp_path / f"rank{r}.json"),
                str(CAP_BYTES),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(layout.world_size)
    ]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0]["losses"] == got[1]["losses"]
    for rank in got:
        for calls in rank["steps"]:
            assert len(calls) > 2, calls  # several buckets, not one flat reduce
            assert all(c["in_backward"] and c["async"] for c in calls), calls
            # The first bucket left while backward still had gradients to compute.
            assert calls[0]["grads_ready"] < rank["params"] // 2, calls
