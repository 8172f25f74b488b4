"""Fetch a resume's pieces from peers, in parallel with bounds; carry out a `ResumePlan`.

`fetch_pieces` is how the agent fetches: every remote piece is streamed by `StateClient`
(verified, size enforced) into one directory, at most `per_source` at a time from one source
and `parallel` in all, so that one node does not take every transfer slot of a source
(16 per agent) while the others of the same source wait. Its invariants:
- the transfers make progress or fail: no bytes for `stall_s`, or fewer than
  `min_bytes_per_s` over a window of `stall_s`, cancels them all and raises, so a trickling
  source cannot hold a node in MOVING for hours; `TransferProgress` also tells the caller
  when bytes last arrived;
- on the first failure the others are cancelled (their channels closed) and the error is
  raised; nothing half-written is left (the client writes beside and renames).

`prepare_resume` builds on it for a `ResumePlan`: for each rank of this node,
`rank_dirs[rank]` becomes a step directory in the checkpoint format (pieces +
`manifest.json`) holding what the rank needs at the resume step: local pieces are hard-linked
from the store (verified once), remote ones fetched (as above) or copied from the
persistent checkpoint (verified while copying) into the store's staging area once per node,
then linked into every rank that needs them.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from elasticpp.checkpoint.durable import link_or_copy
from elasticpp.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    PieceEntry,
    PieceKey,
    step_dirname,
    write_manifest,
)
from elasticpp.errors import ConfigError, StateUnavailableError
from elasticpp.store.client import PieceFetchError, StateClient
from elasticpp.store.local import LocalStore
from elasticpp.store.persist import copy_verified
from elasticpp.store.resolver import DISK_SOURCE, Fetch, FetchKind, ResumePlan

log = logging.getLogger(__name__)


FETCH_PER_SOURCE = 4  # concurrent transfers from one source, by default
FETCH_PARALLEL = 16  # concurrent transfers in all, by default
STALL_S = 30.0  # no bytes this long, or too few over a window this long: stalled
MIN_BYTES_PER_S = 1 << 20  # slower than this over a window: a trickle, not a transfer
_POLL_S = 0.1  # how often the transfers' progress is looked at


@dataclass(frozen=True)
class PieceTransfer:
    """One piece to fetch: `name` of `origin`'s `step`, from node `source`."""

    name: str
    origin: str
    source: str
    sha256: str
    size: int


