"""The gRPC servicer of `elasticpp.state.v1.StateService`: a thin translation layer.

Requests become `LocalStore` calls; errors become status codes:
- a request of an older job epoch than the server's, or of an older plan generation of the
  same epoch: FAILED_PRECONDITION, naming both (a newer epoch's request is served whatever its
  generation: generation numbers restart at 1 in a new epoch; epoch 0 means unknown and
  compares generations alone);
- a bad piece name (anything `PieceKey.parse` refuses, e.g. with `..` or `/`), a bad origin
  node id or a negative value: INVALID_ARGUMENT (so no name can address a path outside the
  store);
- a step or piece the node does not hold committed: NOT_FOUND;
- with an `authorize` hook (the agent's): a piece the caller's plan does not assign it
  (`store.grants`): PERMISSION_DENIED; a request of a newer generation (or epoch) than this
  node's is held until this node reaches it (its watch lags the caller's by milliseconds),
  for at most `catch_up_s`, then UNAVAILABLE (the client asks again): a caller's own number
  never opens anything by itself.
`ListHoldings` pages what the node holds of the steps asked for: at most `page_pieces` pieces
per reply (capped at `MAX_PAGE_PIECES`), so a reply stays far below the message limit however
much a node holds; its page token is the last piece listed, (step, origin, name), so a page
resumes after it and nothing is kept on the server between pages. Each step names its piece
count in all, so a reader notices a step that changed between pages.
Pieces are streamed from the file in `CHUNK_BYTES` chunks; a file is never loaded whole.
Chunks are encoded by `elasticpp.store.wire` (the protobuf wire format of
`FetchPieceResponse`, written without building messages: the bulk path's cost).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import IO, Any

import grpc

from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.rpc.state.v1 import state_pb2, state_pb2_grpc
from elasticpp.store.holdings import NodeHoldings, check_node_id
from elasticpp.store.local import LocalStore, PieceNotFoundError
from elasticpp.store.wire import Chunk, decode_chunk, encode_chunk
from elasticpp.transport import peer_identity

log = logging.getLogger(__name__)

# 1 MiB chunks measured fastest on loopback (bench/transfer.py); messages stay far below
# the limit below, which also bounds what a peer can make us buffer.
CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 16 << 20
GRPC_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


def holdings_to_proto(holdings: NodeHoldings, generation: int) -> state_pb2.ListStepsResponse:
    return state_pb2.ListStepsResponse(
        node_id=holdings.node_id,
        generation=generation,
        steps=[
            state_pb2.StepHolding(
                origin_node=h.origin,
                step=h.step,
                generation=h.generation,
                epoch=h.epoch,
                units=list(h.units),
                pieces=[
                    state_pb2.PieceInfo(name=n, size=i.size, sha256=i.sha256)
                    for n, i in sorted(h.pieces.items())
                ],
            )
            for _, h in sorted(holdings.steps.items())
        ],
    )


# ListHoldings pages: ~150 bytes per piece listed, so 4,096 pieces are ~600 KiB.
PAGE_PIECES = 1024
MAX_PAGE_PIECES = 4096
MAX_STEPS_ASKED = 1024


_STEP_DIGITS = re.compile(r"[0-9]{1,19}")  # a step number: ASCII digits, bounded


def _page_token(step: int, origin: str, name: str) -> str:
    return f"{step}/{origin}/{name}"


def parse_page_token(token: str) -> tuple[int, str, str]:
    """(step, origin, piece name) of a ListHoldings page token; ConfigError if malformed."""
    step, _, rest = token.partition("/")
    origin, _, name = rest.partition("/")
    if not _STEP_DIGITS.fullmatch(step):
        raise ConfigError(f"page_token {token!r:.80}: not a token this server gave")
    PieceKey.parse(name)
    return int(step), check_node_id(origin, field_name="page_token origin"), name


def holdings_page(
    holdings: NodeHoldings,
    steps: set[int],
    after: tuple[int, str, str] | None,
    page_pieces: int,
    generation: int,
) -> state_pb2.ListHoldingsResponse:
    """One page of `holdings` restricted to `steps`, after the piece `after` (exclusive)."""
    reply = state_pb2.ListHoldingsResponse(node_id=holdings.node_id, generation=generation)
    left = page_pieces
    for (origin, step), h in sorted(holdings.steps.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if step not in steps or (after is not None and (step, origin) < after[:2]):
            continue
        names = sorted(h.pieces)
        if after is not None and (step, origin) == after[:2]:
            names = [n for n in names if n > after[2]]
        if not names:
            continue
        if left == 0:
            return reply  # next_page_token was set with the last piece listed
        taken = names[:left]
        left -= len(taken)
        reply.steps.append(
            state_pb2.StepHolding(
                origin_node=origin,
                step=step,
                generation=h.generation,
                epoch=h.epoch,
                units=list(h.units),
                pieces=[
                    state_pb2.PieceInfo(name=n, size=h.pieces[n].size, sha256=h.pieces[n].sha256)
                    for n in taken
                ],
                piece_count=len(h.pieces),
            )
        )
        reply.next_page_token = _page_token(step, origin, taken[-1])
    reply.next_page_token = "" if left > 0 else reply.next_page_token
    return reply


SERVICE_NAME = "elasticpp.state.v1.StateService"
LIST_STEPS_METHOD = f"/{SERVICE_NAME}/ListSteps"
FETCH_PIECE_METHOD = f"/{SERVICE_NAME}/FetchPiece"


# A piece stream the caller reads slower than this (after STREAM_GRACE_S) is cut: the same
# floor as the client's own stall rule, so a slow or idle reader cannot hold a slot for ever.
MIN_BYTES_PER_S = 1 << 20
STREAM_GRACE_S = 30.0


class PeerSlots:
    """At most `total` piece streams at once, and at most `per_peer` of them for one caller
    (its certificate's name, else its address): one peer cannot take every slot."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = max(1, min(per_peer, total))
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    def take(self, peer: str) -> bool:
        with self._lock:
            if sum(self._held.values()) >= self.total or self._held.get(peer, 0) >= self.per_peer:
                return False
            self._held[peer] = self._held.get(peer, 0) + 1
            return True

    def give(self, peer: str) -> None:
        with self._lock:
            left = self._held.get(peer, 0) - 1
            if left > 0:
                self._held[peer] = left
            else:
                self._held.pop(peer, None)

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)


