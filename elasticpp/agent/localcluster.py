"""A whole elastic job on one machine: a local etcd and N agent processes, each a "node".

Used by `elasticpp demo`, the integration tests and `bench/recovery.py`. Killing a node
means what it means on a real cluster: SIGKILL of the agent and every worker it started,
with no chance to clean up. `close()` kills everything this object started, whatever
state it is in, so a failing test or a Ctrl-C leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticpp.cluster.etcd.server import EtcdServer, ServerTLS
from elasticpp.errors import ElasticppError
from elasticpp.proctree import descendants, worker_processes
from elasticpp.waiting import wait_until


class LocalClusterError(ElasticppError):
    pass


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    for p in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


@dataclass
class Node:
    node_id: str
    state_dir: Path
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    metrics_port: int = 0
    log_path: Path = field(default_factory=Path)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIXED_PORTS_LOW = 10_000  # chosen ports come from here up to the ephemeral range


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


_HANDED_OUT: set[int] = set()  # ports `free_ports` chose in this process (see there)
_HANDED_OUT_LOCK = threading.Lock()


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports for processes started later, below the kernel's
    ephemeral range: a port the kernel hands out (a client's outgoing connection, a bind to
    port 0) is never one of them, so none is taken between this check and the agent's bind
    (an agent exited "address already in use" when a connection took its metrics port in
    that gap). Each is checked free and held while the others are chosen, and a port this
    process chose before is not chosen again while others are left: the agent of the node
    started first may not have bound its ports yet when the next node's are chosen (an
    agent exited "address already in use" for a port another node of its cluster had
    been given a moment later)."""
    import random
    import socket

    low, _ = _ephemeral_range()
    if low - FIXED_PORTS_LOW < 10 * count:  # no room below it: let the kernel choose
        candidates: list[int] = [0] * count
    else:
        candidates = random.sample(range(FIXED_PORTS_LOW, low), min(low - FIXED_PORTS_LOW, 256))
        with _HANDED_OUT_LOCK:
            fresh = [p for p in candidates if p not in _HANDED_OUT]
            if len(fresh) < 2 * count:  # nearly all handed out once: start over
                _HANDED_OUT.clear()
                fresh = candidates
        candidates = fresh
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(int(s.getsockname()[1]))
            if len(ports) == count:
                with _HANDED_OUT_LOCK:
                    _HANDED_OUT.update(ports)
                return ports
    finally:
        for s in socks:
            s.close()
    raise LocalClusterError(f"no {count} free loopback ports below {low}")


