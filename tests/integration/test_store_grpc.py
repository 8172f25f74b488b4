"""The state service over real gRPC on loopback: fetch, fencing, refusal, faults, replication,
and a full resume across layouts (tp=2 pieces -> tp=1 ranks)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from elasticpp.checkpoint.manifest import PieceKey, step_dirname, verify_step_dir
from elasticpp.errors import CheckpointError, StaleGenerationError
from elasticpp.plan.layout import Layout, build_plan
from elasticpp.plan.specs import DEVICE_PRESETS, ClusterSpec, NodeSpec
from elasticpp.rpc.state.v1 import state_pb2, state_pb2_grpc
from elasticpp.store.client import PieceFetchError, StateClient
from elasticpp.store.holdings import PieceInfo
from elasticpp.store.local import LocalStore
from elasticpp.store.replicate import replicate_once
from elasticpp.store.resolver import FetchKind, resolve
from elasticpp.store.resume import prepare_resume
from elasticpp.store.service import StateServicer, serve
from elasticpp.store.wire import Chunk
from tests.stores import ALL_TP2, Node, piece_bytes
from tests.stores import GRPC_MODEL as MODEL
from tests.stores import commit_sized_step as commit_step

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[dict[str, Node]]:
    made: dict[str, Node] = {}
    yield made
    for node in made.values():
        node.stop()


NAME = ALL_TP2[0]


def test_fetch_from_peer_writes_verified_bytes(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a")
    commit_step(a.store, 4, [NAME], size=3 << 20)
    with StateClient(a.address) as client:
        held = client.list_steps(0)
        info = held.steps[("a", 4)].pieces[NAME]
        dest = tmp_path / "out.safetensors"
        assert client.fetch_piece(4, NAME, "a", dest, info.sha256, 0) == 3 << 20
    assert dest.read_bytes() == piece_bytes(NAME, 4, "a", 3 << 20)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


def test_old_generation_is_refused_with_failed_precondition(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a")
    commit_step(a.store, 1, [NAME])
    a.generation = 5
    channel = grpc.insecure_channel(a.address)
    stub = state_pb2_grpc.StateServiceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.ListSteps(state_pb2.ListStepsRequest(generation=4), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "4" in info.value.details() and "5" in info.value.details()
    request = state_pb2.FetchPieceRequest(generation=3, step=1, name=NAME, origin_node="a")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.FetchPiece(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    channel.close()
    with StateClient(a.address) as client:
        with pytest.raises(StaleGenerationError, match="generation 4 is older"):
            client.list_steps(4)
        assert ("a", 1) in client.list_steps(6).steps  # newer than the server's: fine


@pytest.mark.parametrize(
    ("name", "origin", "code"),
    [
        ("../../etc/passwd", "a", grpc.StatusCode.INVALID_ARGUMENT),
        (f"../{NAME}", "a", grpc.StatusCode.INVALID_ARGUMENT),
        (NAME, "../a", grpc.StatusCode.INVALID_ARGUMENT),
        (NAME, "..", grpc.StatusCode.INVALID_ARGUMENT),
        ("head.tp0-1.safetensors", "a", grpc.StatusCode.NOT_FOUND),
        (NAME, "zz", grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_names_are_invalid_and_unknown_pieces_not_found(tmp_path, nodes, name, origin, code):
    nodes["a"] = a = Node(tmp_path, "a")
    commit_step(a.store, 1, [NAME])
    channel = grpc.insecure_channel(a.address)
    stub = state_pb2_grpc.StateServiceStub(channel)
    request = state_pb2.FetchPieceRequest(generation=0, step=1, name=name, origin_node=origin)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.FetchPiece(request, timeout=10))
    channel.close()
    assert info.value.code() == code
    missing = state_pb2.FetchPieceRequest(generation=0, step=2, name=NAME, origin_node="a")
    channel = grpc.insecure_channel(a.address)
    with pytest.raises(grpc.RpcError) as info:
        list(state_pb2_grpc.StateServiceStub(channel).FetchPiece(missing, timeout=10))
    channel.close()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


class FaultyServicer(StateServicer):
    """Corrupts one chunk of the first `corrupt` calls; breaks the stream of the first
    `breaks` calls after two chunks. Records the offset of every request."""

    def __init__(self, *args, corrupt: int = 0, breaks: int = 0, **kw) -> None:
        super().__init__(*args, **kw)
        self.corrupt, self.breaks = corrupt, breaks
        self.offsets: list[int] = []
        self._lock = threading.Lock()

    def FetchPiece(self, request, context):
        with self._lock:
            self.offsets.append(request.offset)
            corrupt, self.corrupt = self.corrupt > 0, max(0, self.corrupt - 1)
            brk, self.breaks = self.breaks > 0, max(0, self.breaks - 1)
        for i, chunk in enumerate(super().FetchPiece(request, context)):
            if brk and i == 2:
                context.abort(grpc.StatusCode.UNAVAILABLE, "injected stream break")
            if corrupt and i == 1:
                data = bytearray(chunk.data)
                data[7] ^= 0x01
                chunk = Chunk(chunk.offset, bytes(data), chunk.total_size, chunk.sha256)
            yield chunk


def test_corrupted_chunk_is_detected_and_fetched_again(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a", FaultyServicer, corrupt=1, chunk_bytes=64 << 10)
    commit_step(a.store, 1, [NAME], size=1 << 20)
    sha = a.store.piece_info("a", 1, NAME).sha256
    dest = tmp_path / "out"
    with StateClient(a.address) as client:
        client.fetch_piece(1, NAME, "a", dest, sha, 0)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == sha
    assert a.servicer.offsets == [0, 0]  # the whole piece again


def test_piece_corrupt_every_time_raises_naming_it(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a", FaultyServicer, corrupt=99, chunk_bytes=64 << 10)
    commit_step(a.store, 1, [NAME], size=1 << 20)
    sha = a.store.piece_info("a", 1, NAME).sha256
    dest = tmp_path / "out"
    with (
        StateClient(a.address, checksum_retries=2) as client,
        pytest.raises(CheckpointError, match=f"piece {NAME}.*checksum after 3 attempts"),
    ):
        client.fetch_piece(1, NAME, "a", dest, sha, 0)
    assert not dest.exists()
    assert [p for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


def test_a_piece_corrupt_on_the_source_is_refused_and_its_commit_dropped_there(
    tmp_path: Path, nodes
):
    # The bytes on the source's disk rotted after the commit: it served them to peer after
    # peer, each fetch failing its checksum three times, the commit still in its holdings.
    nodes["a"] = a = Node(tmp_path, "a", FaultyServicer, chunk_bytes=64 << 10)
    commit_step(a.store, 1, [NAME], size=1 << 20)
    commit_step(a.store, 2, [NAME], size=1 << 20)
    sha = a.store.piece_info("a", 1, NAME).sha256
    path = a.store.find_piece(1, NAME, sha)
    assert path is not None
    data = bytearray(path.read_bytes())
    data[100_000] ^= 0x01
    path.write_bytes(bytes(data))
    dest = tmp_path / "out"
    with StateClient(a.address, checksum_retries=2) as client:
        with pytest.raises(CheckpointError, match="fails its checksum on the source"):
            client.fetch_piece(1, NAME, "a", dest, sha, 0)
        assert a.servicer.offsets == [0, 0]  # asked again once, to check its own copy
        assert ("a", 1) not in a.store.holdings().steps  # no resume is planned on it
        assert ("a", 2) in a.store.holdings().steps
        with pytest.raises(CheckpointError, match="NOT_FOUND"):
            client.fetch_piece(1, NAME, "a", dest, sha, 0)
    assert not dest.exists()


def test_bytes_read_of_a_replaced_commit_do_not_drop_the_commit_held_now(tmp_path: Path):
    store = LocalStore(tmp_path / "a", "a")
    commit_step(store, 1, [NAME], size=4096)
    held = store.piece_info("a", 1, NAME)
    # The piece sent was another commit's (a step committed again meanwhile).
    store.served("a", 1, NAME, PieceInfo(held.size, "0" * 64), "f" * 64)
    assert ("a", 1) in store.holdings().steps
    with pytest.raises(CheckpointError, match="fails its checksum"):
        store.served("a", 1, NAME, held, "f" * 64)
    assert ("a", 1) not in store.holdings().steps


def test_a_piece_corrupted_in_transit_is_sent_again_and_kept_at_the_source(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a", FaultyServicer, corrupt=1, chunk_bytes=64 << 10)
    commit_step(a.store, 1, [NAME], size=1 << 20)
    sha = a.store.piece_info("a", 1, NAME).sha256
    dest = tmp_path / "out"
    with StateClient(a.address) as client:
        client.fetch_piece(1, NAME, "a", dest, sha, 0)  # the source's copy checks out
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == sha
    assert ("a", 1) in a.store.holdings().steps


def test_broken_stream_resumes_from_last_good_offset(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a", FaultyServicer, breaks=1, chunk_bytes=64 << 10)
    commit_step(a.store, 1, [NAME], size=1 << 20)
    sha = a.store.piece_info("a", 1, NAME).sha256
    with StateClient(a.address) as client:
        client.fetch_piece(1, NAME, "a", tmp_path / "out", sha, 0)
    assert (tmp_path / "out").read_bytes() == piece_bytes(NAME, 1, "a", 1 << 20)
    assert a.servicer.offsets == [0, 2 * (64 << 10)]


def test_unreachable_peer_raises_after_bounded_retries(tmp_path: Path):
    with (
        StateClient("127.0.0.1:1", timeout_s=5, resume_attempts=1) as client,
        pytest.raises(PieceFetchError, match="UNAVAILABLE"),
    ):
        client.fetch_piece(1, NAME, "a", tmp_path / "out", "0" * 64, 0)


def test_replication_copies_the_peers_newest_committed_step(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a")
    nodes["b"] = b = Node(tmp_path, "b")
    peers = {"a": a.address, "b": b.address}
    for step in (1, 2, 3):
        commit_step(a.store, step, ALL_TP2[:2])
    commit_step(b.store, 3, ALL_TP2[2:4])
    results = replicate_once(b.store, peers, ["b", "a"], 1, 0)
    assert [(r.origin, r.step, r.error) for r in results] == [("a", 3, "")]
    held = b.store.holdings()
    assert held.steps[("a", 3)] == a.store.holdings().steps[("a", 3)]
    for name in ALL_TP2[:2]:
        assert b.store.path_of("a", 3, name).read_bytes() == piece_bytes(name, 3, "a", 5000)
    verify_step_dir(b.store.step_dir("a", 3))
    # Nothing new: nothing fetched. Then a moves on; b keeps the newest two.
    assert replicate_once(b.store, peers, ["a", "b"], 1, 0)[0].fetched_bytes == 0
    for step in (4, 5):
        commit_step(a.store, step, ALL_TP2[:2])
        replicate_once(b.store, peers, ["a", "b"], 1, 0)
    assert b.store.committed_steps("a") == [4, 5]
    # a is dead (not in peers): its replica on b stays.
    assert replicate_once(b.store, {"b": b.address}, ["a", "b"], 1, 0) == []
    assert b.store.committed_steps("a") == [4, 5]


def test_replication_walks_through_the_anchors_it_lacks_oldest_first(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a", store_kw={"anchor_every": 2})
    nodes["b"] = b = Node(tmp_path, "b", store_kw={"anchor_every": 2})
    peers = {"a": a.address, "b": b.address}
    for step in range(1, 8):
        commit_step(a.store, step, ALL_TP2[:1])
    # Nothing of a held yet: start at its newest anchor (7 is no anchor).
    results = replicate_once(b.store, peers, ["a", "b"], 1, 0, every=2)
    assert [(r.origin, r.step, r.copied) for r in results] == [("a", 6, 1)]
    for step in range(8, 13):
        commit_step(a.store, step, ALL_TP2[:1])
    results = replicate_once(b.store, peers, ["a", "b"], 1, 0, every=2)
    assert [(r.origin, r.step, r.copied) for r in results] == [("a", 12, 3)]
    assert results[0].fetched_bytes == 3 * 5000
    assert b.store.anchors("a") == [12, 10, 8, 6]
    # Nothing new: nothing copied, so the agent writes no new commit record for it.
    again = replicate_once(b.store, peers, ["a", "b"], 1, 0, every=2)[0]
    assert (again.step, again.copied, again.fetched_bytes) == (12, 0, 0)


def test_replication_reports_a_refusing_peer_without_raising(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a")
    nodes["b"] = b = Node(tmp_path, "b")
    commit_step(a.store, 1, ALL_TP2[:1])
    a.generation = 9
    results = replicate_once(b.store, {"a": a.address}, ["a", "b"], 1, 3)
    assert results[0].step is None and "older" in results[0].error


def test_resume_across_layouts_tp2_to_tp1_over_grpc(tmp_path: Path, nodes):
    # Old plan: pp=1, tp=2, dp=1 on node a (both tp ranks' pieces in a's store), replicated
    # to b. New plan: pp=2, tp=1 over nodes b and c; a is dead, so b serves its replica to c
    # and uses it itself.
    nodes["a"] = a = Node(tmp_path, "a")
    nodes["b"] = b = Node(tmp_path, "b")
    nodes["c"] = c = Node(tmp_path, "c")
    commit_step(a.store, 6, ALL_TP2)
    commit_step(a.store, 7, ALL_TP2[:3])  # incomplete in any replica: a dies before more
    peers = {n: nodes[n].address for n in "abc"}
    replicate_once(b.store, peers, ["a", "b", "c"], 1, 0)  # b backs up a: step 7 (partial)
    assert b.store.committed_steps("a") == [7]
    # b also keeps step 6, from the replication round of the step before.
    with StateClient(a.address) as client:
        holding = client.list_steps(0).steps[("a", 6)]
        d = b.store.replica_step_dir("a", 6)
        for name, info in holding.pieces.items():
            client.fetch_piece(6, name, "a", d / name, info.sha256, 0)
    b.store.commit_replica("a", 6, MODEL.units, holding.entries())
    a.stop()
    del nodes["a"]
    for n in "bc":
        nodes[n].generation = 1

    cluster = ClusterSpec((NodeSpec("b", 1), NodeSpec("c", 1)), DEVICE_PRESETS["cpu"])
    target = build_plan(MODEL, cluster, Layout.parse("pp=2"), global_batch=4, micro_batch=1)
    target = target.with_generation(1)
    live = {"b": b.address, "c": c.address}
    holdings = {}
    for node_id, address in live.items():
        with StateClient(address) as client:
            holdings[node_id] = client.list_steps(1)
    rp = resolve(holdings, target, live_nodes=live)
    assert rp.step == 6  # step 7 lacks units
    assert {f.kind for f in rp.fetches[0]} == {FetchKind.LOCAL}  # rank 0 runs on b
    assert {(f.kind, f.source_node) for f in rp.fetches[1]} == {(FetchKind.REPLICA, "b")}

    for node in (b, c):
        rank_dirs = {
            s.rank: tmp_path / f"resume-{s.rank}" for s in target.ranks_on(node.store.node_id)
        }
        manifests = prepare_resume(node.store, rp, rank_dirs, peers=live)
        for rank, d in rank_dirs.items():
            manifest = verify_step_dir(d)
            assert manifest == manifests[rank] and manifest.step == 6
            for e in manifest.pieces:
                assert (d / e.key.filename).read_bytes() == piece_bytes(
                    e.key.filename, 6, "a", 5000
                )
    stage1 = verify_step_dir(tmp_path / "resume-1")
    assert {e.key.unit for e in stage1.pieces} == {"block.0001", "head"}
    assert {e.key.tp_rank for e in stage1.pieces} == {0, 1}  # both slices, to reshard


def test_serve_helper_binds_a_free_port(tmp_path: Path):
    store = LocalStore(tmp_path, "solo")
    server, port = serve(store, lambda: 0)
    try:
        with StateClient(f"127.0.0.1:{port}") as client:
            assert client.list_steps(0).node_id == "solo"
    finally:
        server.stop(None)


class _WatchedSlots:
    """A servicer's fetch slots that call `on_refusal` whenever a transfer is turned away."""

    def __init__(self, inner, on_refusal) -> None:
        self.inner, self.on_refusal = inner, on_refusal

    def take(self, peer: str) -> bool:
        ok = self.inner.take(peer)
        if not ok:
            self.on_refusal()
        return ok

    def give(self, peer: str) -> None:
        self.inner.give(peer)


