"""Replication's guarantee over real stores and real gRPC state services on loopback: once a
safe step is published, every single node loss leaves the survivors a step the resolver can
resume from, also when replication lags behind fast commits (elasticpp.store.replicate)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.plan.layout import Layout, Plan, build_plan
from elasticpp.plan.specs import DEVICE_PRESETS, ClusterSpec, ModelSpec, NodeSpec
from elasticpp.store.client import StateClient
from elasticpp.store.holdings import NodeHoldings
from elasticpp.store.replicate import replicate_once, safe_step
from elasticpp.store.resolver import resolve
from tests.stores import Node
from tests.stores import commit_sized_step as commit_step

pytestmark = pytest.mark.timeout(60)

MODEL = ModelSpec("t", num_layers=2, hidden_size=16, num_heads=4, vocab_size=32, seq_len=8)
RING = ["a", "b", "c"]  # r = 1: b keeps a's steps, c keeps b's, a keeps c's
UNITS_OF = {"a": ["embed"], "b": ["block.0000"], "c": ["block.0001", "head"]}


def survivor_plan(survivors: list[str]) -> Plan:
    cluster = ClusterSpec(tuple(NodeSpec(n, 1) for n in survivors), DEVICE_PRESETS["cpu"])
    return build_plan(MODEL, cluster, Layout.parse("pp=2"), global_batch=4, micro_batch=1)


class Job:
    """Three nodes as the agents run them: commit, replicate, report anchors; and the leader's
    part: compute the safe step from the reports and hand it to every store as its floor."""

    def __init__(self, root: Path) -> None:
        self.nodes = {n: Node(root, n, store_kw={"anchor_every": 1}) for n in RING}
        self.peers = {n: node.address for n, node in self.nodes.items()}
        self.safe: int | None = None

    def commit_all(self, step: int) -> None:
        for n, node in self.nodes.items():
            commit_step(node.store, step, [PieceKey(u, 0, 1).filename for u in UNITS_OF[n]])

    def replicate(self, holder: str) -> None:
        replicate_once(self.nodes[holder].store, self.peers, RING, 1, 0)
        self.publish_safe()

    def publish_safe(self) -> None:
        stores = {n: node.store for n, node in self.nodes.items()}
        own = {n: s.anchors(n, 0) for n, s in stores.items()}
        replicas = {h: {o: s.anchors(o, 0) for o in RING if o != h} for h, s in stores.items()}
        step = safe_step(RING, 1, RING, own, replicas)
        if step is not None and (self.safe is None or step > self.safe):
            self.safe = step
            for s in stores.values():
                s.set_floor(step, 0)

    def holdings(self) -> dict[str, NodeHoldings]:
        return {n: node.store.holdings() for n, node in self.nodes.items()}

    def assert_every_single_loss_survivable(self) -> None:
        assert self.safe is not None
        held = self.holdings()
        for lost in RING:
            survivors = [n for n in RING if n != lost]
            plan = resolve(held, survivor_plan(survivors), live_nodes=survivors)
            assert plan.step >= self.safe, lost

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    made = Job(tmp_path)
    yield made
    made.stop()


def test_one_node_loss_leaves_a_common_step_while_replication_lags(job: Job):
    # Replication keeps up: every node holds every step of its predecessor; step 35 is safe.
    for step in range(30, 36):
        job.commit_all(step)
        for n in RING:
            job.replicate(n)
    assert job.safe == 35
    job.assert_every_single_loss_survivable()
    # Steps become fast: each holder's round lands while the others' commits move on. Before
    # the floor, the survivors of a loss of a held a's state at 37 only and their own at 40-41.
    for step, holder in ((37, "b"), (39, "c"), (41, "a")):
        job.commit_all(step - 1)
        job.assert_every_single_loss_survivable()
        job.commit_all(step)
        job.assert_every_single_loss_survivable()
        job.replicate(holder)
        job.assert_every_single_loss_survivable()
    # Every pair walked through the same anchors: 36 and 37 are held all round now.
    assert job.safe == 37

    # Node a dies; the survivors resume over gRPC as the leader would.
    job.nodes.pop("a").stop()
    holdings = {}
    for n, node in job.nodes.items():
        with StateClient(node.address) as client:
            holdings[n] = client.list_steps(0)
    plan = resolve(holdings, survivor_plan(["b", "c"]), live_nodes=["b", "c"])
    assert plan.step == 37


def test_anchors_stay_bounded_while_a_node_stalls_replication(job: Job):
    for step in range(1, 4):
        job.commit_all(step)
        for n in RING:
            job.replicate(n)
    assert job.safe == 3
    # c stops replicating (slow disk, say): a's state stays on b, but c has no newer b.
    for step in range(4, 40):
        job.commit_all(step)
        for n in ("a", "b"):
            job.replicate(n)
    assert job.safe == 3
    job.assert_every_single_loss_survivable()
    for node in job.nodes.values():
        store = node.store
        for origin in RING:
            above = [s for s in store.anchors(origin) if s > 3]
            assert len(above) <= store.retention.cap
