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

import collections
import contextlib
import gc
import json
import logging
import os
import re
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elasticpp.agent.kernel.decide import Phase
from elasticpp.cluster.etcd.meter import MeterReading
from elasticpp.errors import ElasticppError

log = logging.getLogger("elasticpp.bench.scale")
REPLY_TIMEOUT_S = 120.0  # a child answers every request within this (adding agents included)
STACK_BYTES = 512 * 1024  # per thread: thousands of agent threads in one process


@dataclass(frozen=True)
class Summary:
    """What the harness polls of the simulated nodes (of one child, or merged over all):
    a few numbers, whatever the number of nodes, so that looking every few milliseconds
    does not load the processes it measures (each node's row, with its plan's node list,
    was ~400 KB a look at 256 nodes)."""

    leaders: tuple[str, ...] = ()  # live nodes that hold the leadership
    generation: int = 0  # the newest generation a live node follows (0: none yet)
    healthy: int = 0  # live nodes that are not sick
    min_generation: int | None = None  # the oldest generation a healthy node follows
    # generation -> healthy nodes following it that do not run it yet (not RUNNING or IDLE)
    unstarted: dict[int, int] = field(default_factory=dict)
    # Whether the node asked about (`summary(asked)`) is planned in the newest generation a
    # healthy node holds, `asked_gen` (None: none asked, or no healthy node holds a plan).
    asked_planned: bool | None = None
    asked_gen: int = -1

    def plus(self, other: Summary) -> Summary:
        mins = [g for g in (self.min_generation, other.min_generation) if g is not None]
        unstarted = dict(self.unstarted)
        for g, k in other.unstarted.items():
            unstarted[g] = unstarted.get(g, 0) + k
        generation = max(self.generation, other.generation)
        newer = self if self.asked_gen >= other.asked_gen else other
        return Summary(
            self.leaders + other.leaders,
            generation,
            self.healthy + other.healthy,
            min(mins) if mins else None,
            unstarted,
            newer.asked_planned,
            newer.asked_gen,
        )

    @property
    def leader(self) -> str | None:
        return self.leaders[0] if self.leaders else None

    def all_hold(self, generation: int) -> bool:
        """Every healthy node follows `generation` or a newer one."""
        return self.min_generation is None or self.min_generation >= generation

    def all_started(self, generation: int) -> bool:
        """Every healthy node holds `generation` and runs its ranks of it (or has none)."""
        return self.all_hold(generation) and self.unstarted.get(generation, 0) == 0


def _summary(cluster: Any, asked: str | None = None) -> Summary:
    leaders: list[str] = []
    generation, healthy, min_gen = 0, 0, None
    unstarted: dict[int, int] = {}
    asked_planned: bool | None = None
    asked_gen = -1
    for node_id, node in list(cluster.nodes.items()):
        if node_id in cluster.crashed:
            continue
        agent = node.agent
        gs = agent.follower.followed()
        g = gs.generation if gs else 0
        generation = max(generation, g)
        if agent.leader.acting():
            leaders.append(node_id)
        if node_id in cluster.sick:
            continue
        healthy += 1
        min_gen = g if min_gen is None else min(min_gen, g)
        if gs is None or gs.phase not in (Phase.RUNNING, Phase.IDLE):
            unstarted[g] = unstarted.get(g, 0) + 1
        if asked is not None and gs is not None and g > asked_gen:
            asked_planned, asked_gen = asked in gs.record.planned_nodes, g
    return Summary(
        tuple(leaders), generation, healthy, min_gen, unstarted, asked_planned, asked_gen
    )


def _held_at(cluster: Any, generation: int) -> list[float]:
    """When each live node of this process began following `generation` (monotonic: one
    clock for every process of the machine); nodes that follow another are left out."""
    out = []
    for node_id, node in list(cluster.nodes.items()):
        gs = node.agent.follower.followed()
        if node_id not in cluster.crashed and gs is not None and gs.generation == generation:
            out.append(gs.stop_began_s)
    return out


def _healthy(cluster: Any) -> list[str]:
    return [n for n in cluster.nodes if n not in cluster.crashed and n not in cluster.sick]


_IDS = re.compile(r"node-\d+|[0-9a-f]{12,}|\d+")