def _hold_the_only_slot(a: Node):
    """A slow reader: a raw FetchPiece stream that reads one chunk and then nothing. Its
    receive window stays at the initial 64 KiB (no BDP probing): grown by probing, it took
    the whole 16 MiB piece now and then under load, the server's handler ended and the slot
    was free again (the busy-budget test then fetched the piece, once in a CI run)."""
    channel = grpc.insecure_channel(a.address, options=[("grpc.http2.bdp_probe", 0)])
    request = state_pb2.FetchPieceRequest(generation=0, step=1, name=NAME, origin_node="a")
    held = state_pb2_grpc.StateServiceStub(channel).FetchPiece(request, timeout=30)
    next(held)
    return channel, held


def test_F8_a_reader_below_the_rate_floor_is_cut_by_the_server_and_its_slot_freed(tmp_path, nodes):
    """The review's F8: a slow reader held a transfer slot for as long as it liked (no
    server-side deadline or rate floor), so 16 of them stalled every recovery. Now a stream
    read slower than the floor is cancelled by the server, and the slot serves others."""
    import time

    nodes["a"] = a = Node(
        tmp_path, "a", max_fetch_streams=1, chunk_bytes=64 << 10,
        min_bytes_per_s=64 << 20, grace_s=0.5,
    )  # fmt: skip
    commit_step(a.store, 1, [NAME], size=16 << 20)
    sha = a.store.piece_info("a", 1, NAME).sha256
    channel, held = _hold_the_only_slot(a)  # never cancelled by the reader
    started = time.monotonic()
    try:
        with StateClient(a.address, resume_attempts=1) as client:
            assert client.fetch_piece(1, NAME, "a", tmp_path / "out", sha, 0) == 16 << 20
        with pytest.raises(grpc.RpcError) as cut:
            for _ in held:
                pass
        assert cut.value.code() is grpc.StatusCode.CANCELLED
    finally:
        channel.close()
    assert time.monotonic() - started < 20  # the slot came free at ~0.75 s, not at 30 s
    assert a.servicer._fetch_slots.held() == {}


