"""The holdings detail the leader pulls at a transition, over real gRPC on loopback:
`StateService.ListHoldings` pages, limits and status codes, and `agent.leader.pull.pull_holdings`
(bounded concurrency, a deadline, nodes that do not answer or moved on)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from elasticpp.agent.leader.pull import pull_holdings
from elasticpp.errors import CheckpointError, ConfigError, StaleGenerationError
from elasticpp.rpc.state.v1 import state_pb2, state_pb2_grpc
from elasticpp.store.client import StateClient
from elasticpp.store.digest import digest_of
from elasticpp.store.service import MAX_PAGE_PIECES, StateServicer
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


def _stub(node: Node) -> tuple[grpc.Channel, state_pb2_grpc.StateServiceStub]:
    channel = grpc.insecure_channel(node.address)
    return channel, state_pb2_grpc.StateServiceStub(channel)


def test_holdings_are_listed_in_pages_of_the_size_asked_and_only_of_the_steps_asked(
    tmp_path: Path, nodes
) -> None:
    nodes["a"] = a = Node(tmp_path, "a")
    for step in (3, 4, 5):
        commit_step(a.store, step, ALL_TP2, size=10)
    channel, stub = _stub(a)
    request = state_pb2.ListHoldingsRequest(steps=[4, 5], page_pieces=3)
    pages = []
    while True:
        reply = stub.ListHoldings(request, timeout=10)
        pages.append(reply)
        if not reply.next_page_token:
            break
        request.page_token = reply.next_page_token
    channel.close()
    listed = [len(s.pieces) for p in pages for s in p.steps]
    assert all(sum(len(s.pieces) for s in p.steps) <= 3 for p in pages)
    assert sum(listed) == 2 * len(ALL_TP2) and {s.step for p in pages for s in p.steps} == {4, 5}
    assert all(s.piece_count == len(ALL_TP2) for p in pages for s in p.steps)
    with StateClient(a.address) as client:
        held = client.list_holdings(0, [4, 5, 99], page_pieces=3)
    assert held.node_id == "a" and sorted(held.steps) == [("a", 4), ("a", 5)]
    assert held.steps[("a", 4)] == a.store.holdings().steps[("a", 4)]


def test_bad_requests_get_invalid_argument_and_an_old_generation_failed_precondition(
    tmp_path: Path, nodes
) -> None:
    nodes["a"] = a = Node(tmp_path, "a")
    commit_step(a.store, 4, ALL_TP2, size=10)
    channel, stub = _stub(a)
    for request, words in (
        (state_pb2.ListHoldingsRequest(), "ask for 1 to"),
        (state_pb2.ListHoldingsRequest(steps=range(2000)), "got 2000"),
        (state_pb2.ListHoldingsRequest(steps=[4], page_token="4/a/../../x"), "not a piece"),
        (state_pb2.ListHoldingsRequest(steps=[4], page_token="x/a/b"), "not a token"),
        (
            state_pb2.ListHoldingsRequest(steps=[4], page_token=f"4/../{ALL_TP2[0]}"),
            "page_token origin",
        ),
    ):
        with pytest.raises(grpc.RpcError) as info:
            stub.ListHoldings(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, words
        assert words in info.value.details()
    # A page larger than the server's cap is served at the cap.
    big = stub.ListHoldings(state_pb2.ListHoldingsRequest(steps=[4], page_pieces=10**6))
    assert len(big.steps[0].pieces) == len(ALL_TP2) <= MAX_PAGE_PIECES
    channel.close()
    a.generation = 5
    with StateClient(a.address) as client:
        with pytest.raises(StaleGenerationError, match="generation 4 is older"):
            client.list_holdings(4, [4])
        with pytest.raises(ConfigError, match="ask for 1 to"):
            client.list_holdings(5, [])


class _Shrinking(StateServicer):
    """Lists a step with fewer pieces than it says it has: it changed between pages."""

    def ListHoldings(self, request, context):  # type: ignore[no-untyped-def]
        reply = super().ListHoldings(request, context)
        for s in reply.steps:
            s.piece_count += 1
        return reply


def test_a_step_that_changed_between_pages_is_refused(tmp_path: Path, nodes) -> None:
    nodes["a"] = a = Node(tmp_path, "a", servicer_cls=_Shrinking)
    commit_step(a.store, 4, ALL_TP2, size=10)
    with StateClient(a.address) as client, pytest.raises(CheckpointError, match="changed while"):
        client.list_holdings(0, [4], page_pieces=2)


class _Hangs(StateServicer):
    def __init__(self, *args, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self.release = threading.Event()

    def ListHoldings(self, request, context):  # type: ignore[no-untyped-def]
        self.release.wait(20)
        return super().ListHoldings(request, context)


def test_the_pull_asks_only_holders_and_names_who_did_not_answer_or_moved_on(
    tmp_path: Path, nodes
) -> None:
    nodes["a"] = a = Node(tmp_path, "a")
    nodes["b"] = b = Node(tmp_path, "b")
    nodes["c"] = c = Node(tmp_path, "c", servicer_cls=_Hangs)
    nodes["d"] = d = Node(tmp_path, "d")
    nodes["e"] = e = Node(tmp_path, "e")
    for node in (a, b, c, d, e):
        commit_step(node.store, 7, ALL_TP2, size=10)
    commit_step(a.store, 3, ALL_TP2, size=10)
    d.generation = 9  # moved on: a newer generation than the pull's
    digests = {n: digest_of(nodes[n].store.holdings(), nodes[n].address) for n in "abcde"}
    e.stop()  # gone since it arrived: connection refused
    asked: list[str] = []

    def connect(address: str) -> StateClient:
        asked.append(address)
        return StateClient(address)

    start = time.monotonic()
    pulled = pull_holdings(
        2,
        0,
        digests,
        MODEL.units,
        tuple("abcde"),
        None,
        None,
        parallel=2,
        node_timeout_s=1.0,
        deadline_s=10.0,
        connect=connect,
    )
    took_s = time.monotonic() - start
    c.servicer.release.set()  # type: ignore[attr-defined]
    assert pulled.error == "" and pulled.held and pulled.not_asked == ()
    # Step 7 resolves; step 3 is older: nobody is asked for it.
    assert sorted(pulled.holdings) == ["a", "b"]
    assert sorted(pulled.holdings["a"].steps) == [("a", 7)]
    assert sorted(pulled.unanswered) == ["c", "e"] and "DEADLINE_EXCEEDED" in pulled.unanswered["c"]
    assert sorted(pulled.moved_on) == ["d"] and "older" in pulled.moved_on["d"]
    assert sorted(asked) == sorted(nodes[n].address for n in "abcde")
    assert took_s < 5.0  # one node's timeout, not the deadline: the hung node kept one slot


def test_nodes_the_deadline_left_unasked_are_not_blamed(tmp_path: Path, nodes) -> None:
    """One slot, taken by a node that hangs to the deadline: the other never had its turn.
    It is "not asked" (the leader pulls again), not unanswered (quarantined)."""
    nodes["a"] = a = Node(tmp_path, "a", servicer_cls=_Hangs)
    nodes["b"] = b = Node(tmp_path, "b")
    for node in (a, b):
        commit_step(node.store, 7, ALL_TP2, size=10)
    digests = {n: digest_of(nodes[n].store.holdings(), nodes[n].address) for n in "ab"}
    pulled = pull_holdings(
        2,
        0,
        digests,
        MODEL.units,
        ("a", "b"),
        None,
        None,
        parallel=1,
        node_timeout_s=5.0,
        deadline_s=0.5,
    )
    a.servicer.release.set()  # type: ignore[attr-defined]
    assert list(pulled.unanswered) == ["a"] and pulled.not_asked == ("b",)
    assert pulled.holdings == {}
