"""Client of `elasticpp.state.v1.StateService`: list a peer's holdings, fetch one piece.

A fetch writes to a temporary file beside its destination, hashing as it writes; when the
stream breaks it asks again from the last byte it has (the hash state carries over); it
checks size and sha256 before an atomic rename, and on a mismatch fetches the whole piece
again, a bounded number of times, then raises `CheckpointError` naming the piece. Nothing
received is interpreted: bytes go to a file.

Invariants:
- a busy source (RESOURCE_EXHAUSTED: all its transfer slots taken) is asked again after a
  jittered, exponentially growing pause, within `busy_budget_s` per piece; being busy is
  load, not a fault, and does not count against the broken-stream attempts;
- the size a peer announces must be the size the caller expects (refused at the first
  chunk), and nothing past that size is ever written: a buggy or hostile peer cannot fill
  the receiver's disk;
- a fetch can be cancelled (`cancel`): it stops between chunks and during a pause, and
  leaves no file behind.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import grpc

from elasticpp.checkpoint.durable import durable_file
from elasticpp.checkpoint.manifest import PieceKey
from elasticpp.errors import CheckpointError, ConfigError, StaleGenerationError
from elasticpp.names import parse_name
from elasticpp.rpc.state.v1 import state_pb2, state_pb2_grpc
from elasticpp.store.holdings import NodeHoldings, PieceInfo, StepHolding, check_node_id
from elasticpp.store.service import GRPC_OPTIONS, fetch_piece_callable
from elasticpp.transport import Dialer

log = logging.getLogger(__name__)

# Status codes after which the same request may succeed: the stream broke, the peer is
# restarting, or a chunk was refused. Anything else is an answer, not a glitch: DATA_LOSS
# among them, the source's word that its copy is corrupt or shorter than listed (asking it
# again gets the same bytes).
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
}

# A busy source is asked again after BUSY_FIRST_PAUSE_S, doubling up to BUSY_MAX_PAUSE_S,
# each pause drawn from [pause/2, pause] so that the receivers a source turned away do not
# come back in lockstep; after BUSY_BUDGET_S of refusals the piece fails.
BUSY_FIRST_PAUSE_S = 0.05
BUSY_MAX_PAUSE_S = 2.0
BUSY_BUDGET_S = 30.0


def busy_pause_s(refusals: int, rng: random.Random) -> float:
    """The pause after the `refusals`-th RESOURCE_EXHAUSTED in a row (1, 2, ...)."""
    ceiling = min(BUSY_MAX_PAUSE_S, BUSY_FIRST_PAUSE_S * 2.0 ** min(refusals - 1, 30))
    return ceiling * (0.5 + 0.5 * rng.random())


class _Mismatch(Exception):
    """A fetched piece whose checksum or size is not the one expected (fetched again)."""


class PieceFetchError(CheckpointError):
    """A piece could not be fetched from a peer (gone, refused, or corrupt every time)."""


def _raise_for(exc: grpc.RpcError, what: str) -> None:
    code = exc.code()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        raise StaleGenerationError(f"{what}: {exc.details()}") from exc
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise ConfigError(f"{what}: {exc.details()}") from exc
    raise PieceFetchError(f"{what}: {code.name}: {exc.details()}") from exc


# A peer lists what it holds of the steps asked for in at most this many pages (4,096 pieces
# each at most): far more than a node holds.
MAX_HOLDINGS_PAGES = 256


def _step_from_proto(s: state_pb2.StepHolding) -> StepHolding:
    """A step as a peer listed it, its names checked; ConfigError if one is bad."""
    origin = check_node_id(s.origin_node, field_name="origin_node")
    pieces = {}
    for p in s.pieces:
        PieceKey.parse(p.name)
        pieces[p.name] = PieceInfo(p.size, p.sha256)
    units = tuple(parse_name(u, what="unit") for u in s.units)
    return StepHolding(origin, s.step, units, pieces, s.generation, s.epoch)


def _joined(first: StepHolding, more: StepHolding) -> StepHolding:
    """One step listed over two pages: the same commit, more pieces."""
    if (more.units, more.commit) != (first.units, first.commit):
        raise ConfigError(f"step {first.step} of {first.origin} changed between pages")
    return StepHolding(
        first.origin,
        first.step,
        first.units,
        {**first.pieces, **more.pieces},
        first.generation,
        first.epoch,
    )


class StateClient:
    """One channel to one peer's state service. Thread-safe; close it (or use `with`)."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 300.0,
        resume_attempts: int = 5,
        checksum_retries: int = 2,
        busy_budget_s: float = BUSY_BUDGET_S,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        dialer: Dialer | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.resume_attempts = resume_attempts
        self.checksum_retries = checksum_retries
        self.busy_budget_s = busy_budget_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._channel = (dialer or Dialer()).channel(address, options=GRPC_OPTIONS)
        self._stub = state_pb2_grpc.StateServiceStub(self._channel)
        self._fetch = fetch_piece_callable(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> StateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def list_steps(
        self, generation: int, *, epoch: int = 0, timeout_s: float = 10.0
    ) -> NodeHoldings:
        """The committed steps the peer holds (its own and its replicas); the request is of
        `generation` of job epoch `epoch` (0: unknown)."""
        try:
            reply = self._stub.ListSteps(
                state_pb2.ListStepsRequest(generation=generation, epoch=epoch), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            _raise_for(exc, f"list steps of {self.address}")
            raise  # unreachable; keeps the type checker content
        try:
            steps = {(h.origin, h.step): h for h in map(_step_from_proto, reply.steps)}
            return NodeHoldings(check_node_id(reply.node_id), steps)
        except ConfigError as exc:
            raise CheckpointError(f"list steps of {self.address}: bad reply: {exc}") from exc

    def list_holdings(
        self,
        generation: int,
        steps: Iterable[int],
        *,
        epoch: int = 0,
        timeout_s: float = 10.0,
        page_pieces: int = 0,
        max_pages: int = MAX_HOLDINGS_PAGES,
    ) -> NodeHoldings:
        """What the peer holds committed of `steps` (every origin's), read page by page
        within `timeout_s` in all. `CheckpointError` if a step's pieces do not add up to the
        count it names (it changed between pages) or the pages do not end."""
        what = f"list holdings of {self.address}"
        deadline = self._clock() + timeout_s
        request = state_pb2.ListHoldingsRequest(
            generation=generation, epoch=epoch, steps=sorted(set(steps)), page_pieces=page_pieces
        )
        node = ""
        parts: dict[tuple[str, int], StepHolding] = {}
        counts: dict[tuple[str, int], int] = {}
        for _ in range(max_pages):
            left_s = deadline - self._clock()
            if left_s <= 0:
                raise PieceFetchError(f"{what}: no answer within {timeout_s:.1f} s")
            try:
                reply = self._stub.ListHoldings(request, timeout=left_s)
            except grpc.RpcError as exc:
                _raise_for(exc, what)
                raise  # unreachable; keeps the type checker content
            try:
                node = check_node_id(reply.node_id)
                for proto in reply.steps:
                    h = _step_from_proto(proto)
                    key = (h.origin, h.step)
                    was = parts.get(key)
                    parts[key] = h if was is None else _joined(was, h)
                    counts[key] = proto.piece_count
            except ConfigError as exc:
                raise CheckpointError(f"{what}: bad reply: {exc}") from exc
            if not reply.next_page_token:
                break
            request.page_token = reply.next_page_token
        else:
            raise CheckpointError(f"{what}: more than {max_pages} pages")
        short = [k for k, h in parts.items() if len(h.pieces) != counts[k]]
        if short:
            origin, step = short[0]
            raise CheckpointError(
                f"{what}: step {step} of {origin} lists {len(parts[short[0]].pieces)} of "
                f"{counts[short[0]]} pieces (it changed while listed)"
            )
        return NodeHoldings(node, parts)

    def fetch_piece(
        self,
        step: int,
        name: str,
        origin: str,
        dest_path: Path,
        expected_sha256: str,
        generation: int,
        *,
        expected_size: int | None = None,
        fsync: bool = False,
        cancel: threading.Event | None = None,
        on_bytes: Callable[[int], None] | None = None,
        epoch: int = 0,
    ) -> int:
        """Fetch `origin`'s piece `name` of `step` into `dest_path`; returns its size.

        `dest_path` appears only complete and verified. Raises `StaleGenerationError` if
        the peer is on a newer generation (of `epoch`, the sender's job epoch; 0: unknown) or
        a newer epoch, `PieceFetchError` (a `CheckpointError`) if the
        peer does not hold the piece or every attempt failed its checksum. `fsync=True`
        makes the bytes durable before the rename (persistent copies); replicas and resume
        sources need not be, since every use re-verifies a piece's sha256 first.
        `expected_size` (the size the holdings list) is enforced from the first chunk on.
        `cancel`, once set, stops the fetch (`PieceFetchError`); `on_bytes(n)` is called
        with every `n` bytes written (progress, for a caller's deadline).
        """
        PieceKey.parse(name)
        check_node_id(origin, field_name="origin_node")
        dest_path = Path(dest_path)
        what = f"piece {name} of {origin} step {step} from {self.address}"
        if expected_size is not None and expected_size < 0:
            raise ConfigError(f"{what}: expected_size must be >= 0, got {expected_size}")
        stop = cancel or threading.Event()
        for attempt in range(self.checksum_retries + 1):
            try:
                with durable_file(dest_path, sync=fsync, sync_dir=fsync) as f:
                    size, digest = self._fetch_into(
                        f,
                        state_pb2.FetchPieceRequest(
                            generation=generation,
                            epoch=epoch,
                            step=step,
                            name=name,
                            origin_node=origin,
                            # After a mismatch the source checks its own copy (refused if
                            # corrupt).
                            verify=attempt > 0,
                        ),
                        what,
                        expected_size,
                        stop,
                        on_bytes,
                    )
                    if digest != expected_sha256 or expected_size not in (None, size):
                        raise _Mismatch  # nothing appears at dest_path
                return size
            except _Mismatch:
                log.warning(
                    "%s: checksum mismatch (attempt %d of %d); fetching again",
                    what,
                    attempt + 1,
                    self.checksum_retries + 1,
                )
        raise PieceFetchError(
            f"{what}: fails its checksum after {self.checksum_retries + 1} attempts"
        )

    def _fetch_into(
        self,
        f: BinaryIO,
        request: state_pb2.FetchPieceRequest,
        what: str,
        expected_size: int | None,
        cancel: threading.Event,
        on_bytes: Callable[[int], None] | None,
    ) -> tuple[int, str]:
        digest = hashlib.sha256()
        offset = 0
        total = expected_size  # the announced size must match it; nothing is written past it
        announced = False
        breaks = 0
        refusals = 0
        busy_since_s: float | None = None
        while not announced or offset < (total or 0):
            if cancel.is_set():
                raise PieceFetchError(f"{what}: cancelled at byte {offset}")
            request.offset = offset
            first = True
            try:
                for chunk in self._fetch(request, timeout=self.timeout_s):
                    if chunk.offset != offset:
                        # Out of order: the bytes so far cannot be trusted to line up.
                        raise PieceFetchError(f"{what}: chunk at {chunk.offset}, expected {offset}")
                    if first:  # it announces the piece's size
                        first = False
                        if total is not None and chunk.total_size != total:
                            raise PieceFetchError(
                                f"{what}: the peer announces {chunk.total_size} bytes, "
                                f"expected {total}"
                            )
                        total, announced = chunk.total_size, True
                        refusals, busy_since_s = 0, None
                    data = chunk.data
                    if offset + len(data) > (total or 0):
                        raise PieceFetchError(
                            f"{what}: the peer sends more than the {total} bytes announced"
                        )
                    f.write(data)
                    digest.update(data)
                    offset += len(data)
                    if on_bytes is not None:
                        on_bytes(len(data))
                    if cancel.is_set():
                        raise PieceFetchError(f"{what}: cancelled at byte {offset}")
                if not announced or offset < (total or 0):
                    raise PieceFetchError(f"{what}: stream ended at byte {offset}")
            except grpc.RpcError as exc:
                if cancel.is_set():  # its channel was closed to stop it
                    raise PieceFetchError(f"{what}: cancelled at byte {offset}") from exc
                code = exc.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # Busy, not broken: wait and ask again, within a budget of its own.
                    now_s = self._clock()
                    busy_since_s = now_s if busy_since_s is None else busy_since_s
                    refusals += 1
                    left_s = self.busy_budget_s - (now_s - busy_since_s)
                    if left_s <= 0:
                        raise PieceFetchError(
                            f"{what}: source busy (RESOURCE_EXHAUSTED) for "
                            f"{now_s - busy_since_s:.1f} s, {refusals} refusals"
                        ) from exc
                    pause_s = min(left_s, busy_pause_s(refusals, self._rng))
                    log.debug("%s: source busy; asking again in %.2f s", what, pause_s)
                    cancel.wait(pause_s)
                    continue
                if code not in _RETRYABLE or breaks >= self.resume_attempts:
                    _raise_for(exc, what)
                breaks += 1
                log.warning("%s: stream broke at byte %d (%s); resuming", what, offset, code.name)
        return offset, digest.hexdigest()