def thread_class(name: str) -> str:
    """A thread's name with node ids, lease ids and numbers left out: the threads of one
    kind, whichever node or pool slot they serve."""
    return _IDS.sub("#", name)


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's live threads, summed by `thread_class` (Python threads
    by name, the others, gRPC's own, by their kernel name). From each thread's schedstat
    (nanoseconds): the clock-tick counts of /proc/.../stat round a thread that runs a few
    milliseconds now and then to nothing, and thousands of them add up."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        task = Path("/proc/self/task") / tid
        try:
            comm = (task / "comm").read_text().strip()
            on_cpu_ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        kind = thread_class(names.get(int(tid)) or comm)
        out[kind] = out.get(kind, 0.0) + on_cpu_ns / 1e9
    return out


class ThreadSampler:
    """`thread_cpu_s()` every `every_s` on a thread of its own, the last `keep` samples kept:
    what each kind of thread used in a window the harness names afterwards (`window`).
    Reading every thread's schedstat costs ~2 ms at a few hundred threads: off unless asked."""

    def __init__(self, every_s: float, keep: int = 20_000) -> None:
        self._every_s = every_s
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, dict[str, float]]] = collections.deque(
            maxlen=keep
        )
        self._stop = threading.Event()
        self._sample()  # one now: a window that starts after this has a sample before it
        self._thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        sample = (time.monotonic(), thread_cpu_s())
        with self._lock:
            self._samples.append(sample)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self._sample()

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds by kind of thread from the last sample at or before `t0` to the first
        at or after `t1` (a window a sample wider at most); empty if not sampled around it."""
        with self._lock:
            samples = list(self._samples)
        before = [cpu for t, cpu in samples if t <= t0]
        after = [cpu for t, cpu in samples if t >= t1]
        if not before or not after:
            return {}
        a, b = before[-1], after[0]
        return {k: v - a.get(k, 0.0) for k, v in b.items() if v - a.get(k, 0.0) > 0}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _serve(
    endpoint: str,
    slots: int,
    state_root: str,
    spec: dict[str, Any],
    share: bool,
    loop_threads: int,
    agents_per_connection: int = 0,
    shared_server: bool = True,
    parked_threads: int = 0,
    sample_threads_s: float = 0.0,
    profile_turns: str = "",
) -> None:
    """A child process: a SimCluster of the agents it is asked to add, until told to close."""
    threading.stack_size(STACK_BYTES)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness's Ctrl-C closes us in order
    from bench.scalesim import SimCluster
    from elasticpp.agent.jobspec import parse_job_spec
    from elasticpp.cluster.etcd.meter import EtcdMeter

    out = sys.stdout
    sys.stdout = sys.stderr  # replies alone go to the harness
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    meter = EtcdMeter()
    cluster = SimCluster(
        endpoint,
        [],
        slots,
        Path(state_root),
        parse_job_spec(spec),
        meter,
        share_etcd=share,
        agents_per_connection=agents_per_connection,
        loop_threads=loop_threads,
        shared_server=shared_server,
        parked_threads=parked_threads,
        profile_turns=Path(profile_turns) if profile_turns else None,
    )
    sampler = ThreadSampler(sample_threads_s) if sample_threads_s > 0 else None
    try:
        for line in sys.stdin:
            request = json.loads(line)
            op, arg = request["op"], request.get("arg")
            reply: dict[str, Any]
            try:
                if op == "add":
                    t0 = time.monotonic()
                    for node_id in arg:
                        cluster.add(node_id)
                    if len(arg) > 1:
                        log.warning("%d agents started in %.1f s", len(arg), time.monotonic() - t0)
                        # What the agents built to start is theirs for good: out of the
                        # cyclic collector's sight. A full collection of one heap holding
                        # 1,024 agents took 0.35-0.42 s of the GIL at the end of their start
                        # (a real agent's heap is one agent's); one in a transition stalls
                        # every agent of the process at once.
                        gc.freeze()
                    reply = {"ok": None}
                elif op == "crash":
                    cluster.crash(arg)
                    reply = {"ok": None}
                elif op == "sick":
                    cluster.make_sick(arg)
                    reply = {"ok": None}
                elif op == "summary":
                    reply = {"ok": asdict(_summary(cluster, arg))}
                elif op == "held_at":
                    reply = {"ok": _held_at(cluster, int(arg))}
                elif op == "healthy":
                    reply = {"ok": _healthy(cluster)}
                elif op == "meter":
                    r = resource.getrusage(resource.RUSAGE_SELF)
                    cpu_s = r.ru_utime + r.ru_stime
                    reply = {"ok": [asdict(meter.reading()), meter.by_kind(), cpu_s]}
                elif op == "threads":
                    reply = {"ok": thread_cpu_s()}
                elif op == "thread_window":
                    reply = {"ok": sampler.window(*arg) if sampler is not None else {}}
                elif op == "loop_cpu":
                    reply = {"ok": cluster.loop_cpu_s(arg)}
                elif op == "close":
                    break
                else:
                    reply = {"error": f"unknown request {op!r}"}
            except Exception as exc:  # said to the harness, which raises it
                reply = {"error": f"{op} {arg!r}: {exc!r}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        if sampler is not None:
            sampler.close()
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
        agents_per_connection: int = 0,
        loop_threads: int = 0,
        shared_server: bool = True,
        parked_threads: int = 0,
        sample_threads_s: float = 0.0,
        profile_turns: Path | None = None,
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
                    "agents_per_connection": agents_per_connection,
                    "loop_threads": loop_threads,
                    "shared_server": shared_server,
                    "parked_threads": parked_threads,
                    "sample_threads_s": sample_threads_s,
                    "profile_turns": str(profile_turns or ""),
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
    def summary(self, asked: str | None = None) -> Summary:
        """Every child's summary, merged; `asked`: a node whose place in the newest plan to
        report (`Summary.asked_planned`)."""
        total = Summary()
        for r in self._ask_all("summary", asked):
            unstarted = {int(g): int(k) for g, k in r.pop("unstarted").items()}
            total = total.plus(
                Summary(
                    leaders=tuple(r.pop("leaders")),
                    unstarted=unstarted,
                    **r,
                )
            )
        return total

    def held_at(self, generation: int) -> list[list[float]]:
        """Per child, when each of its nodes began following `generation` (`_held_at`)."""
        return [list(map(float, times)) for times in self._ask_all("held_at", generation)]

    def healthy(self) -> list[str]:
        """The live, healthy nodes, in the order they were added."""
        found = {n for ids in self._ask_all("healthy") for n in ids}
        return [n for n in self._home if n in found]

    def count(self) -> int:
        return len(self._home)

    def loop_cpu_s(self, node_id: str) -> float:
        return float(self._ask(self._home[node_id], "loop_cpu", node_id))

    def pids(self) -> list[int]:
        """The simulation processes' pids, in child order."""
        return [child.pid for child in self._children]

    def meter(self) -> tuple[MeterReading, dict[str, int], float]:
        """Every child's etcd meter together, its requests by kind, and its CPU seconds."""
        total, kinds, cpu = MeterReading(), {}, 0.0
        for reading, by_kind, cpu_s in self._ask_all("meter"):
            total = total.plus(MeterReading(**reading))
            for k, v in by_kind.items():
                kinds[k] = kinds.get(k, 0) + v
            cpu += cpu_s
        return total, kinds, cpu

    def thread_window(self, t0: float, t1: float) -> dict[str, float]:
        """Every child's CPU seconds by kind of thread from monotonic `t0` to `t1`, added up
        (`ThreadSampler.window`; empty unless the children sample their threads)."""
        out: dict[str, float] = {}
        for by_kind in self._ask_all("thread_window", [t0, t1]):
            for k, v in by_kind.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def thread_cpu_s(self) -> dict[str, float]:
        """Every child's CPU seconds by kind of thread (`thread_class`), added up."""
        out: dict[str, float] = {}
        for by_kind in self._ask_all("threads"):
            for k, v in by_kind.items():
                out[k] = out.get(k, 0.0) + v
        return out

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


if __name__ == "__main__":
    _config = json.loads(sys.argv[1])
    _serve(
        _config["endpoint"],
        int(_config["slots"]),
        _config["state_root"],
        _config["spec"],
        bool(_config["share"]),
        int(_config.get("loop_threads", 0)),
        int(_config.get("agents_per_connection", 0)),
        bool(_config.get("shared_server", True)),
        int(_config.get("parked_threads", 0)),
        float(_config.get("sample_threads_s", 0.0)),
        str(_config.get("profile_turns", "")),
    )
