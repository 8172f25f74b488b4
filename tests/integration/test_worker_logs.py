"""Worker output where operators look, against live agents: a worker's traceback reaches the
agent's stdout (what `kubectl logs` and journald show) prefixed `[gen G rank R]`, the
agent's log and the failure event (`ctl events`) carry its tail, the assignment's own log
file is named by generation and rank, and the failure's log is kept outside the rotation;
the same live agent's metrics count the job's samples and tokens."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from elasticpp.agent.localcluster import LocalCluster

FAILING_MODEL = """
import os
from dataclasses import replace
from pathlib import Path

import byte_conv


def build(options):
    marker = Path(options["marker"])
    model = byte_conv.build({k: v for k, v in options.items() if k != "marker"})
    calls = [0]

    def failing(forward):
        def run(ctx, p, x):
            calls[0] += 1
            if calls[0] == 3 and not marker.exists():  # once in the job, on whichever node
                marker.write_text(os.environ.get("ELASTICPP_NODE_ID", "?"))
                raise RuntimeError("injected failure in a forward pass")
            return forward(ctx, p, x)
        return run

    def wrap(units):
        return tuple(replace(u, forward=failing(u.forward)) for u in units)

    return replace(model, first=wrap(model.first), blocks=wrap(model.blocks), last=wrap(model.last))
"""

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.mark.timeout(240)
def test_a_failed_workers_traceback_reaches_the_agents_stdout_log_events_and_kept_file(
    tmp_path: Path,
) -> None:
    from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc
    from elasticpp.transport import Dialer

    models = tmp_path / "models"
    models.mkdir()
    (models / "user_fail.py").write_text(FAILING_MODEL)
    marker = tmp_path / "raised"
    spec = {
        "name": "logjob", "model": "user_fail:build",
        "model_options": {"marker": str(marker), "depth": 2},
        "global_batch": 4, "micro_batch": 2, "steps": 100_000, "seed": 0,
        "min_nodes": 1, "max_nodes": 2, "lease_ttl_s": 3, "snapshot_every": 2,
        "replication_copies": 0,
    }  # fmt: skip
    lc = LocalCluster(tmp_path / "job", spec, nodes=2, slots=1)
    pythonpath = os.pathsep.join([str(models), str(EXAMPLES)])
    try:
        lc.etcd.start()
        for n in lc.nodes:
            lc.start_node(n.node_id, env={"PYTHONPATH": pythonpath})
        lc.wait_for(marker.exists, 180, "the injected failure")
        failed_at = lc.max_step()
        lc.wait_for(lambda: lc.max_step() >= failed_at + 3, 180, "training again after it")
        node = lc.node(marker.read_text())
        assert node.log_path is not None
        out = node.log_path.read_text()  # the agent's stdout and stderr
        match = re.search(
            r"worker rank (\d+) of generation (\d+) exited with code 1 \(log: (\S+)\); "
            r"its last lines:\n",
            out,
        )
        assert match, out[-3000:]
        rank, generation, kept = int(match.group(1)), int(match.group(2)), Path(match.group(3))
        prefix = f"[gen {generation} rank {rank}] "
        tee = [line[len(prefix) :] for line in out.splitlines() if line.startswith(prefix)]
        assert "Traceback (most recent call last):" in tee, tee[-20:]
        assert "RuntimeError: injected failure in a forward pass" in tee
        # The tail in the agent's own log line, the assignment's file, the kept copy.
        assert "RuntimeError: injected failure in a forward pass" in out[match.end() :]
        own = node.state_dir / "logs" / f"gen-{generation:06d}" / f"rank-{rank:04d}.log"
        assert "Traceback (most recent call last):" in own.read_text()
        assert kept.parent == node.state_dir / "logs" / "failures"
        assert kept.read_text() == own.read_text()
        # The failure event, as `ctl events` streams it.
        channel = Dialer().channel(node.address)
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        seen = []
        deadline = time.monotonic() + 30
        try:
            for event in stub.WatchEvents(agent_pb2.WatchEventsRequest(), timeout=30):
                seen.append(event.message)
                if "injected failure" in event.message or time.monotonic() > deadline:
                    break
        finally:
            channel.close()
        assert "injected failure in a forward pass" in seen[-1], seen[-5:]
        assert f"rank {rank} of generation {generation} exited with code 1" in seen[-1]
        # What operators chart beside it, scraped from the live agent: tokens and samples
        # (a step is the global batch of 4 samples x seq_len 32), the target, the build.
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics").read()
        values = {
            (s.name, s.labels.get("version", "")): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples
        }
        samples = values[("elasticpp_samples_total", "")]
        assert samples >= 4 * 3 and values[("elasticpp_tokens_total", "")] == samples * 32
        assert values[("elasticpp_target_steps", "")] == 100_000
        assert values[("elasticpp_build_info", __import__("elasticpp").__version__)] == 1
    finally:
        lc.close()
