"""`--log-format json`: one JSON object a line, traceback included, from a real agent
process against a real etcd."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from elasticpp.logfmt import JsonFormatter


def test_a_record_is_one_json_line_with_its_traceback() -> None:
    try:
        raise RuntimeError("disk full")
    except RuntimeError:
        record = logging.LogRecord(
            "elasticpp.agent", logging.ERROR, __file__, 1, "step %d: %s", (7, "boom"),
            sys.exc_info(),
        )  # fmt: skip
    line = JsonFormatter("n3").format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert out["level"] == "ERROR" and out["logger"] == "elasticpp.agent"
    assert out["node_id"] == "n3" and out["message"] == "step 7: boom"
    assert out["time"].endswith("Z") and "T" in out["time"]
    assert "RuntimeError: disk full" in out["exception"]


def test_a_live_agent_logs_json_lines(tmp_path: Path, etcd: Any) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: j\nmodel: tiny\nglobal_batch: 4\nmicro_batch: 2\nsteps: 2\nseed: 0\n"
        "min_nodes: 2\nmax_nodes: 2\n"  # it waits for a second node: no training here
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "elasticpp.cli.main", "agent", "--etcd", etcd.endpoint,
         "--job-spec", str(spec), "--node-id", "n0", "--state-dir", str(tmp_path / "s"),
         "--device", "cpu", "--slots", "1", "--listen", "127.0.0.1:0", "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert agent.stderr is not None
        lines = []
        for line in agent.stderr:
            lines.append(json.loads(line))  # every line is one JSON object
            if "joined job j" in lines[-1]["message"]:
                break
        assert lines[-1]["node_id"] == "n0" and lines[-1]["logger"] == "elasticpp.agent"
    finally:
        agent.terminate()
        agent.wait(timeout=60)
    bad = subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "agent", "--log-format", "xml"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "--log-format" in bad.stderr
