"""Record the golden traces of the agent's pure steps on the failure walks.

    python -m tests.golden.record [--out tests/data/golden]

Each walk runs real agents (bench/scalesim.py: the real `Agent`, its parts and executor, real
etcd, real gRPC probes; simulated workers that answer at once) through one fault, and writes the
distinct calls of every pure step it made (tests/golden/trace.py) to `<walk>.json.gz`:

- loss: a follower is lost (its lease lapses);
- join: a node joins a running job;
- drain: a follower is drained (`Drain`) and leaves;
- sick: a node's workers fail as they start, until it is quarantined;
- leader: the leader is lost; another campaigns and re-plans;
- trained: as loss, with real worker processes that train and snapshot (the durability
  part's steps: commits, snapshots, the resume from what the survivors hold).

Recorded once, from the tree before a part moves; replayed by tests/unit/test_golden_steps.py
after. A walk's timing varies from run to run (and so do the cases it records); what a replay
checks is that every recorded call decides the same today.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.scalesim import SimAgent, SimCluster, sim_spec
from elasticpp.agent.kernel.summaries import AgentStatus
from elasticpp.cluster.etcd.server import EtcdServer
from elasticpp.errors import ElasticppError
from elasticpp.waiting import wait_until
from tests.golden.steps import STEPS
from tests.golden.trace import Recorder, has_opaque, instrument

NODES = 4
WALKS = ("loss", "join", "drain", "sick", "leader", "trained")
TIMEOUT_S = 90.0


def _snap(agent: SimAgent) -> AgentStatus:
    return agent.control.status_snapshot()


def _settled(cluster: SimCluster, after_gen: int, expect: int) -> Callable[[], bool]:
    """Every live, healthy agent follows one generation newer than `after_gen`, with
    `expect` nodes planned, and its ranks (if any) run."""

    def check() -> bool:
        snaps = [_snap(a) for a in cluster.live(healthy=True)]
        gens = {s.generation for s in snaps}
        if len(gens) != 1 or gens.pop() <= after_gen:
            return False
        if any(s.phase not in ("running", "idle") for s in snaps):
            return False
        leader = next((a for a in cluster.live() if a.leader.acting()), None)
        return leader is not None and len(leader.follower.followed().record.planned_set) == expect

    return check


def _generation(cluster: SimCluster) -> int:
    return max(_snap(a).generation for a in cluster.live())


def _leader(cluster: SimCluster) -> SimAgent:
    for a in cluster.live():
        if a.leader.acting():
            return a
    raise ElasticppError("no leader")


def _wait(cond: Callable[[], bool], what: str) -> None:
    if not wait_until(cond, TIMEOUT_S, interval_s=0.1):
        raise ElasticppError(f"walk: {what} not within {TIMEOUT_S:.0f} s")


@contextmanager
def _cluster(workdir: Path, name: str) -> Iterator[SimCluster]:
    etcd = EtcdServer(workdir / f"etcd-{name}")
    etcd.start()
    cluster = None
    try:
        spec = sim_spec(f"golden-{name}", NODES + 1, 1, lease_ttl_s=3)
        ids = [f"node-{i}" for i in range(NODES)]
        cluster = SimCluster(etcd.endpoint, ids, 1, workdir / f"nodes-{name}", spec)
        _wait(_settled(cluster, 0, NODES), "the first generation running")
        yield cluster
    finally:
        if cluster is not None:
            cluster.close()
        etcd.close()


def _trained(workdir: Path, recorder: Recorder) -> None:
    """Three agents with real workers on the tiny model; one is lost once every node has
    committed steps, and the others train on from what they hold."""
    from bench.soak import SLICED_DEVICE
    from elasticpp.agent.jobspec import parse_job_spec
    from elasticpp.agent.node import AgentConfig

    etcd = EtcdServer(workdir / "etcd-trained")
    etcd.start()
    spec = parse_job_spec(
        {
            "name": "golden-trained",
            "model": "tiny",
            "global_batch": 12,
            "micro_batch": 2,
            "steps": 100_000,
            "seed": 3,
            "min_nodes": 1,
            "max_nodes": 3,
            "lease_ttl_s": 3,
            "join_settle_s": 0.5,
            "snapshot_every": 2,
            "device": SLICED_DEVICE,
        }
    )
    agents: list[SimAgent] = []
    threads: list[threading.Thread] = []
    try:
        for i in range(3):
            cfg = AgentConfig(
                f"node-{i}", (etcd.endpoint,), "127.0.0.1:0", 1, workdir / f"trained-{i}"
            )
            agent = SimAgent(cfg, spec)
            agent.start()
            agents.append(agent)
            threads.append(threading.Thread(target=agent.run, daemon=True))
            threads[-1].start()

        def trained(live: list[SimAgent], beyond: int) -> Callable[[], bool]:
            return lambda: all(a.durability.state.last_step > beyond for a in live)

        _wait(trained(agents, 4), "every node's first committed steps")
        with _recording(recorder):
            lost = next(a for a in agents if not a.leader.acting())
            live = [a for a in agents if a is not lost]
            gen = max(a.follower.generation for a in live)
            lost.crash()
            _wait(lambda: all(a.follower.generation > gen for a in live), "the re-plan")
            step = max(a.durability.state.last_step for a in live)
            _wait(trained(live, step + 4), "training on after the loss")
    finally:
        for a in agents:
            a.request_stop()
        for t in threads:
            t.join(timeout=30)
        for a in agents:
            with contextlib.suppress(Exception):
                a.shutdown()
        etcd.close()


def walk(name: str, workdir: Path, recorder: Recorder) -> None:
    if name == "trained":
        _trained(workdir, recorder)
        return
    with _cluster(workdir, name) as cluster:
        gen = _generation(cluster)
        leader = _leader(cluster)
        follower = next(a for a in cluster.live() if a is not leader)
        with _recording(recorder):
            if name == "loss":
                cluster.crash(follower.node_id)
                _wait(_settled(cluster, gen, NODES - 1), "the re-plan without the lost node")
            elif name == "join":
                cluster.add(f"node-{NODES}")
                _wait(_settled(cluster, gen, NODES + 1), "the re-plan with the joiner")
            elif name == "drain":
                follower.control.request_drain(30.0)
                _wait(lambda: follower.exit_requested() == 0, "the drained node's exit")
                cluster.crashed.add(follower.node_id)  # gone: left out of `live()`
                _wait(_settled(cluster, gen, NODES - 1), "the re-plan without the drained node")
            elif name == "sick":
                cluster.make_sick(follower.node_id)
                _wait(
                    lambda: follower.node_id in _snap(leader).quarantined,
                    "the sick node's quarantine",
                )
                _wait(_settled(cluster, gen, NODES - 1), "the re-plan without the sick node")
            elif name == "leader":
                cluster.crash(leader.node_id)
                _wait(_settled(cluster, gen, NODES - 1), "a new leader's re-plan")
            _quiet_turns(cluster)


def _quiet_turns(cluster: SimCluster, turns: int = 3) -> None:
    """Wait until every live agent has read its view `turns` more times after the fault
    settled: the quiet turns a walk records too."""
    for _ in range(turns):
        seen = {a.node_id: a.view.snapshot.last_refresh_s for a in cluster.live()}
        _wait(
            lambda seen=seen: all(  # type: ignore[misc]
                a.view.snapshot.last_refresh_s > seen.get(a.node_id, 0.0) for a in cluster.live()
            ),
            "the quiet turns after the fault",
        )


@contextmanager
def _recording(recorder: Recorder) -> Iterator[None]:
    yield from instrument(recorder, STEPS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/golden"))
    p.add_argument("--walk", choices=WALKS, action="append")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.walk or WALKS:
            recorder = Recorder()
            walk(name, Path(tmp), recorder)
            if recorder.errors:
                raise ElasticppError(f"walk {name}: not recorded: {recorder.errors[:3]}")
            recorder.write(args.out / f"{name}.json.gz")
            counts = {k: len(v) for k, v in sorted(recorder.cases.items())}
            print(f"{name}: {sum(counts.values())} cases {counts}", file=sys.stderr)
            opaque = sorted(
                {
                    f"{step}: {o}"
                    for step, cases in recorder.cases.items()
                    for c in cases
                    if (o := has_opaque(c)) is not None
                }
            )
            print(f"{name}: opaque values in {opaque}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