def test_F8_one_peer_cannot_take_every_transfer_slot(tmp_path, nodes):
    from elasticpp.store.service import PeerSlots

    slots = PeerSlots(total=4, per_peer=2)
    assert slots.take("cn:n1") and slots.take("cn:n1") and not slots.take("cn:n1")
    assert slots.take("cn:n2") and slots.take("cn:n2") and not slots.take("cn:n3")  # full
    slots.give("cn:n1")
    assert slots.take("cn:n3") and slots.held() == {"cn:n1": 1, "cn:n2": 2, "cn:n3": 1}
    # Live: a second idle stream of the same caller is turned away while slots are left.
    nodes["a"] = a = Node(tmp_path, "a", max_fetch_streams=4, max_streams_per_peer=1,
                          chunk_bytes=64 << 10)  # fmt: skip
    commit_step(a.store, 1, [NAME], size=16 << 20)
    channel, held = _hold_the_only_slot(a)
    try:
        request = state_pb2.FetchPieceRequest(generation=0, step=1, name=NAME, origin_node="a")
        second = state_pb2_grpc.StateServiceStub(channel).FetchPiece(request, timeout=10)
        with pytest.raises(grpc.RpcError) as busy:
            next(second)
        assert busy.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        held.cancel()
        channel.close()


def test_a_busy_source_is_asked_again_after_a_pause_until_its_slot_is_free(tmp_path, nodes):
    # One transfer slot, held by a slow reader; the slot is freed only after the second
    # fetch has been turned away more often than it may resume a broken stream. Busy is
    # load, not a broken stream: the fetch waits and then succeeds.
    nodes["a"] = a = Node(tmp_path, "a", max_fetch_streams=1, chunk_bytes=64 << 10)
    commit_step(a.store, 1, [NAME], size=16 << 20)
    sha = a.store.piece_info("a", 1, NAME).sha256
    channel, held = _hold_the_only_slot(a)
    refusals: list[int] = []

    def refused() -> None:
        refusals.append(1)
        if len(refusals) == 3:
            held.cancel()  # the slow reader goes away

    a.servicer._fetch_slots = _WatchedSlots(a.servicer._fetch_slots, refused)
    try:
        with StateClient(a.address, resume_attempts=1) as client:
            assert client.fetch_piece(1, NAME, "a", tmp_path / "out", sha, 0) == 16 << 20
    finally:
        channel.close()
    assert len(refusals) >= 3
    assert hashlib.sha256((tmp_path / "out").read_bytes()).hexdigest() == sha


