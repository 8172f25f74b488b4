"""A resume's transfers on real gRPC: in parallel within bounds, and failed (not waited for)
when a source stops sending."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from elasticpp.agent.follower.step import GenerationProgress
from elasticpp.agent.kernel.decide import Phase
from elasticpp.agent.kernel.limits import FETCH_PER_SOURCE
from elasticpp.agent.node import Agent, AgentConfig
from elasticpp.cluster.records import GenerationRecord
from elasticpp.plan import ClusterSpec, Layout, NodeSpec, Plan, build_plan, load_device_spec
from elasticpp.store.client import PieceFetchError
from elasticpp.store.resume import PieceTransfer, TransferProgress, fetch_pieces
from elasticpp.store.service import StateServicer
from tests.agents import SPEC
from tests.stores import ALL_TP2, Node
from tests.stores import GRPC_MODEL as MODEL
from tests.stores import commit_sized_step as commit_step

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def nodes() -> Iterator[dict[str, Node]]:
    made: dict[str, Node] = {}
    yield made
    for node in made.values():
        node.stop()


class _Counting(StateServicer):
    """Serves each piece after `delay_s` (a busy disk), counting transfers in flight."""

    def __init__(self, *args: Any, delay_s: float = 0.0, stall: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.delay_s, self.stall = delay_s, stall
        self.in_flight = self.most = 0
        self.lock = threading.Lock()
        self.release = threading.Event()

    def FetchPiece(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            time.sleep(self.delay_s)
            for i, chunk in enumerate(super().FetchPiece(request, context)):
                if self.stall and i == 1:
                    self.release.wait(30)  # sends one chunk, then nothing
                yield chunk
        finally:
            with self.lock:
                self.in_flight -= 1


def test_the_agent_fetches_a_sources_pieces_in_parallel_within_the_per_source_bound(
    tmp_path: Path, nodes: dict[str, Node]
) -> None:
    nodes["a"] = a = Node(tmp_path, "a", _Counting, threads=16, delay_s=0.2)
    commit_step(a.store, 3, ALL_TP2)
    agent = Agent(AgentConfig("n0", ("127.0.0.1:1",), "127.0.0.1:0", 2, tmp_path / "n0"), SPEC)
    # n0 runs both ranks at tp=1 of the model whose tp=2 slices `a` holds: it takes them all.
    cluster = ClusterSpec((NodeSpec("n0", 2),), load_device_spec("cpu"))
    plan = build_plan(MODEL, cluster, Layout(1, 1, 2), global_batch=4, micro_batch=2)
    record = GenerationRecord(2, plan.with_generation(2).to_dict(), "n9", time.time())
    agent.view.state.members = {
        "a": {"address": a.address, "incarnation": "i-a"}
    }  # a source outside
    gs = GenerationProgress(record=record, plan=Plan.from_dict(record.plan), phase=Phase.MOVING)
    pieces = {n: a.store.piece_info("a", 3, n) for n in ALL_TP2}
    assert len(pieces) > FETCH_PER_SOURCE
    resume = {
        "format_version": 2,
        "step": 3,
        "pieces": {n: [p.sha256, p.size] for n, p in pieces.items()},
        "reshard": dict.fromkeys(MODEL.units, 2),
        "reshard_by_node": {},
        "nodes": ["a"],
        "by_node": {"n0": [[len(pieces), 0]]},
        "infos_by_node": {},
    }
    progress = TransferProgress()
    outcome = agent.follower.fetch(gs, resume, progress)
    assert outcome.error is None
    assert 1 < a.servicer.most <= FETCH_PER_SOURCE
    for name in ALL_TP2:
        assert (agent.follower.resume_dir(gs) / name).stat().st_size == 5000
    assert progress.bytes_done == 5000 * len(ALL_TP2)
    agent.liveness.close()


class _FakeClient:
    """Stands in for StateClient: each fetch takes a while; counts fetches in flight."""

    in_flight: ClassVar[dict[str, int]] = {}
    most: ClassVar[dict[str, int]] = {}
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, address: str) -> None:
        self.address = address

    def fetch_piece(self, *args: Any, **kw: Any) -> int:
        with self.lock:
            for key in (self.address, "all"):
                self.in_flight[key] = self.in_flight.get(key, 0) + 1
                self.most[key] = max(self.most.get(key, 0), self.in_flight[key])
        time.sleep(0.05)  # the transfer itself
        with self.lock:
            for key in (self.address, "all"):
                self.in_flight[key] -= 1
        return 0

    def close(self) -> None:
        pass


def test_transfers_from_several_sources_stay_within_both_bounds(tmp_path: Path) -> None:
    sources = [f"s{i}" for i in range(5)]
    transfers = [PieceTransfer(f"p{s}{k}", "o", s, "0" * 64, 1) for s in sources for k in range(4)]
    fetch_pieces(
        transfers,
        tmp_path,
        {s: s for s in sources},
        1,
        1,
        per_source=3,
        parallel=7,
        client_factory=_FakeClient,  # type: ignore[arg-type]
    )
    assert 3 < _FakeClient.most["all"] <= 7
    assert max(_FakeClient.most[s] for s in sources) <= 3


def test_a_source_that_stops_sending_fails_the_fetch_and_leaves_nothing(
    tmp_path: Path, nodes: dict[str, Node]
) -> None:
    nodes["a"] = a = Node(tmp_path, "a", _Counting, stall=True, chunk_bytes=1024)
    commit_step(a.store, 3, ALL_TP2[:2])
    now = [0.0]

    def clock() -> float:  # every look at the clock finds 1 s more gone
        now[0] += 1.0
        return now[0]

    transfers = [
        PieceTransfer(n, "a", "a", a.store.piece_info("a", 3, n).sha256, 5000) for n in ALL_TP2[:2]
    ]
    dest = tmp_path / "dest"
    dest.mkdir()
    try:
        with pytest.raises(PieceFetchError, match="stalled \\(no bytes for"):
            fetch_pieces(
                transfers, dest, {"a": a.address}, 3, 0, stall_s=5.0, min_bytes_per_s=0, clock=clock
            )
    finally:
        a.servicer.release.set()
    assert list(dest.iterdir()) == []


def test_a_trickle_counts_as_stalled_over_a_window() -> None:
    now = [0.0]
    progress = TransferProgress(clock=lambda: now[0])
    for _ in range(30):  # 1 KiB a second for 30 s: bytes keep coming, far too slowly
        now[0] += 1.0
        progress.add(1024)
        assert progress.idle_s(now[0]) == 0.0
    why = progress.stalled(now[0], stall_s=30.0, min_bytes_per_s=1 << 20)
    assert why is not None and "bytes/s" in why
    fast = TransferProgress(clock=lambda: now[0])
    now[0] += 30.0
    fast.add(100 << 20)
    assert fast.stalled(now[0], stall_s=30.0, min_bytes_per_s=1 << 20) is None
