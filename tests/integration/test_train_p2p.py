"""The pipeline's point-to-point traffic on real processes (gloo): what a step keeps alive.

1F1B holds O(p) micro-batches of activations; the tensors it sends must not hold more. Each
rank runs one step of m >> p micro-batches with every sent tensor tracked by a weak reference
(tests/integration/helpers/sends_rank.py).
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
HELPER = Path(__file__).parent / "helpers" / "sends_rank.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
def test_a_step_keeps_o_p_sent_tensors_alive_not_o_m(tmp_path: Path) -> None:
    layout = Layout.parse("pp=2,tp=1,dp=1")
    m = 32
    plan = build_plan(
        MODEL,
        ClusterSpec.uniform(1, layout.world_size, load_device_spec("cpu")),
        layout,
        global_batch=m,
        micro_batch=1,
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
    for r in range(layout.world_size):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        # Stage 0 sends m activations, stage 1 m input gradients: the counting saw them all.
        assert got["sent"] == m, (r, got)
        # Each send is waited on and dropped before the next op, so at most one is alive.
        assert got["peak_alive"] <= layout.pp, (r, got)