class TransferProgress:
    """Bytes received by a set of transfers and when the last ones came (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.started_s = self.last_bytes_s = self._window_s = clock()
        self.bytes_done = self._window_bytes = 0

    def add(self, n: int) -> None:
        now_s = self._clock()
        with self._lock:
            self.bytes_done += n
            self.last_bytes_s = now_s

    def idle_s(self, now_s: float) -> float:
        """Seconds since bytes last arrived (or since the start)."""
        with self._lock:
            return now_s - self.last_bytes_s

    def stalled(self, now_s: float, *, stall_s: float, min_bytes_per_s: float) -> str | None:
        """Why the transfers count as stalled at `now_s`, or None. The rate is measured
        over consecutive windows of `stall_s` (a window closes when this is called)."""
        with self._lock:
            if now_s - self.last_bytes_s > stall_s:
                return f"no bytes for {now_s - self.last_bytes_s:.0f} s"
            window_s = now_s - self._window_s
            if window_s < stall_s:
                return None
            rate = (self.bytes_done - self._window_bytes) / window_s
            self._window_s, self._window_bytes = now_s, self.bytes_done
            if rate < min_bytes_per_s:
                return (
                    f"{rate:.0f} bytes/s over the last {window_s:.0f} s, below "
                    f"{min_bytes_per_s:.0f}"
                )
            return None


def fetch_pieces(
    transfers: Sequence[PieceTransfer],
    dest_dir: Path,
    addresses: Mapping[str, str],
    step: int,
    generation: int,
    *,
    per_source: int = FETCH_PER_SOURCE,
    parallel: int = FETCH_PARALLEL,
    progress: TransferProgress | None = None,
    stall_s: float = STALL_S,
    min_bytes_per_s: float = MIN_BYTES_PER_S,
    client_factory: Callable[[str], StateClient] = StateClient,
    clock: Callable[[], float] = time.monotonic,
    epoch: int = 0,
) -> None:
    """Fetch every transfer into `dest_dir / name` (see the module's invariants); requests
    carry `generation` and the sender's job `epoch` (0: unknown) as their fence.

    Raises `StateUnavailableError` for a source without an address, `PieceFetchError`
    when the transfers stall, else the first transfer's error.
    """
    if per_source < 1 or parallel < 1:
        raise ConfigError(f"per_source and parallel must be >= 1, got {per_source}, {parallel}")
    for t in transfers:
        if t.source not in addresses:
            raise StateUnavailableError(f"resume: no address for source node {t.source}")
    if not transfers:
        return
    progress = progress or TransferProgress(clock)
    cancel = threading.Event()
    clients = {s: client_factory(addresses[s]) for s in sorted({t.source for t in transfers})}
    pending = list(transfers)
    running: dict[Future[int], PieceTransfer] = {}
    busy = dict.fromkeys(clients, 0)
    error: BaseException | None = None

    def fetch(t: PieceTransfer) -> int:
        return clients[t.source].fetch_piece(
            step,
            t.name,
            t.origin,
            Path(dest_dir) / t.name,
            t.sha256,
            generation,
            expected_size=t.size,
            cancel=cancel,
            on_bytes=progress.add,
            epoch=epoch,
        )

    with ThreadPoolExecutor(
        max_workers=min(parallel, len(transfers)), thread_name_prefix="fetch"
    ) as pool:
        try:
            while (pending or running) and error is None:
                # Start what the bounds allow, in order: the first piece of a source
                # with a free slot.
                for t in list(pending):
                    if len(running) >= parallel:
                        break
                    if busy[t.source] < per_source:
                        busy[t.source] += 1
                        running[pool.submit(fetch, t)] = t
                        pending.remove(t)
                done, _ = wait(running, timeout=_POLL_S, return_when=FIRST_COMPLETED)
                for future in done:
                    t = running.pop(future)
                    busy[t.source] -= 1
                    exc = future.exception()
                    if exc is not None and error is None:
                        error = exc
                if error is None:
                    why = progress.stalled(
                        clock(), stall_s=stall_s, min_bytes_per_s=min_bytes_per_s
                    )
                    if why is not None:
                        error = PieceFetchError(
                            f"resume: transfers of step {step} stalled ({why}); "
                            f"{len(pending) + len(running)} of {len(transfers)} pieces left"
                        )
        finally:
            if error is not None or pending or running:
                # Stop the rest: between chunks (cancel), or blocked on a silent stream
                # (its channel closed under it).
                cancel.set()
            for client in clients.values():
                client.close()
    if error is not None:
        raise error
    log.info(
        "resume: fetched %d piece(s), %d bytes, from %d source(s)",
        len(transfers),
        progress.bytes_done,
        len(clients),
    )


def _staged_path(staging: Path, f: Fetch) -> Path:
    # "_disk" can never be a node id (those start with a letter or digit).
    origin = "_disk" if f.origin_node == DISK_SOURCE else f.origin_node
    return staging / origin / f.piece_name


def prepare_resume(
    store: LocalStore,
    resume: ResumePlan,
    rank_dirs: Mapping[int, Path],
    *,
    peers: Mapping[str, str],
    checkpoint_root: Path | None = None,
    client_factory: Callable[[str], StateClient] = StateClient,
    max_parallel: int = 4,
) -> dict[int, Manifest]:
    """Fill `rank_dirs` (rank -> directory, ranks of this node) for `resume`.

    `peers` maps node ids to state-service addresses (for PEER/REPLICA fetches);
    `checkpoint_root` is needed for DISK fetches. Returns each rank's manifest. Raises
    `CheckpointError` (naming the piece) when a piece cannot be had intact,
    `StaleGenerationError` when a peer has moved to a newer generation.
    """
    node = store.node_id
    for rank in rank_dirs:
        if resume.rank_nodes.get(rank) != node:
            raise ConfigError(f"resume: rank {rank} does not run on {node}")
    staging = store.staging_dir / f"gen-{resume.generation:08d}" / step_dirname(resume.step)
    _clear_old_staging(store.staging_dir, resume.generation)
    remote = [f for f in resume.node_fetches(node) if f.kind is not FetchKind.LOCAL]
    by_source: dict[str, list[Fetch]] = {}
    for f in remote:
        if not _staged_path(staging, f).is_file():
            by_source.setdefault(f.source_node, []).append(f)
    if by_source:
        with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(by_source)))) as pool:
            jobs = [
                pool.submit(
                    _fetch_all,
                    source,
                    fetches,
                    resume,
                    staging,
                    peers,
                    checkpoint_root,
                    client_factory,
                )
                for source, fetches in sorted(by_source.items())
            ]
            for job in jobs:
                job.result()
    manifests = {}
    for rank, rank_dir in sorted(rank_dirs.items()):
        rank_dir = Path(rank_dir)
        _clear_rank_dir(rank_dir)
        entries: list[PieceEntry] = []
        for f in resume.fetches[rank]:
            if f.kind is FetchKind.LOCAL:
                entries += store.materialize(rank_dir, [(f.origin_node, resume.step, f.piece_name)])
            else:
                link_or_copy(_staged_path(staging, f), rank_dir / f.piece_name)
                entries.append(PieceEntry(PieceKey.parse(f.piece_name), f.size, f.sha256))
        manifest = Manifest(resume.step, resume.units, tuple(sorted(entries, key=lambda e: e.key)))
        write_manifest(rank_dir, manifest)
        manifests[rank] = manifest
    log.info("resume: %s prepared %d rank dir(s); %s", node, len(manifests), resume.describe())
    return manifests


def _fetch_all(
    source: str,
    fetches: list[Fetch],
    resume: ResumePlan,
    staging: Path,
    peers: Mapping[str, str],
    checkpoint_root: Path | None,
    client_factory: Callable[[str], StateClient],
) -> None:
    for f in fetches:
        _staged_path(staging, f).parent.mkdir(parents=True, exist_ok=True)
    if fetches[0].kind is FetchKind.DISK:
        if checkpoint_root is None:
            raise ConfigError("resume: the plan reads the checkpoint but no checkpoint_root given")
        src_dir = Path(checkpoint_root) / step_dirname(resume.step)
        for f in fetches:
            copy_verified(src_dir / f.piece_name, _staged_path(staging, f), f.sha256, f.size)
        return
    # Staged per origin: one fetch_pieces call per (source, origin) directory.
    by_origin: dict[str, list[PieceTransfer]] = {}
    for f in fetches:
        by_origin.setdefault(f.origin_node, []).append(
            PieceTransfer(f.piece_name, f.origin_node, source, f.sha256, f.size)
        )
    for origin, transfers in sorted(by_origin.items()):
        fetch_pieces(
            transfers,
            staging / origin,
            peers,
            resume.step,
            resume.generation,
            client_factory=client_factory,
        )


def _clear_rank_dir(rank_dir: Path) -> None:
    """Remove what an earlier resume left (pieces, manifest); nothing else is touched."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    (rank_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for p in rank_dir.iterdir():
        try:
            PieceKey.parse(p.name)
        except ConfigError:
            continue
        p.unlink()


def _clear_old_staging(staging_root: Path, generation: int) -> None:
    for d in staging_root.glob("gen-*"):
        try:
            old = int(d.name[4:]) < generation
        except ValueError:
            continue
        if old:
            shutil.rmtree(d, ignore_errors=True)
