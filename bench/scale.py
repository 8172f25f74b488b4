"""The control plane at scale: N simulated nodes (the real agent with simulated workers,
bench/scalesim.py) against one real etcd on loopback, and what each transition costs.

    .venv/bin/python bench/scale.py --nodes 64,256 --faults loss,join,sick [--json out.json]

Per cluster size it starts a fresh etcd and N agents spread over `--processes` child
processes (bench/scaleproc.py; round-robin), waits until every node runs generation 1,
measures the steady state for `--steady-s` seconds, then applies each fault in turn and
measures the transition it causes:

- loss: a node (not the leader) crashes: its loop stops, its server stops answering, its lease
  is left to lapse (`lease_ttl_s`: 3 s, the smallest the agent accepts, up to 64 nodes; 10 s
  up to 512, 30 s beyond, `lease_ttl_for`);
- join: one more node starts and joins the job;
- sick: a node's workers die at once, and every one it starts dies as it starts, until the
  leader quarantines the node.

For each: the seconds from the fault to the leader's new generation record (seen by an observer
watch), to every node holding it and to every node reporting started (its ranks running); etcd
requests, bytes both ways and watch events from the fault until every node started (counted in
the agents' etcd client, elasticpp.cluster.etcd.meter); the largest value written and the
largest range reply of the run; the CPU seconds of the leader's loop thread, of the
simulation's processes and of the etcd server (also from the fault until every node holds the
plan, and from the decision until the last node held it: the hold's window, with how many
cores it used, bench/cpusample.py; by kind of thread with `--sample-threads-s`). The steady
state gives requests per node per second by kind (method and key class), the processes' CPU
per node per second and etcd's per second; the run, how many leader terms began
(a loop starved of CPU past its lease loses its term: the sign that the machine, not the
control plane, gave out). The observer's watch of the job's keys from revision 1 feeds the
invariant checker (bench/scaleinvariants.py) at the end of each size.

What is real: every agent's decision loop and parts, the executor, the etcd client and records,
the health service (liveness probes run over loopback gRPC; the agents of one process answer
on one shared server, each under its own name, `--server-per-node` gives each its own), the
node's LocalStore, the leader's TCPStore. Simulated: the workers (they answer at once and train
no steps), hence no snapshots, commits, replication or transfers and no `stepped-G` arrival:
every generation resumes at step 0, the leader's holdings pull has nothing to ask for, no
strike is cleared and the re-plan backoff is reset only by a graceful plan (a join), and
the safe-step invariant is not exercised here (tests/unit/test_scale_invariants.py checks it
on constructed histories). The agents of one process share etcd connections, one
for every `--agents-per-connection` (one watch stream and one keep-alive stream carry their
watches and leases; etcd serves the same watchers, leases and requests;
`--connection-per-node` gives each its own): idle gRPC streams poll, and thousands of them
fill a core. The agents' decision loops of one
process take turns on a pool of `--loop-threads` threads (bench/scaleloops.py; 0: a thread
each, as on a node), and the harness polls a summary of each process's nodes, a few numbers,
not their rows. The GIL and the cores of a small
machine bound how many agents fit and stretch every time measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpusample import CpuSampler, proc_cpu_s
from bench.scaleinvariants import HistoryEvent, check_history
from bench.scaleloops import merge_turn_profiles
from bench.scaleproc import ProcCluster, Summary
from bench.scalesim import sim_spec_fields
from elasticpp.cluster.etcd.kv import EtcdKV, WatchBatch, WatchItem
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.cluster.keys import JobKeys, prefix_end
from elasticpp.cluster.records import EventType
from elasticpp.errors import ElasticppError
from elasticpp.waiting import wait_until

JOB = "scale"
FAULTS = ("loss", "join", "sick")
POLL_S = 0.01  # how often the harness looks at the agents' generations
# Per process: the agents' loops take turns on a pool (bench/scaleloops.py). Two, not eight:
# fewer threads contending for the process's GIL (decide->hold at 512 nodes 0.64-0.87 s with
# 2, 1.12-1.41 s with 8; at 2,048, 3.6-4.5 s against 6.0-6.5 s with 8 and 5.6-8.4 s with 32).
LOOP_THREADS = 2
# More threads per process for turns waiting on an etcd round trip (bench/scaleloops.py): a
# node's request waits on its own, as on a real node, not behind the process's other turns.
PARKED_THREADS = 32
AGENTS_PER_CONNECTION = 64  # per shared etcd connection (bench/scalesim.py)


class Observer:
    """Every change under the job's keys from revision 1, with the time it was seen; reads
    only, on a client of its own that the meter does not count."""

    def __init__(self, endpoint: str) -> None:
        self._kv = EtcdKV([endpoint])
        self._lock = threading.Lock()
        self.events: list[tuple[float, HistoryEvent]] = []
        self.key = JobKeys(JOB).generation
        root = JobKeys(JOB).root
        self._watch = self._kv.add_watch(root, prefix_end(root), 1, self._sink)

    def _sink(self, item: WatchItem) -> None:
        if not isinstance(item, WatchBatch):
            return
        now = time.monotonic()
        with self._lock:
            for ev in item.events:
                if ev.type is EventType.RESYNC:
                    continue
                value = None if ev.type is EventType.DELETE else ev.value
                self.events.append((now, HistoryEvent(ev.mod_revision, ev.key, value)))

    def first_after(self, since_s: float, key: str, pred: Any = None) -> float | None:
        """When a change of `key` satisfying `pred(value)` was first seen after `since_s`."""
        with self._lock:
            for at, ev in self.events:
                if at >= since_s and ev.key == key and (pred is None or pred(ev.value)):
                    return at
        return None

    def reasons_after(self, since_s: float) -> list[str]:
        """Why each generation written after `since_s` was made (the record's reason)."""
        with self._lock:
            seen = [ev.value for at, ev in self.events if at >= since_s and ev.key == self.key]
        out = []
        for value in seen:
            try:
                out.append(str(json.loads(value or "")["extra"].get("reason", "")))
            except (ValueError, KeyError, TypeError, AttributeError):
                out.append("unreadable")
        return out

    def terms(self) -> int:
        """How many leader terms began (the leader key created)."""
        with self._lock:
            keys = [ev for _, ev in self.events if ev.key == JobKeys(JOB).leader]
        held, count = False, 0
        for ev in keys:
            if ev.value is not None and not held:
                count += 1
            held = ev.value is not None
        return count

    def history(self) -> list[HistoryEvent]:
        with self._lock:
            return [ev for _, ev in self.events]

    def close(self) -> None:
        self._kv.cancel_watch(self._watch)
        self._kv.close()


@dataclass(frozen=True)
class Transition:
    nodes: int
    fault: str
    node: str
    generation: int
    decided_s: float | None  # fault -> the leader's generation record
    all_hold_s: float  # fault -> every node holds it
    all_started_s: float  # fault -> every node reports started
    # decision -> the last node holds it, by the nodes' own clocks (each node's monotonic
    # instant it began following the generation; one clock for the machine's processes), not
    # when the harness's poll saw it (`all_hold_s`, up to a poll and the children's answer late)
    decide_to_hold_s: float | None
    # decision -> a node holds it: median and 90th percentile over the nodes, and the slowest
    # of each simulation process (which process lags, or all alike)
    hold_p50_s: float | None
    hold_p90_s: float | None
    hold_max_by_process_s: list[float]
    quarantined_s: float | None  # fault -> the node's quarantine record (sick)
    generations: int  # generations the fault caused
    reasons: list[str]  # each one's reason, as its record says
    error: str | None  # why it did not settle (then all_started_s is when the wait ended)
    etcd: dict[str, int]
    requests_per_node: float
    # what the transition added per node: its requests less the steady state's rate over
    # its window (a slow transition's window holds many keep-alives it did not cause)
    added_requests_per_node: float
    leader_cpu_s: float
    process_cpu_s: float
    requests_by_kind: dict[str, int]  # etcd requests by method and key class
    # the processes' CPU seconds by kind of thread (scaleproc.thread_class), busiest first
    cpu_s_by_thread: dict[str, float] = field(default_factory=dict)
    etcd_cpu_s: float | None = None  # the etcd server's CPU seconds, fault -> all started
    # CPU seconds from the fault until the harness saw every node hold the generation: the
    # etcd server's and the simulation processes' (what the hold's wait is made of)
    to_hold_cpu_s: dict[str, float] = field(default_factory=dict)
    # CPU seconds from the decision until the last node held the plan (`decide_to_hold_s`):
    # the etcd server's, the simulation processes' together, and `cores`, both over the
    # window's length (2.0 on this machine: every core busy, the hold waited for CPU)
    hold_window_cpu_s: dict[str, float] = field(default_factory=dict)
    # the processes' CPU in that window by kind of thread, busiest first (sampled, when asked)
    hold_window_by_thread: dict[str, float] = field(default_factory=dict)


def pid_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) process `pid` has used (Linux /proc); None if unknown."""
    return None if pid is None else proc_cpu_s(pid)


def _minus(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else round(after - before, 3)


def _generation_of(value: str | None) -> int:
    try:
        return int(json.loads(value or "")["generation"])
    except (ValueError, KeyError, TypeError):
        return 0


def transition(
    cluster: ProcCluster,
    observer: Observer,
    fault: str,
    timeout_s: float,
    poll_s: float,
    steady_requests_per_s: float = 0.0,
    etcd_pid: int | None = None,
    sampler: CpuSampler | None = None,
) -> Transition:
    """Apply `fault`, wait until every healthy node runs the generation it causes, measure
    (`steady_requests_per_s`: the steady state's etcd requests per second, all nodes;
    `etcd_pid`: the etcd server's process, whose CPU is measured too; `sampler`: samples
    the CPU of etcd ("etcd") and of each simulation process ("proc-<i>"))."""
    # Between transitions a leader may be changing (a loop stalled past its lease on a busy
    # machine steps down): the fault waits for one.
    now = [Summary()]
    asked: list[str | None] = [None]  # the sick node: is it planned still?

    def look(cond: Any) -> Any:
        def check() -> bool:
            now[0] = cluster.summary(asked[0])
            return bool(cond(now[0]))

        return check

    if not wait_until(look(lambda s: s.leader is not None), timeout_s, interval_s=poll_s):
        raise ElasticppError(f"no leader within {timeout_s:.0f} s before the fault")
    if not wait_until(look(lambda s: s.all_started(s.generation)), timeout_s):
        raise ElasticppError(f"nodes not all running within {timeout_s:.0f} s before the fault")
    leader = now[0].leader
    assert leader is not None
    g0 = now[0].generation
    healthy = cluster.healthy()
    n = len(healthy)
    keys = JobKeys(JOB)
    others = [node for node in healthy if node != leader]
    (before, kinds0, cpu0), lcpu0 = cluster.meter(), cluster.loop_cpu_s(leader)
    threads0 = cluster.thread_cpu_s()
    etcd0 = pid_cpu_s(etcd_pid)
    t0 = time.monotonic()
    if fault == "loss":
        victim = others[-1]
        cluster.crash(victim)
    elif fault == "join":
        victim = f"node-{cluster.count():05d}"
        cluster.add([victim])
    elif fault == "sick":
        victim = others[0]
        asked[0] = victim
        cluster.make_sick(victim)
    else:
        raise ElasticppError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")

    def settled(s: Summary) -> bool:
        if s.generation <= g0 or not s.all_started(s.generation):
            return False
        if fault == "sick":  # settled once quarantined and planned without the sick node
            quarantined = observer.first_after(t0, keys.quarantine(victim), lambda v: v)
            return quarantined is not None and s.asked_planned is False
        return True

    if not wait_until(look(lambda s: s.generation > g0), timeout_s, interval_s=poll_s):
        raise ElasticppError(f"{fault} of {victim}: no new generation in {timeout_s:.0f} s")
    if not wait_until(look(lambda s: s.all_hold(g0 + 1)), timeout_s, interval_s=poll_s):
        raise ElasticppError(f"{fault} of {victim}: not every node holds generation {g0 + 1}")
    t_hold = time.monotonic()
    _, _, cpu_hold = cluster.meter()
    etcd_hold = pid_cpu_s(etcd_pid)
    held_at = cluster.held_at(g0 + 1)  # now, before a next generation replaces it
    # Not settled in time is a result (reported with the generations' reasons), not an error.
    error = None
    if not wait_until(look(settled), timeout_s, interval_s=poll_s):
        error = f"{fault} of {victim}: not settled in {timeout_s:.0f} s"
    t_started = time.monotonic()
    after, kinds1, cpu1 = cluster.meter()
    etcd1 = pid_cpu_s(etcd_pid)
    by_thread = cpu_by_thread(threads0, cluster.thread_cpu_s())
    delta = after.minus(before)
    kinds = {k: v - kinds0.get(k, 0) for k, v in kinds1.items() if v > kinds0.get(k, 0)}
    decided = observer.first_after(t0, keys.generation, lambda v: _generation_of(v) > g0)
    quarantined = observer.first_after(t0, keys.quarantine(victim), lambda v: v)
    held = [[t - decided for t in times] for times in held_at] if decided else []
    spread = sorted(t for times in held for t in times)
    generation = now[0].generation
    window: dict[str, float] = {}
    window_threads: list[tuple[str, float]] = []
    if decided is not None and spread:
        if sampler is not None:
            window = _window_cpu(sampler, cluster.pids(), decided, decided + spread[-1])
        used = cluster.thread_window(decided, decided + spread[-1])
        window_threads = sorted(used.items(), key=lambda kv: -kv[1])[:16]
    return Transition(
        nodes=n,
        fault=fault,
        node=victim,
        generation=generation,
        decided_s=None if decided is None else round(decided - t0, 3),
        all_hold_s=round(t_hold - t0, 3),
        all_started_s=round(t_started - t0, 3),
        decide_to_hold_s=round(spread[-1], 3) if spread else None,
        hold_p50_s=round(_quantile(spread, 0.5), 3) if spread else None,
        hold_p90_s=round(_quantile(spread, 0.9), 3) if spread else None,
        hold_max_by_process_s=[round(max(times), 3) for times in held if times],
        quarantined_s=None if quarantined is None else round(quarantined - t0, 3),
        generations=generation - g0,
        reasons=observer.reasons_after(t0),
        error=error,
        etcd=asdict(delta),
        requests_per_node=round(delta.requests / n, 1),
        added_requests_per_node=round(
            (delta.requests - steady_requests_per_s * (t_started - t0)) / n, 1
        ),
        leader_cpu_s=round(cluster.loop_cpu_s(leader) - lcpu0, 3),
        process_cpu_s=round(cpu1 - cpu0, 3),
        etcd_cpu_s=_minus(etcd1, etcd0),
        to_hold_cpu_s={
            k: v
            for k, v in (("etcd", _minus(etcd_hold, etcd0)), ("processes", cpu_hold - cpu0))
            if v is not None
        },
        hold_window_cpu_s=window,
        hold_window_by_thread={k: round(v, 3) for k, v in window_threads},
        requests_by_kind=dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        cpu_s_by_thread={k: round(v, 3) for k, v in by_thread[:12]},
    )


def _window_cpu(sampler: CpuSampler, pids: list[int], t0: float, t1: float) -> dict[str, float]:
    """The CPU seconds etcd and the simulation processes used from `t0` to `t1`, and how
    many cores that was; empty if any was not sampled over the window."""
    etcd = sampler.used("etcd", t0, t1)
    procs = [sampler.used(f"proc-{i}", t0, t1) for i in range(len(pids))]
    if etcd is None or any(p is None for p in procs) or t1 <= t0:
        return {}
    total = etcd + sum(p for p in procs if p is not None)
    processes = total - etcd
    return {
        "etcd": round(etcd, 3),
        "processes": round(processes, 3),
        "cores": round(total / (t1 - t0), 2),
    }


def _quantile(ordered: list[float], q: float) -> float:
    """The `q` quantile of a sorted, non-empty list (the nearest rank)."""
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def cpu_by_thread(before: dict[str, float], after: dict[str, float]) -> list[tuple[str, float]]:
    """CPU seconds each kind of thread used between two `thread_cpu_s` readings, busiest
    first (threads that ended between them are left out)."""
    used = ((k, v - before.get(k, 0.0)) for k, v in after.items())
    return sorted(((k, v) for k, v in used if v > 0), key=lambda kv: -kv[1])


def lease_ttl_for(n: int) -> int:
    """The lease TTL of a simulated job of `n` nodes: 3 s (the smallest) up to 64 nodes, 10 s
    up to 512, 30 s beyond. A keep-alive goes every third of what the TTL leaves after the
    request timeout: 3 a second per node at 3 s, 0.45 at 10 s, 0.15 at 30 s (300 a second at
    2,048 nodes; Kubernetes renews a node's 40 s lease every 10 s, 0.1 a node a second). A
    node lost without a word is found when its lease lapses, so the TTL is also how long a
    silent loss takes to decide (docs/cluster.md, "Choosing the lease TTL")."""
    return 3 if n <= 64 else 10 if n <= 512 else 30


def run_size(
    n: int,
    faults: list[str],
    *,
    steady_s: float,
    slots: int,
    timeout_s: float,
    workdir: Path,
    processes: int = 1,
    lease_ttl_s: int | None = None,
    share_etcd: bool = True,
    agents_per_connection: int = AGENTS_PER_CONNECTION,
    loop_threads: int = LOOP_THREADS,
    shared_server: bool = True,
    parked_threads: int = PARKED_THREADS,
    sample_threads_s: float = 0.0,
    profile_turns: Path | None = None,
) -> dict[str, Any]:
    """One cluster of `n` nodes: start, steady state, each fault; the invariants checked
    (`sample_threads_s` > 0: the children sample their threads' CPU that often, and each
    transition gives the decision -> hold window's CPU by kind of thread; `profile_turns`:
    the agents' turns of the whole run are profiled, merged into `profile_turns/turns.prof`
    when the cluster closes)."""
    ttl = lease_ttl_s or lease_ttl_for(n)
    # Each look asks every child to summarise its nodes, on the child's main thread beside
    # its agents: at 512 nodes every 13 ms, a fifth of a transition's CPU; at 2,048 every
    # 50 ms, 11 s of the processes' CPU a transition. Every n/10,000 s, at most 0.2 s: the
    # decision -> hold times come from the nodes' own clocks, not from these looks.
    poll_s = min(0.2, max(POLL_S, n / 10_000))
    etcd = EtcdServer(workdir / f"etcd-{n}")
    etcd.start()
    cluster: ProcCluster | None = None
    observer: Observer | None = None
    try:
        t0 = time.monotonic()
        ids = [f"node-{i:05d}" for i in range(n)]
        # Children first: they are spawned before this process holds a gRPC channel.
        cluster = ProcCluster(
            etcd.endpoint,
            [],
            slots,
            workdir / f"nodes-{n}",
            sim_spec_fields(JOB, n, slots, ttl),
            processes,
            share_etcd=share_etcd,
            agents_per_connection=agents_per_connection,
            loop_threads=loop_threads,
            shared_server=shared_server,
            parked_threads=parked_threads,
            sample_threads_s=sample_threads_s,
            profile_turns=profile_turns,
        )
        observer = Observer(etcd.endpoint)
        cluster.add(ids)

        def running() -> bool:
            s = cluster.summary()  # type: ignore[union-attr]
            return s.generation > 0 and s.all_started(s.generation)

        if not wait_until(running, timeout_s, interval_s=poll_s):
            raise ElasticppError(f"{n} simulated nodes not all running within {timeout_s:.0f} s")
        started_s = time.monotonic() - t0
        r0, k0, c0 = cluster.meter()
        e0 = pid_cpu_s(etcd.pid)
        t_0 = cluster.thread_cpu_s()
        w0 = time.monotonic()
        time.sleep(steady_s)  # a measuring window, not a wait for a condition
        r1, k1, c1 = cluster.meter()
        e1 = pid_cpu_s(etcd.pid)
        t_1 = cluster.thread_cpu_s()
        steady = r1.minus(r0)
        window_s = time.monotonic() - w0
        steady_cpu = (c1 - c0) / window_s
        etcd_steady = None if e0 is None or e1 is None else round((e1 - e0) / window_s, 3)
        kinds = {k: v - k0.get(k, 0) for k, v in k1.items()}
        steady_kinds = {
            k: round(v / window_s / n, 2)
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
            if v > 0
        }
        by_thread = {k: round(v / window_s / n * 1000, 3) for k, v in cpu_by_thread(t_0, t_1)[:15]}
        steady_rate = steady.requests / window_s
        pids = {"etcd": etcd.pid, **{f"proc-{i}": p for i, p in enumerate(cluster.pids())}}
        sampler = CpuSampler({k: v for k, v in pids.items() if v is not None})
        try:
            transitions = [
                asdict(
                    transition(
                        cluster, observer, f, timeout_s, poll_s, steady_rate, etcd.pid, sampler
                    )
                )
                for f in faults
            ]
        finally:
            sampler.close()
        whole, _, _ = cluster.meter()
        violations = check_history(JOB, observer.history())
        return {
            "nodes": n,
            "slots": slots,
            "processes": processes,
            "lease_ttl_s": ttl,
            "share_etcd": share_etcd,
            "agents_per_connection": agents_per_connection if share_etcd else 1,
            "loop_threads": loop_threads,
            "parked_threads": parked_threads,
            "shared_server": shared_server,
            "start_s": round(started_s, 1),
            "steady": {
                "seconds": round(window_s, 1),
                "requests_per_s": round(steady.requests / window_s, 1),
                "requests_per_node_s": round(steady.requests / window_s / n, 2),
                "writes_per_node_s": round(steady.writes / window_s / n, 3),
                "prefix_reads_per_s": round(steady.prefix_reads / window_s, 1),
                "bytes_received_per_s": round(steady.bytes_received / window_s),
                # CPU of every agent's idle loop together: what bounds N on one machine
                "process_cpu_per_s": round(steady_cpu, 3),
                "etcd_cpu_per_s": etcd_steady,  # the etcd server's CPU seconds a second
                "cpu_ms_per_node_s": round(steady_cpu / n * 1000, 2),
                "requests_per_node_s_by_kind": steady_kinds,
                # where that CPU goes: ms per node per second by kind of thread, busiest first
                "cpu_ms_per_node_s_by_thread": by_thread,
            },
            "transitions": transitions,
            "largest_value": whole.largest_value,
            "largest_read": whole.largest_read,
            "history_events": len(observer.history()),
            "leader_terms": observer.terms(),
            "violations": violations,
        }
    finally:
        if cluster is not None:
            cluster.close()
        if observer is not None:
            observer.close()
        etcd.close()


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of `results` (one row per transition)."""
    lines = [
        "| nodes | fault | decided s | all hold s | all started s | decide->hold s "
        "(p50 / p90) | window CPU s etcd / procs (cores) "
        "| etcd req (per node; added per node) | KiB sent / recv | leader CPU s "
        "| process CPU s | etcd CPU s "
        "| steady req/node/s | steady writes/node/s | largest value B | largest read B "
        "| gens | steady CPU ms/node/s | leader terms | violations |",
        "|" + "---|" * 20,
    ]
    for r in results:
        st = r["steady"]
        for t in r["transitions"]:
            e = t["etcd"]
            w = t.get("hold_window_cpu_s") or {}
            window = f"{w['etcd']} / {w['processes']} ({w['cores']})" if w else "-"
            lines.append(
                f"| {r['nodes']} | {t['fault']} | {t['decided_s']} | {t['all_hold_s']} "
                f"| {t['all_started_s']} | {t['decide_to_hold_s']} "
                f"({t.get('hold_p50_s', '-')} / {t.get('hold_p90_s', '-')}) | {window} "
                f"| {e['requests']} ({t['requests_per_node']}; "
                f"{t.get('added_requests_per_node', '-')}) "
                f"| {e['bytes_sent'] // 1024} / {e['bytes_received'] // 1024} "
                f"| {t['leader_cpu_s']} | {t['process_cpu_s']} | {t.get('etcd_cpu_s', '-')} "
                f"| {st['requests_per_node_s']} | {st['writes_per_node_s']} "
                f"| {r['largest_value']} | {r['largest_read']} | {t['generations']} "
                f"| {st['cpu_ms_per_node_s']} | {r['leader_terms']} | {len(r['violations'])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="64", help="comma-separated cluster sizes")
    ap.add_argument("--faults", default="loss,join,sick", help="comma-separated, in order")
    ap.add_argument("--slots", type=int, default=1, help="workers per node")
    ap.add_argument("--steady-s", type=float, default=5.0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument(
        "--processes", type=int, default=2, help="processes the simulated nodes are spread over"
    )
    ap.add_argument(
        "--lease-ttl-s",
        type=int,
        default=None,
        help="default: 3 up to 64 nodes, 10 up to 512, 30 beyond",
    )
    ap.add_argument(
        "--connection-per-node",
        action="store_true",
        help="each agent its own etcd connection (default: shared, see below)",
    )
    ap.add_argument(
        "--agents-per-connection",
        type=int,
        default=AGENTS_PER_CONNECTION,
        help="agents of a process on one shared etcd connection (0: all of them)",
    )
    ap.add_argument(
        "--server-per-node",
        action="store_true",
        help="each agent its own gRPC server (default: one per process, each agent's health "
        "under its own name)",
    )
    ap.add_argument(
        "--loop-threads",
        type=int,
        default=LOOP_THREADS,
        help="threads a process runs its agents' decision loops on (bench/scaleloops.py); "
        "0: a thread each, as on a real node",
    )
    ap.add_argument(
        "--parked-threads",
        type=int,
        default=PARKED_THREADS,
        help="more threads a process has for turns waiting on etcd (bench/scaleloops.py); "
        "0: a turn's etcd round trip holds its thread",
    )
    ap.add_argument(
        "--sample-threads-s",
        type=float,
        default=0.0,
        help="the simulation processes sample their threads' CPU this often (0: not): each "
        "transition then gives the decision -> hold window's CPU by kind of thread",
    )
    ap.add_argument(
        "--profile-turns",
        type=Path,
        default=None,
        metavar="DIR",
        help="profile the agents' turns (their loop threads' CPU, by function) over each "
        "whole run: DIR/<nodes>/turns.prof, for python -m pstats",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    # A stopped run still closes its agents and its etcd (the finally blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    faults = [f for f in args.faults.split(",") if f]
    for f in faults:
        if f not in FAULTS:
            ap.error(f"unknown fault {f!r}; one of {', '.join(FAULTS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="elasticpp-scale-") as tmp:
        for n in (int(x) for x in args.nodes.split(",")):
            profile_dir = None
            if args.profile_turns is not None:
                profile_dir = args.profile_turns.resolve() / str(n)
                profile_dir.mkdir(parents=True, exist_ok=True)
            r = run_size(
                n,
                faults,
                steady_s=args.steady_s,
                slots=args.slots,
                timeout_s=args.timeout_s,
                workdir=Path(tmp),
                processes=args.processes,
                lease_ttl_s=args.lease_ttl_s,
                share_etcd=not args.connection_per_node,
                agents_per_connection=args.agents_per_connection,
                loop_threads=args.loop_threads,
                shared_server=not args.server_per_node,
                parked_threads=args.parked_threads,
                sample_threads_s=args.sample_threads_s,
                profile_turns=profile_dir,
            )
            results.append(r)
            merged = merge_turn_profiles(profile_dir) if profile_dir is not None else None
            if merged is not None:
                print(f"the turns' profile of {n} nodes: {merged}", flush=True)
            print(table([r]), flush=True)
            for v in r["violations"]:
                print(f"INVARIANT VIOLATED: {v}", flush=True)
    print()
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    unsettled = [t["error"] for r in results for t in r["transitions"] if t["error"]]
    for e in unsettled:
        print(f"NOT SETTLED: {e}")
    return 1 if unsettled or any(r["violations"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
