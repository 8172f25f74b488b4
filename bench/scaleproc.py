"""Simulated nodes spread over several processes (bench/scale.py): a `SimCluster` in each
child process (`python -m bench.scaleproc`), driven by a `ProcCluster` in the harness over the
child's stdin and stdout, one JSON request and one JSON reply per line; the harness asks what
it asks of one cluster (who leads, which generation every node holds and runs, faults, the
etcd meter and the CPU used). One Python process runs its agents' loops under one GIL;
children let the simulation use every core of the machine.

Invariants: children are new processes (no fork of a process that holds gRPC channels) and
read nothing but JSON; each child owns every agent and thread it starts and stops them all
when told to close, when its stdin ends (the harness died) or on SIGTERM;
`ProcCluster.close()` waits for every child and kills one that does not end, so no process
outlives the run. Node ids are placed on children round-robin in the order they are added.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elasticpp.agent.decide import Phase
from elasticpp.cluster.etcd_meter import MeterReading
from elasticpp.errors import ElasticppError

REPLY_TIMEOUT_S = 120.0  # a child answers every request within this (adding agents included)
STACK_BYTES = 512 * 1024  # per thread: thousands of agent threads in one process


@dataclass(frozen=True)
class NodeRow:
    """One simulated node as its child process sees it."""

    node_id: str
    generation: int  # of the record it follows, 0 before any
    phase: str  # its phase in that generation ("" before any)
    leader: bool
    crashed: bool
    sick: bool
    planned: tuple[str, ...]  # the nodes with ranks in its generation's plan


def _rows(cluster: Any) -> list[NodeRow]:
    rows = []
    for node_id, node in list(cluster.nodes.items()):
        agent = node.agent
        gs = agent._fs.gen
        crashed = node_id in cluster.crashed
        rows.append(
            NodeRow(
                node_id,
                gs.generation if gs else 0,
                str(gs.phase) if gs else "",
                not crashed and agent._is_leader(),
                crashed,
                node_id in cluster.sick,
                tuple(sorted(gs.record.planned_nodes)) if gs else (),
            )
        )
    return rows


def _serve(endpoint: str, slots: int, state_root: str, spec: dict[str, Any], share: bool) -> None:
    """A child process: a SimCluster of the agents it is asked to add, until told to close."""
    threading.stack_size(STACK_BYTES)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness's Ctrl-C closes us in order
    from bench.scalesim import SimCluster, thread_cpu_s
    from elasticpp.agent.jobspec import parse_job_spec
    from elasticpp.cluster.etcd_meter import EtcdMeter

    out = sys.stdout
    sys.stdout = sys.stderr  # replies alone go to the harness
    meter = EtcdMeter()
    cluster = SimCluster(
        endpoint, [], slots, Path(state_root), parse_job_spec(spec), meter, share_etcd=share
    )
    try:
        for line in sys.stdin:
            request = json.loads(line)
            op, arg = request["op"], request.get("arg")
            reply: dict[str, Any]
            try:
                if op == "add":
                    for node_id in arg:
                        cluster.add(node_id)
                    reply = {"ok": None}
                elif op == "crash":
                    cluster.crash(arg)
                    reply = {"ok": None}
                elif op == "sick":
                    cluster.make_sick(arg)
                    reply = {"ok": None}
                elif op == "rows":
                    reply = {"ok": [asdict(r) for r in _rows(cluster)]}
                elif op == "meter":
                    r = resource.getrusage(resource.RUSAGE_SELF)
                    cpu_s = r.ru_utime + r.ru_stime
                    reply = {"ok": [asdict(meter.reading()), meter.by_kind(), cpu_s]}
                elif op == "loop_cpu":
                    node = cluster.nodes.get(arg)
                    reply = {"ok": thread_cpu_s(node.thread) if node is not None else 0.0}
                elif op == "close":
                    break
                else:
                    reply = {"error": f"unknown request {op!r}"}
            except Exception as exc:  # said to the harness, which raises it
                reply = {"error": f"{op} {arg!r}: {exc!r}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        cluster.close()


class ProcCluster:
    """`len(node_ids)` simulated agents over `processes` child processes."""

    def __init__(
        self,
        endpoint: str,
        node_ids: list[str],
        slots: int,
        state_root: Path,
        spec: dict[str, Any],
        processes: int,
        *,
        share_etcd: bool = True,
    ) -> None:
        if processes < 1:
            raise ElasticppError(f"processes must be >= 1, got {processes}")
        self._children: list[subprocess.Popen[str]] = []
        self._home: dict[str, int] = {}  # node id -> child index
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        try:
            for i in range(processes):
                config = {
                    "endpoint": endpoint,
                    "slots": slots,
                    "state_root": str(state_root / f"proc-{i}"),
                    "spec": spec,
                    "share": share_etcd,
                }
                self._children.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "bench.scaleproc", json.dumps(config)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        cwd=root,
                        env=env,
                    )
                )
            self.add(node_ids)
        except BaseException:
            self.close()
            raise

    def _send(self, child: int, op: str, arg: Any = None) -> None:
        stdin = self._children[child].stdin
        assert stdin is not None
        stdin.write(json.dumps({"op": op, "arg": arg}) + "\n")
        stdin.flush()

    def _reply(self, child: int, op: str, timeout_s: float = REPLY_TIMEOUT_S) -> Any:
        proc = self._children[child]
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise ElasticppError(f"simulation process {proc.pid}: no answer to {op}")
        reply = json.loads(line)
        if "error" in reply:
            raise ElasticppError(f"simulation process {proc.pid}: {reply['error']}")
        return reply["ok"]

    def _ask(self, child: int, op: str, arg: Any = None) -> Any:
        self._send(child, op, arg)
        return self._reply(child, op)

    def _ask_all(self, op: str, arg: Any = None) -> list[Any]:
        for child in range(len(self._children)):
            self._send(child, op, arg)
        return [self._reply(child, op) for child in range(len(self._children))]

    # ------------------------------------------------------------------ faults
    def add(self, node_ids: list[str]) -> None:
        """Start agents for `node_ids` (round-robin over the children, in parallel)."""
        per: dict[int, list[str]] = {}
        for node_id in node_ids:
            child = len(self._home) % len(self._children)
            self._home[node_id] = child
            per.setdefault(child, []).append(node_id)
        for child, ids in per.items():
            self._send(child, "add", ids)
        for child in per:
            self._reply(child, "add", REPLY_TIMEOUT_S + len(node_ids))

    def crash(self, node_id: str) -> None:
        self._ask(self._home[node_id], "crash", node_id)

    def make_sick(self, node_id: str) -> None:
        self._ask(self._home[node_id], "sick", node_id)

    # ------------------------------------------------------------------ what the nodes hold
    def rows(self) -> list[NodeRow]:
        return [NodeRow(**r) for rows in self._ask_all("rows") for r in rows]

    def count(self) -> int:
        return len(self._home)

    def loop_cpu_s(self, node_id: str) -> float:
        return float(self._ask(self._home[node_id], "loop_cpu", node_id))

    def meter(self) -> tuple[MeterReading, dict[str, int], float]:
        """Every child's etcd meter together, its requests by kind, and its CPU seconds."""
        total, kinds, cpu = MeterReading(), {}, 0.0
        for reading, by_kind, cpu_s in self._ask_all("meter"):
            total = total.plus(MeterReading(**reading))
            for k, v in by_kind.items():
                kinds[k] = kinds.get(k, 0) + v
            cpu += cpu_s
        return total, kinds, cpu

    def close(self) -> None:
        for child, proc in enumerate(self._children):
            with contextlib.suppress(OSError, ValueError):
                self._send(child, "close")
                assert proc.stdin is not None
                proc.stdin.close()
        for proc in self._children:
            try:
                proc.wait(timeout=120.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._children = []


def rows_leader(rows: list[NodeRow]) -> NodeRow | None:
    return next((r for r in rows if r.leader), None)


def rows_generation(rows: list[NodeRow]) -> int:
    return max((r.generation for r in rows if not r.crashed), default=0)


def rows_all_hold(rows: list[NodeRow], generation: int) -> bool:
    return all(r.generation >= generation for r in rows if not (r.crashed or r.sick))


def rows_all_started(rows: list[NodeRow], generation: int) -> bool:
    """Every live healthy node holds `generation` and runs its ranks of it (or has none)."""
    for r in rows:
        if r.crashed or r.sick:
            continue
        if r.generation < generation:
            return False
        if r.generation == generation and r.phase not in (Phase.RUNNING, Phase.IDLE):
            return False
    return True


if __name__ == "__main__":
    _config = json.loads(sys.argv[1])
    _serve(
        _config["endpoint"],
        int(_config["slots"]),
        _config["state_root"],
        _config["spec"],
        bool(_config["share"]),
    )
