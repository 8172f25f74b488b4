"""`-o table|json|yaml` (elasticpp.cli.output): every command that prints a result prints it
as a table, JSON or YAML, with every field and numbers as numbers. `ctl` against a real gRPC
server on port 0 that answers like an agent."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import yaml

from elasticpp.cli import main as cli_main
from elasticpp.cli.output import proto_dict, render
from elasticpp.rpc.agent.v1 import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def _status() -> agent_pb2.GetStatusResponse:
    return agent_pb2.GetStatusResponse(
        node_id="n1",
        job="llm",
        generation=3,
        leader="n1",
        phase="running",
        layout="pp=1,tp=1,dp=2",
        last_step=83,
        members=["n1", "n2"],
        workers=[
            agent_pb2.WorkerStatus(rank=0, pid=11, state="running", last_step=83),
            agent_pb2.WorkerStatus(rank=1, dp=1, pid=12, state="running", last_step=83),
        ],
        recoveries=[agent_pb2.Recovery(generation=1, reason="join of n2", layout_after="pp=1")],
    )


class _Agent(agent_pb2_grpc.AgentServiceServicer):
    def GetStatus(self, request: Any, context: Any) -> Any:
        return _status()

    def Drain(self, request: Any, context: Any) -> Any:
        return agent_pb2.DrainResponse(accepted=True, message=f"draining ({request.timeout_s})")

    def LiftQuarantine(self, request: Any, context: Any) -> Any:
        return agent_pb2.LiftQuarantineResponse(lifted=True, message=f"{request.node_id} lifted")

    def WatchEvents(self, request: Any, context: Any) -> Iterator[Any]:
        yield agent_pb2.AgentEvent(time=1.5, kind="decision", message="plan", generation=0)
        yield agent_pb2.AgentEvent(time=2.5, kind="worker", message="up", generation=4)


@pytest.fixture(scope="module")
def agent() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    agent_pb2_grpc.add_AgentServiceServicer_to_server(_Agent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def _ctl(capsys: pytest.CaptureFixture[str], agent: str, *args: str) -> tuple[int, str]:
    code = cli_main.main(["ctl", "--agent", agent, *args])
    return code, capsys.readouterr().out


def test_a_proto_becomes_plain_data_with_every_field_and_int64_as_numbers() -> None:
    d = proto_dict(_status())
    assert d["generation"] == 3 and d["last_step"] == 83  # numbers, not "3" and "83"
    rank0 = d["workers"][0]
    assert rank0["rank"] == 0 and rank0["pp"] == 0 and rank0["tp"] == 0  # zeros are there
    assert d["recoveries"][0]["resume_step"] == 0 and d["recoveries"][0]["layout_before"] == ""
    assert d["ended"] == "" and d["quarantined"] == []


def test_json_and_yaml_say_the_same_thing() -> None:
    value = {"b": [1, 2.5, None], "a": {"x": "y", "z": True}}
    assert json.loads(render(value, "json", str)) == value
    assert yaml.safe_load(render(value, "yaml", str)) == value
    with pytest.raises(ValueError, match="unknown output format"):
        render(value, "xml", str)


@pytest.mark.parametrize("how", [["-o", "json"], ["--output", "json"], ["--json"]])
def test_ctl_status_as_json_keeps_numbers_and_zeros(
    capsys: pytest.CaptureFixture[str], agent: str, how: list[str]
) -> None:
    code, out = _ctl(capsys, agent, "status", *how)
    assert code == 0
    assert json.loads(out) == proto_dict(_status())


def test_ctl_status_as_yaml_and_as_a_table(capsys: pytest.CaptureFixture[str], agent: str) -> None:
    code, out = _ctl(capsys, agent, "status", "-o", "yaml")
    assert code == 0 and yaml.safe_load(out) == proto_dict(_status())
    code, out = _ctl(capsys, agent, "status")
    assert code == 0 and out.startswith("node n1  job llm  generation 3")


@pytest.mark.parametrize("fmt", ["json", "yaml", "table"])
def test_ctl_drain_lift_and_events_print_in_every_format(
    capsys: pytest.CaptureFixture[str], agent: str, fmt: str
) -> None:
    def parse(text: str) -> Any:
        return json.loads(text) if fmt == "json" else yaml.safe_load(text)

    code, out = _ctl(capsys, agent, "drain", "--wait", "7", "-o", fmt)
    assert code == 0
    want = {"accepted": True, "message": "draining (7.0)"}
    assert (out.strip() == want["message"]) if fmt == "table" else parse(out) == want
    code, out = _ctl(capsys, agent, "lift", "n2", "-o", fmt)
    want = {"lifted": True, "message": "n2 lifted"}
    assert code == 0
    assert (out.strip() == want["message"]) if fmt == "table" else parse(out) == want
    code, out = _ctl(capsys, agent, "events", "-o", fmt)
    assert code == 0
    if fmt == "table":
        assert out.splitlines() == ["1.500 gen=0 decision: plan", "2.500 gen=4 worker: up"]
        return
    items = (
        [json.loads(line) for line in out.splitlines()]  # JSON Lines: one object a line
        if fmt == "json"
        else list(yaml.safe_load_all(out))
    )
    assert items == [
        {"time": 1.5, "kind": "decision", "message": "plan", "generation": 0},
        {"time": 2.5, "kind": "worker", "message": "up", "generation": 4},
    ]


def test_plan_prints_the_same_object_as_json_and_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "gpt-1.3b", "--nodes", "2", "--global-batch", "64", "--top", "2"]
    outs = {}
    for how in (["-o", "json"], ["--json"], ["-o", "yaml"]):
        assert cli_main.main([*args, *how]) == 0
        outs[how[-1]] = capsys.readouterr().out
    assert json.loads(outs["json"]) == json.loads(outs["--json"]) == yaml.safe_load(outs["yaml"])
    assert len(json.loads(outs["json"])["alternatives"]) == 2
    assert cli_main.main(args) == 0
    assert "est. step time" in capsys.readouterr().out


def test_every_command_that_prints_a_result_takes_o() -> None:
    parser, _ = cli_main.build_parser({})
    takes = {
        ("ctl", "status"), ("ctl", "drain"), ("ctl", "events"), ("ctl", "lift"),
        ("job", "status"), ("job", "nodes"), ("job", "reset"), ("job", "delete"),
        ("job", "whatif"), ("plan",), ("data", "prepare"), ("export",),
    }  # fmt: skip
    for command in takes:
        sub = parser
        for word in command:
            [subparsers] = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
            sub = subparsers.choices[word]
        [action] = [a for a in sub._actions if "--output" in a.option_strings]
        assert tuple(action.choices) == ("table", "json", "yaml"), command