def caller_of(context: grpc.ServicerContext) -> str:
    """Who is calling: the common name of its TLS client certificate, else its address."""
    name = peer_identity(context)
    if name is not None:
        return "cn:" + name
    peer = str(context.peer())
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


@dataclass(frozen=True)
class PieceAsk:
    """One FetchPiece request, its names checked: what `authorize` decides on."""

    generation: int
    epoch: int
    origin: str
    step: int
    key: PieceKey


# The hook: (the caller's certificate name or None, the request) -> None, or a refusal.
Authorize = Callable[[str | None, PieceAsk], tuple[grpc.StatusCode, str] | None]

# A newer generation's request waits this long for this node to reach it.
CATCH_UP_S = 5.0


class StateServicer(state_pb2_grpc.StateServiceServicer):
    """Serves one `LocalStore`. `generation_fn` returns the node's current plan generation.

    Piece streams: at most `max_fetch_streams` at once and `max_streams_per_peer` for one
    caller; a stream read slower than `min_bytes_per_s` (after `grace_s`) is cancelled by the
    server, so a slow or idle reader frees its slot. `authorize`, when given, decides every
    piece request at this node's own generation (see the module docstring)."""

    def __init__(
        self,
        store: LocalStore,
        generation_fn: Callable[[], int],
        chunk_bytes: int = CHUNK_BYTES,
        max_fetch_streams: int | None = None,
        *,
        max_streams_per_peer: int = 4,
        min_bytes_per_s: float = MIN_BYTES_PER_S,
        grace_s: float = STREAM_GRACE_S,
        authorize: Authorize | None = None,
        catch_up_s: float = CATCH_UP_S,
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes > MAX_MESSAGE_BYTES - 4096:
            raise ConfigError(f"chunk_bytes must be in (0, {MAX_MESSAGE_BYTES - 4096}]")
        if max_fetch_streams is not None and max_fetch_streams < 1:
            raise ConfigError(f"max_fetch_streams must be >= 1, got {max_fetch_streams}")
        self._store = store
        self._generation_fn = generation_fn
        self._chunk_bytes = chunk_bytes
        # Piece streams have a limit of their own, so that a burst of transfers can never
        # take the server threads that health checks and other unary calls need.
        self._fetch_slots = (
            PeerSlots(max_fetch_streams, max_streams_per_peer) if max_fetch_streams else None
        )
        self._min_bytes_per_s = min_bytes_per_s
        self._grace_s = grace_s
        self._authorize = authorize
        self._catch_up_s = catch_up_s

    def _check_generation(
        self, requested: int, requested_epoch: int, context: grpc.ServicerContext
    ) -> None:
        epoch = self._store.epoch
        if requested_epoch and epoch and requested_epoch != epoch:
            if requested_epoch < epoch:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"request of job epoch {requested_epoch} is older than this node's "
                    f"epoch {epoch}",
                )
            return  # a newer epoch, which this node has not joined yet
        current = self._generation_fn()
        if requested < current:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request of generation {requested} is older than this node's generation {current}",
            )

    def _behind(self, requested: int, requested_epoch: int) -> bool:
        epoch = self._store.epoch
        if requested_epoch and epoch and requested_epoch != epoch:
            return requested_epoch > epoch
        return requested > self._generation_fn()

    def _catch_up(
        self, requested: int, requested_epoch: int, context: grpc.ServicerContext
    ) -> None:
        """Hold a request of a newer generation until this node reaches it, at most
        `catch_up_s`; then UNAVAILABLE."""
        deadline = time.monotonic() + self._catch_up_s
        while self._behind(requested, requested_epoch):
            if time.monotonic() >= deadline or not context.is_active():
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"this node is at generation {self._generation_fn()} (epoch "
                    f"{self._store.epoch}); it has not reached generation {requested} "
                    f"(epoch {requested_epoch}) yet",
                )
            time.sleep(0.01)

    def ListSteps(
        self, request: state_pb2.ListStepsRequest, context: grpc.ServicerContext
    ) -> state_pb2.ListStepsResponse:
        self._check_generation(request.generation, request.epoch, context)
        return holdings_to_proto(self._store.holdings(), self._generation_fn())

    def ListHoldings(
        self, request: state_pb2.ListHoldingsRequest, context: grpc.ServicerContext
    ) -> state_pb2.ListHoldingsResponse:
        self._check_generation(request.generation, request.epoch, context)
        if not request.steps or len(request.steps) > MAX_STEPS_ASKED:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"steps: ask for 1 to {MAX_STEPS_ASKED} step numbers, got {len(request.steps)}",
            )
        try:
            after = parse_page_token(request.page_token) if request.page_token else None
        except (ConfigError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        page = min(request.page_pieces or PAGE_PIECES, MAX_PAGE_PIECES)
        return holdings_page(
            self._store.holdings(), set(request.steps), after, page, self._generation_fn()
        )

    def FetchPiece(
        self, request: state_pb2.FetchPieceRequest, context: grpc.ServicerContext
    ) -> Iterator[Chunk]:
        self._check_generation(request.generation, request.epoch, context)
        try:
            key = PieceKey.parse(request.name)
            origin = check_node_id(request.origin_node, field_name="origin_node")
        except (ConfigError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._authorize is not None:
            self._catch_up(request.generation, request.epoch, context)
            ask = PieceAsk(request.generation, request.epoch, origin, request.step, key)
            refused = self._authorize(peer_identity(context), ask)
            if refused is not None:
                context.abort(*refused)
        slots = self._fetch_slots
        caller = caller_of(context)
        if slots is not None and not slots.take(caller):
            # The client asks again after a jittered, growing pause (busy, not broken).
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many piece transfers now")
        try:
            yield from self._serve_piece(origin, key, request, context)
        finally:
            if slots is not None:
                slots.give(caller)

    def _serve_piece(
        self,
        origin: str,
        key: PieceKey,
        request: state_pb2.FetchPieceRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[Chunk]:
        try:
            with self._store.open_piece(origin, request.step, key.filename) as (f, info):
                if request.offset > info.size:
                    context.abort(
                        grpc.StatusCode.OUT_OF_RANGE,
                        f"offset {request.offset} is past the end of {key.filename} "
                        f"({info.size} bytes)",
                    )
                # Asked again after a checksum mismatch: hash what is read, so that a copy
                # corrupt here is dropped, not fetched by peer after peer.
                check = request.verify and request.offset == 0
                digest = hashlib.sha256() if check else None
                # A server-side deadline for the stream: a reader below the rate floor is
                # cut (while it does not read, this generator is parked in a yield).
                allowed_s = self._grace_s + (info.size - request.offset) / self._min_bytes_per_s
                cutoff = threading.Timer(allowed_s, context.cancel)
                cutoff.daemon = True
                cutoff.start()
                try:
                    yield from self._stream(f, info.size, info.sha256, request, context, digest)
                finally:
                    cutoff.cancel()
            if digest is not None:
                try:
                    self._store.served(origin, request.step, key.filename, info, digest.hexdigest())
                except CheckpointError as exc:
                    context.abort(
                        grpc.StatusCode.DATA_LOSS,
                        f"{exc} on the source, where its commit is dropped",
                    )
        except PieceNotFoundError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    def _stream(
        self,
        f: IO[bytes],
        size: int,
        sha256: str,
        request: state_pb2.FetchPieceRequest,
        context: grpc.ServicerContext,
        digest: Any = None,
    ) -> Iterator[Chunk]:
        """The piece's chunks from `request.offset`; `digest` (a hashlib object), when given,
        is fed every byte read."""
        read = f.read
        f.seek(request.offset)
        offset = request.offset
        first = True
        while first or offset < size:
            data = read(min(self._chunk_bytes, size - offset))
            if offset < size and not data:
                context.abort(grpc.StatusCode.DATA_LOSS, f"{request.name} is shorter than listed")
            if digest is not None:
                digest.update(data)
            if first:
                yield Chunk(offset, data, size, sha256)
                first = False
            else:
                # A plan switch mid-transfer fences the rest of it.
                self._check_generation(request.generation, request.epoch, context)
                yield Chunk(offset, data)
            offset += len(data)


def add_to_server(server: grpc.Server, servicer: StateServicer) -> None:
    """Register the state service; FetchPiece chunks use the hand-written encoder."""
    handlers = {
        "ListSteps": grpc.unary_unary_rpc_method_handler(
            servicer.ListSteps,
            request_deserializer=state_pb2.ListStepsRequest.FromString,
            response_serializer=state_pb2.ListStepsResponse.SerializeToString,
        ),
        "ListHoldings": grpc.unary_unary_rpc_method_handler(
            servicer.ListHoldings,
            request_deserializer=state_pb2.ListHoldingsRequest.FromString,
            response_serializer=state_pb2.ListHoldingsResponse.SerializeToString,
        ),
        "FetchPiece": grpc.unary_stream_rpc_method_handler(
            servicer.FetchPiece,
            request_deserializer=state_pb2.FetchPieceRequest.FromString,
            response_serializer=encode_chunk,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def fetch_piece_callable(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    """The client side of FetchPiece, yielding `Chunk`s whose data is not copied."""
    return channel.unary_stream(
        FETCH_PIECE_METHOD,
        request_serializer=state_pb2.FetchPieceRequest.SerializeToString,
        response_deserializer=decode_chunk,
        _registered_method=True,
    )


def serve(
    store: LocalStore,
    generation_fn: Callable[[], int],
    address: str = "127.0.0.1:0",
    *,
    max_workers: int = 8,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[grpc.Server, int]:
    """A started server with only the state service (tests, benchmarks); returns (server, port).

    The agent instead adds `StateServicer` to its own server with `add_to_server`, and
    creates that server with `GRPC_OPTIONS`.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)
    add_to_server(server, StateServicer(store, generation_fn, chunk_bytes))
    port = server.add_insecure_port(address)
    if port == 0:
        raise ConfigError(f"state service: cannot bind {address}")
    server.start()
    return server, port