class LocalCluster:
    def __init__(
        self,
        workdir: Path,
        spec: dict[str, Any],
        *,
        nodes: int = 4,
        slots: int = 2,
        python: str = sys.executable,
        cgroup_root: Path | None = None,
        device: str = "cpu",
        etcd_tls: ServerTLS | None = None,
        agent_args: Sequence[str] = (),
    ) -> None:
        """`cgroup_root` (a cgroup v2 directory, optional): each node's agent starts in
        `cgroup_root/<node id>`, and its workers with it, so that a harness can act on one
        node's processes and sockets at once (a firewall rule that partitions it).
        `etcd_tls`: etcd speaks TLS only (the agents reach it at https://, given their
        `--etcd-*` flags in `agent_args`, which every agent's command line ends with;
        `{node}` in one of them is the node's id: its certificate's path, say)."""
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.spec_path = workdir / "job.yaml"
        self.spec_path.write_text(json.dumps(spec, indent=1))  # JSON is valid YAML
        self.spec = spec
        self.slots = slots
        self.python = python
        self.etcd = EtcdServer(workdir / "etcd-data", tls=etcd_tls)
        self.agent_args = tuple(agent_args)
        self.nodes = [Node(f"node-{i}", workdir / f"node-{i}") for i in range(nodes)]
        self.cgroup_root = cgroup_root
        self.device = device  # the agents' --device: cpu (gloo) or cuda (NCCL, a GPU a slot)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.etcd.start()
        for n in self.nodes:
            self.start_node(n.node_id)

    def node(self, node_id: str) -> Node:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise LocalClusterError(f"no node {node_id}")

    def start_node(
        self,
        node_id: str,
        *,
        env: dict[str, str] | None = None,
        state_dir: Path | None = None,
        args: Sequence[str] = (),
    ) -> Node:
        """Start `node_id`'s agent; `env` adds to its environment (and its workers'),
        `state_dir` replaces its state directory (a small file system, say), `args` end
        its command line (after the cluster's `agent_args`: a flag given again wins)."""
        n = self.node(node_id)
        if state_dir is not None:
            n.state_dir = state_dir
        n.port, n.metrics_port = free_ports(2)
        n.state_dir.mkdir(parents=True, exist_ok=True)
        n.log_path = self.workdir / f"{node_id}.log"
        with n.log_path.open("ab") as log:
            n.proc = subprocess.Popen(
                [
                    self.python,
                    "-m",
                    "elasticpp.cli.main",
                    "agent",
                    "--etcd",
                    f"https://{self.etcd.endpoint}" if self.etcd.tls else self.etcd.endpoint,
                    "--job-spec",
                    str(self.spec_path),
                    "--node-id",
                    node_id,
                    "--slots",
                    str(self.slots),
                    "--listen",
                    f"127.0.0.1:{n.port}",
                    "--state-dir",
                    str(n.state_dir),
                    "--device",
                    self.device,
                    "--metrics-port",
                    str(n.metrics_port),
                    *(a.replace("{node}", node_id) for a in self.agent_args),
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env} if env else None,
                start_new_session=True,
                preexec_fn=self._enter_cgroup(node_id),
            )
        return n

    def _enter_cgroup(self, node_id: str) -> Callable[[], None] | None:
        if self.cgroup_root is None:
            return None
        procs = self.cgroup_root / node_id / "cgroup.procs"
        procs.parent.mkdir(exist_ok=True)

        def enter() -> None:  # in the child, before exec: "0" moves the writer itself
            procs.write_text("0")

        return enter

    def kill_node(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """kill -9 the node: its agent and every worker it started, all at once."""
        n = self.node(node_id)
        if n.proc is None:
            return
        pids = [n.proc.pid, *descendants(n.proc.pid)]
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        if sig == signal.SIGKILL:
            n.proc.wait(timeout=10)

    def worker_pids(self, node_id: str) -> list[int]:
        """The node's worker processes, warm or training (not its worker template)."""
        n = self.node(node_id)
        return worker_processes(n.proc.pid) if n.proc and n.proc.poll() is None else []

    def metrics(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for n in self.nodes:
            path = n.state_dir / "metrics.jsonl"
            if path.is_file():
                for line in path.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        rows.append(json.loads(line))
        return rows

    def curve(self) -> dict[int, tuple[float, int]]:
        """step -> (loss, generation), the newest generation's report winning."""
        best: dict[int, tuple[float, int]] = {}
        for r in self.metrics():
            step, gen = int(r["step"]), int(r["generation"])
            if step not in best or gen > best[step][1]:
                best[step] = (float(r["loss"]), gen)
        return best

    def max_step(self) -> int:
        steps = [int(r["step"]) for r in self.metrics()]
        return max(steps) if steps else -1

    def wait_for(
        self,
        cond: Callable[[], bool],
        timeout_s: float,
        what: str,
        tick: Callable[[], None] | None = None,
    ) -> None:
        def each() -> None:
            if tick:
                tick()
            self.check_alive()

        if not wait_until(cond, timeout_s, interval_s=0.1, each=each):
            raise LocalClusterError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def check_alive(self) -> None:
        """Raise if an agent exited on its own (a clean exit 0 and a SIGKILL of a test's
        are not errors)."""
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() not in (None, 0, -signal.SIGKILL):
                raise LocalClusterError(
                    f"{n.node_id} agent exited with {n.proc.returncode}; see {n.log_path}"
                )

    def wait_finished(self, timeout_s: float, tick: Callable[[], None] | None = None) -> None:
        def finished() -> bool:
            return all(n.proc is None or n.proc.poll() is not None for n in self.nodes)

        self.wait_for(finished, timeout_s, "every agent to finish the job", tick)
        bad = [n for n in self.nodes if n.proc is not None and n.proc.returncode not in (0, -9)]
        if bad:
            raise LocalClusterError(
                ", ".join(
                    f"{n.node_id} exited {n.proc.returncode if n.proc else None}" for n in bad
                )
            )

    def timelines(self) -> list[dict[str, Any]]:
        from elasticpp.cluster.client import ClusterClient

        with ClusterClient([self.etcd.endpoint], str(self.spec["name"])) as c:
            values, _ = c.arrivals.barrier_state("timelines")
        return sorted(values.values(), key=lambda t: int(t["generation"]))

    def close(self) -> None:
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                kill_tree(n.proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    n.proc.wait(timeout=10)
            elif n.proc is not None:
                # The agent is gone; its workers must be too (they die with their parent).
                pass
        self.etcd.close()