def test_a_source_busy_past_the_budget_fails_the_piece_naming_it(tmp_path, nodes):
    nodes["a"] = a = Node(tmp_path, "a", max_fetch_streams=1, chunk_bytes=64 << 10)
    commit_step(a.store, 1, [NAME], size=16 << 20)
    sha = a.store.piece_info("a", 1, NAME).sha256
    channel, _held = _hold_the_only_slot(a)
    now = [0.0]

    def clock() -> float:  # every look at the clock finds 0.4 s more gone
        now[0] += 0.4
        return now[0]

    try:
        with (
            StateClient(a.address, busy_budget_s=1.0, clock=clock) as client,
            pytest.raises(PieceFetchError, match=f"piece {NAME}.*busy"),
        ):
            client.fetch_piece(1, NAME, "a", tmp_path / "out", sha, 0)
    finally:
        channel.close()
    assert list(tmp_path.glob("*out*")) == []


class LyingServicer(StateServicer):
    """Announces `announce` bytes in the first chunk, or sends `extra` bytes past the end."""

    def __init__(self, *args, announce: int | None = None, extra: int = 0, **kw) -> None:
        super().__init__(*args, **kw)
        self.announce, self.extra = announce, extra
        self.requests = 0

    def FetchPiece(self, request, context):
        self.requests += 1
        end = 0
        for i, chunk in enumerate(super().FetchPiece(request, context)):
            if i == 0 and self.announce is not None:
                chunk = Chunk(chunk.offset, chunk.data, self.announce, chunk.sha256)
            end = chunk.offset + len(chunk.data)
            yield chunk
        for _ in range(self.extra // 4096):
            yield Chunk(end, b"\0" * 4096)
            end += 4096


def test_a_peer_announcing_another_size_is_refused_at_the_first_chunk(tmp_path, nodes):
    nodes["a"] = a = Node(tmp_path, "a", LyingServicer, announce=1 << 40, chunk_bytes=64 << 10)
    commit_step(a.store, 1, [NAME], size=1 << 20)
    info = a.store.piece_info("a", 1, NAME)
    with (
        StateClient(a.address) as client,
        pytest.raises(PieceFetchError, match=f"announces {1 << 40} bytes, expected {1 << 20}"),
    ):
        client.fetch_piece(1, NAME, "a", tmp_path / "out", info.sha256, 0, expected_size=info.size)
    assert a.servicer.requests == 1  # refused, not fetched again as if it were corrupt
    assert list(tmp_path.glob("*out*")) == []


@pytest.mark.parametrize("expected", [True, False])
def test_a_peer_sending_more_than_the_size_is_refused_and_nothing_past_it_is_written(
    tmp_path, nodes, expected
):
    nodes["a"] = a = Node(tmp_path, "a", LyingServicer, extra=1 << 20, chunk_bytes=64 << 10)
    commit_step(a.store, 1, [NAME], size=1 << 20)
    info = a.store.piece_info("a", 1, NAME)
    written: list[int] = []
    with (
        StateClient(a.address) as client,
        pytest.raises(PieceFetchError, match=f"more than the {1 << 20} bytes"),
    ):
        client.fetch_piece(
            1,
            NAME,
            "a",
            tmp_path / "out",
            info.sha256,
            0,
            expected_size=info.size if expected else None,
            on_bytes=written.append,
        )
    assert sum(written) == 1 << 20  # the file never grew past the size
    assert a.servicer.requests == 1
    assert list(tmp_path.glob("*out*")) == []


def test_replication_follows_an_origin_into_a_new_epoch(tmp_path: Path, nodes):
    nodes["a"] = a = Node(tmp_path, "a", store_kw={"epoch": 1})
    nodes["b"] = b = Node(tmp_path, "b", store_kw={"epoch": 1})
    peers = {"a": a.address, "b": b.address}

    def commit(step: int, generation: int) -> None:
        d = a.store.snapshot_dir(generation) / step_dirname(step)
        d.mkdir(parents=True, exist_ok=True)
        data = piece_bytes(NAME, step, "a", 100)
        (d / NAME).write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        a.store.record_pieces(step, [{"name": NAME, "size": 100, "sha256": sha}], generation)
        a.store.commit(step, MODEL.units, generation)

    for step in (100, 101):
        commit(step, 5)
    replicate_once(b.store, peers, ["a", "b"], 1, 5)
    assert b.store.committed_steps("a") == [101]
    # etcd was wiped: a commits in a new epoch, generation numbers start again at 1.
    a.store.set_epoch(2)
    b.store.set_epoch(2)
    commit(102, 1)
    results = replicate_once(b.store, peers, ["a", "b"], 1, 1)
    assert [(r.origin, r.step, r.copied) for r in results] == [("a", 102, 1)]
    assert b.store.committed("a", 102).order == (2, 1, 102)
    assert b.store.committed_steps("a") == [101, 102]


def test_a_request_of_an_older_epoch_is_refused_and_one_of_a_newer_epoch_served(
    tmp_path: Path, nodes
):
    nodes["a"] = a = Node(tmp_path, "a")
    commit_step(a.store, 1, [NAME])
    a.store.set_epoch(7)
    a.generation = 5
    with StateClient(a.address) as client:
        # A node still on the epoch before an etcd wipe: fenced whatever its generation.
        with pytest.raises(StaleGenerationError, match="epoch 6 is older than this node's"):
            client.list_steps(9, epoch=6)
        with pytest.raises(StaleGenerationError, match="epoch 6"):
            client.fetch_piece(1, NAME, "a", tmp_path / "x", "0" * 64, 9, epoch=6)
        # Generation numbers restart at 1 in a newer epoch, which this node has not joined.
        assert ("a", 1) in client.list_steps(1, epoch=8).steps
        with pytest.raises(StaleGenerationError, match="generation 4 is older"):
            client.list_steps(4, epoch=7)
    with StateClient(a.address) as client, pytest.raises(StaleGenerationError):
        client.list_steps(4)  # an older sender (no epoch): generations alone, as before


def test_with_an_authorize_hook_a_refused_piece_is_permission_denied_and_nothing_sent(
    tmp_path: Path, nodes
):
    asks = []

    def authorize(who, ask):
        asks.append((who, ask))
        if ask.key.unit == "head":
            return grpc.StatusCode.PERMISSION_DENIED, "not assigned: head"
        return None

    nodes["a"] = a = Node(tmp_path, "a", authorize=authorize)
    head = PieceKey("head", 0, 2).filename
    commit_step(a.store, 4, [NAME, head])
    held = StateClient(a.address).list_steps(0).steps[("a", 4)].pieces
    with StateClient(a.address) as client:
        dest = tmp_path / "ok.safetensors"
        assert client.fetch_piece(4, NAME, "a", dest, held[NAME].sha256, 0) == 5000
        with pytest.raises(PieceFetchError, match="PERMISSION_DENIED: not assigned: head"):
            client.fetch_piece(4, head, "a", tmp_path / "no", held[head].sha256, 0)
    assert not (tmp_path / "no").exists()
    # Plaintext: no certificate name; the hook sees the checked names.
    assert [(w, k.origin, k.step, k.key.filename) for w, k in asks] == [
        (None, "a", 4, NAME),
        (None, "a", 4, head),
    ]


def test_a_newer_generations_piece_waits_for_the_source_to_reach_it_then_is_unavailable(
    tmp_path: Path, nodes
):
    """The fence with an authorize hook: a caller's own generation opens nothing by itself.
    A request of a newer generation is held until this node reaches it (the source's watch
    lags by milliseconds), and refused UNAVAILABLE once the catch-up time is out."""
    nodes["a"] = a = Node(tmp_path, "a", authorize=lambda who, ask: None, catch_up_s=0.5, threads=8)
    commit_step(a.store, 1, [NAME])
    a.generation = 5
    stub = state_pb2_grpc.StateServiceStub(grpc.insecure_channel(a.address))
    request = state_pb2.FetchPieceRequest(generation=2**64 - 1, step=1, name=NAME, origin_node="a")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.FetchPiece(request, timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "at generation 5" in info.value.details()
    # One generation ahead, and the source gets there while the request waits: served.
    nodes["b"] = b = Node(tmp_path, "b", authorize=lambda who, ask: None, catch_up_s=30.0)
    commit_step(b.store, 1, [NAME])
    b.generation = 5
    stub = state_pb2_grpc.StateServiceStub(grpc.insecure_channel(b.address))
    request = state_pb2.FetchPieceRequest(generation=6, step=1, name=NAME, origin_node="b")
    replies = stub.FetchPiece(request, timeout=20)
    timer = threading.Timer(0.3, lambda: setattr(b, "generation", 6))
    timer.start()
    try:
        assert b"".join(bytes(c.data) for c in replies) == piece_bytes(NAME, 1, "b", 5000)
    finally:
        timer.cancel()
