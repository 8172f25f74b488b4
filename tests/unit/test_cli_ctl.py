"""`elasticpp ctl` refuses bad flags (exit 2) and says which agent did not answer (exit 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elasticpp.cli.main", "ctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_bad_timeout_is_refused_with_exit_2() -> None:
    r = ctl("--timeout", "0", "status")
    assert r.returncode == 2 and "--timeout" in r.stderr and len(r.stderr.splitlines()) == 1


def test_an_unknown_action_is_refused_with_exit_2() -> None:
    r = ctl("reboot")
    assert r.returncode == 2 and "reboot" in r.stderr


def test_an_agent_that_does_not_answer_is_named() -> None:
    r = ctl("--agent", "127.0.0.1:1", "--timeout", "2", "status")
    assert r.returncode == 1 and "127.0.0.1:1" in r.stderr and "UNAVAILABLE" in r.stderr


def test_status_says_why_a_generation_waits_for_state(capsys: pytest.CaptureFixture[str]) -> None:
    from elasticpp.cli.ctl import _print_status
    from elasticpp.rpc.agent.v1 import agent_pb2

    why = "no committed state on any live node"
    _print_status(agent_pb2.GetStatusResponse(node_id="n1", phase="moving", waiting=why))
    assert f"waiting for state: {why}" in capsys.readouterr().out
    _print_status(agent_pb2.GetStatusResponse(node_id="n1", phase="running"))
    assert "waiting" not in capsys.readouterr().out
