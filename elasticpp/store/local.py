"""One node's keep of committed steps: its own and the replicas it holds of peers.

The files' layout (own steps by generation, replicas by origin, staging) and the scan of what
a previous run left are `elasticpp.store.layout`; which commits readers hold is
`elasticpp.store.pins`; what workers reported of steps not yet committed is
`elasticpp.store.reports`.

Invariants this module keeps:
- A step is listed (by `holdings`, served, linked) only once committed, i.e. once its
  manifest exists; a directory without a manifest is never read.
- A committed piece is never rewritten. A step recomputed after a rollback is written by a
  newer generation into its own directory and committed there; the commit replaces the
  older generation's commit of that step, whose directory is then deleted. Each origin holds
  at most one commit per step.
- Commits order by (epoch, generation, step). The job epoch (`set_epoch`) is new whenever
  the job's etcd state starts afresh and generation numbers restart at 1: the commits of a
  new epoch are newer than every commit of an older one, whatever their numbers. The epoch
  never goes back below the newest epoch of this node's own commits.
- A store with a job identity (`job`) holds only that job's steps: a step directory whose
  manifest names another job is never listed, served, linked or deleted; it stays on disk
  untouched, reported once in the log. Manifests of an older release name no job and are
  taken as this job's.
- Which commits stay is `retention.Retention` (the newest `keep_steps` by (epoch,
  generation, step), anchors at or above the floor, capped). Older commits are deleted after a newer
  commit; uncommitted directories older than the oldest kept commit are deleted with them (a
  worker that died mid-write leaves one). While nothing may be committed (a fenced node),
  `drop_uncommitted` keeps only the newest few uncommitted directories. A commit that a
  running transfer reads (a pin, see `pinned`/`open_piece`) leaves `holdings` at once but
  its files are deleted only when its last pin is released. Deletion removes the manifest
  first, so a crash mid-delete leaves an incomplete directory, never a wrong one.
- On the hot path (a worker reports a step, the agent commits it) files are only stat'ed:
  the worker computed the sha256 while writing. A piece's bytes are hashed at most once by
  the store, on its first local use (`verify_piece`, `materialize`); every remote transfer is
  verified end to end by the receiver, and one asked again after a checksum mismatch is
  hashed by the source as it reads it (`served`). A commit one of whose pieces fails its
  checksum on local use or as it is sent so leaves the holdings at once (and is deleted): no
  later resume is planned on it, and no peer fetches it again and again.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, NoReturn

from elasticpp.checkpoint.durable import fsync_dir, link_or_copy
from elasticpp.checkpoint.manifest import (
    MANIFEST_NAME,
    JobIdentity,
    Manifest,
    PieceEntry,
    PieceKey,
    sha256_file,
    write_manifest,
)
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.store.holdings import NodeHoldings, PieceInfo, StepHolding, check_node_id
from elasticpp.store.layout import StoreLayout, scan
from elasticpp.store.pins import CommitKey, Pins
from elasticpp.store.reports import Order, PieceReports
from elasticpp.store.retention import ANCHORS_ABOVE_FLOOR, Retention

log = logging.getLogger(__name__)

_Key = CommitKey  # (origin, step, epoch, generation)


class PieceNotFoundError(CheckpointError):
    """The store holds no committed piece of that (origin, step, name)."""


class LocalStore:
    """The committed steps one node keeps. Thread-safe: the gRPC server reads while the
    agent records and commits."""

    def __init__(
        self,
        root: Path,
        node_id: str,
        keep_steps: int = 2,
        *,
        anchor_every: int | None = None,
        anchor_cap: int = ANCHORS_ABOVE_FLOOR,
        job: JobIdentity | None = None,
        epoch: int = 0,
    ) -> None:
        for name, value in (("keep_steps", keep_steps), ("anchor_cap", anchor_cap)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"store: {name} must be an integer >= 1, got {value!r}")
        if anchor_every is not None and (
            isinstance(anchor_every, bool) or not isinstance(anchor_every, int) or anchor_every < 1
        ):
            raise ConfigError(f"store: anchor_every must be an integer >= 1, got {anchor_every!r}")
        self.root = Path(root)
        self.node_id = check_node_id(node_id)
        self.retention = Retention(keep_steps, anchor_every, anchor_cap)
        self.job = job
        self._epoch = 0
        self._floor: Order | None = None  # (epoch, generation, step) of the safe step
        self._foreign: set[Path] = set()  # step dirs of another job: never touched
        self.layout = StoreLayout(self.root, self.node_id)
        self.own_dir = self.layout.own_dir
        self.replicas_dir = self.layout.replicas_dir
        self.staging_dir = self.layout.staging_dir
        self._lock = threading.RLock()
        self._reports = PieceReports()  # pieces reported of own steps not yet committed
        self._committed: dict[tuple[str, int], StepHolding] = {}
        self._verified: set[tuple[_Key, str]] = set()
        self._pins = Pins()  # commits in use, and those to delete at their last unpin
        self._load()
        if epoch:
            self.set_epoch(epoch)

    # ----- paths

    def _dir(self, origin: str, step: int, epoch: int, generation: int) -> Path:
        return self.layout.step_dir(origin, step, epoch, generation)

    @property
    def epoch(self) -> int:
        """The job epoch this node's commits are made in (0: none)."""
        with self._lock:
            return self._epoch

    def newest_epoch(self) -> int:
        """The newest epoch of any commit held here (own or replica); 0 if none."""
        with self._lock:
            return max((h.epoch for h in self._committed.values()), default=0)

    def set_epoch(self, epoch: int) -> None:
        """Commit in job epoch `epoch` from now on. `CheckpointError` for an epoch older than
        this node's own newest commit: its commits would order below what it holds."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"store: epoch must be an integer >= 0, got {epoch!r}")
        with self._lock:
            own = max(
                (h.epoch for (o, _), h in self._committed.items() if o == self.node_id), default=0
            )
            if epoch < own:
                raise CheckpointError(
                    f"store {self.node_id}: job epoch {epoch} is older than epoch {own} of "
                    "steps this node committed (a node clock far behind?); refusing to commit "
                    "below them"
                )
            if epoch != self._epoch:
                self._epoch = epoch
                log.info("store %s: job epoch %d", self.node_id, epoch)

    def snapshot_dir(self, generation: int) -> Path:
        """Where this node's workers of `generation` (of the current epoch) write their
        steps (`<dir>/step-<k>/`)."""
        return self.layout.snapshot_dir(self.epoch, generation)

    def step_dir(
        self, origin: str, step: int, generation: int | None = None, epoch: int | None = None
    ) -> Path:
        """The directory of `origin`'s step `step` of `generation` of `epoch` (by default: the
        current epoch), or by default of its commit held here (of epoch and generation 0 when
        none is). It may not exist."""
        if generation is not None:
            return self._dir(origin, step, self.epoch if epoch is None else epoch, generation)
        with self._lock:
            held = self._committed.get((origin, step))
        if held is None:
            return self._dir(origin, step, 0, 0)
        return self._dir(origin, step, held.epoch, held.generation)

    def path_of(self, origin: str, step: int, name: str) -> Path:
        """The path of a committed piece; refuses any name that is not a piece name (and so
        any path)."""
        return self.step_dir(origin, step) / PieceKey.parse(name).filename

    def replica_step_dir(self, origin: str, step: int, generation: int = 0, epoch: int = 0) -> Path:
        """Created on demand: where fetched pieces of a peer's step go before `commit_replica`."""
        if origin == self.node_id:
            raise ConfigError(f"origin_node {origin!r} is this node: not a replica")
        d = self._dir(origin, step, epoch, generation)
        self._check_not_foreign(d)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _check_not_foreign(self, step_dir: Path) -> None:
        if step_dir in self._foreign:
            raise CheckpointError(f"{step_dir} holds a step of another job; not written")

    # ----- own steps: report, commit

    def _check_newer(
        self, origin: str, step: int, epoch: int, generation: int
    ) -> StepHolding | None:
        """The commit held of (origin, step) if it is of (`epoch`, `generation`) (idempotent
        calls); `CheckpointError` if a commit of that one or a newer one is held."""
        held = self._committed.get((origin, step))
        if held is None or held.commit < (epoch, generation):
            return None
        if held.commit == (epoch, generation):
            return held
        raise CheckpointError(
            f"{origin} step {step}: generation {held.generation} of epoch {held.epoch} "
            f"committed it; a commit of older generation {generation} of epoch {epoch} is "
            "refused"
        )

    def record_pieces(
        self,
        step: int,
        entries: Iterable[PieceEntry | Mapping[str, Any]],
        generation: int = 0,
    ) -> None:
        """Record pieces a worker of `generation` wrote into `snapshot_dir(generation)` and
        reported.

        Only sizes are checked here (a stat); the sha256 the worker computed while writing is
        trusted until the piece's first use, which verifies it. Two reports of the same piece
        (data-parallel twins on one node write the same file) must agree, or the file decides.
        """
        with self._lock:
            epoch = self._epoch
            step_dir = self._dir(self.node_id, step, epoch, generation)
            held = self._committed.get((self.node_id, step))
            if held is not None and held.commit >= (epoch, generation):
                raise CheckpointError(
                    f"step {step} is already committed by generation {held.generation} of "
                    f"epoch {held.epoch}; late report of generation {generation} refused"
                )
            hashed = self._reports.record((epoch, generation, step), step_dir, entries)
            key = (self.node_id, step, epoch, generation)
            self._verified.update((key, name) for name in hashed)

    def reported(self, step: int, generation: int = 0) -> dict[str, PieceInfo]:
        """Pieces recorded for an uncommitted own step."""
        with self._lock:
            return self._reports.of((self._epoch, generation, step))

    def commit(self, step: int, units: tuple[str, ...], generation: int = 0) -> StepHolding:
        """Mark own step `step` of `generation` (of the current epoch) committed (writes its
        manifest) and drop old steps. It replaces an older commit of that step.

        Idempotent: committing a committed step returns what was committed.
        """
        with self._lock:
            epoch = self._epoch
            existing = self._check_newer(self.node_id, step, epoch, generation)
            if existing is not None:
                return existing
            step_dir = self._dir(self.node_id, step, epoch, generation)
            self._check_not_foreign(step_dir)
            pieces = self._reports.take((epoch, generation, step))
            step_dir.mkdir(parents=True, exist_ok=True)
            manifest = Manifest(
                step,
                units,
                tuple(
                    PieceEntry(PieceKey.parse(n), i.size, i.sha256)
                    for n, i in sorted(pieces.items())
                ),
                generation=generation,
                epoch=epoch,
                job=self.job,
            )
            # The manifest is the commit point: written last, atomically.
            write_manifest(step_dir, manifest)
            holding = StepHolding(self.node_id, step, units, dict(pieces), generation, epoch)
            self._install(holding)
            # Per step: debug, or weeks of uptime fill the log (the metrics show progress).
            log.debug(
                "store %s: committed step %d of generation %d (%d pieces)",
                self.node_id,
                step,
                generation,
                len(pieces),
            )
            return holding

    def drop_uncommitted(self, keep: int) -> list[Order]:
        """Delete this node's uncommitted step directories, and what was reported of them,
        but the newest `keep` (in commit order): what a fenced node's workers write while
        nothing may be committed (so nothing is pruned) is bounded. Commits, directories a
        transfer still reads (deleted at their last unpin) and another job's are never
        touched. Returns the (epoch, generation, step) deleted, oldest first."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"store: keep must be an integer >= 1, got {keep!r}")
        with self._lock:
            held = {h.order for (o, _), h in self._committed.items() if o == self.node_id}
            held |= {(k[2], k[3], k[1]) for k in self._pins.doomed() if k[0] == self.node_id}
            loose = sorted(
                ((e, g, s), d)
                for e, g, s, d in self.layout.step_dirs(self.node_id)
                if (e, g, s) not in held and d not in self._foreign
            )
            dropped = []
            for order, d in loose[:-keep]:
                shutil.rmtree(d, ignore_errors=True)
                self._reports.forget(order)
                dropped.append(order)
            if dropped:
                log.info(
                    "store %s: %d uncommitted step(s) deleted, the newest %d kept (nothing "
                    "is committed meanwhile)",
                    self.node_id,
                    len(dropped),
                    keep,
                )
            return dropped

    # ----- replicas

    def commit_replica(
        self,
        origin: str,
        step: int,
        units: tuple[str, ...],
        entries: Iterable[PieceEntry],
        generation: int = 0,
        epoch: int = 0,
    ) -> StepHolding:
        """Commit a peer's step whose pieces are in
        `replica_step_dir(origin, step, generation, epoch)`.

        The pieces must have been verified by the transfer that wrote them (the client
        checks the sha256 before its rename); here only presence and sizes are checked.
        """
        step_dir = self.replica_step_dir(origin, step, generation, epoch)
        entries = tuple(entries)
        for e in entries:
            path = step_dir / e.key.filename
            if not path.is_file() or path.stat().st_size != e.size:
                raise CheckpointError(
                    f"replica {origin} step {step}: piece {e.key.filename} missing or wrong size"
                )
        with self._lock:
            existing = self._check_newer(origin, step, epoch, generation)
            if existing is not None:
                return existing
            manifest = Manifest(
                step, units, entries, generation=generation, epoch=epoch, job=self.job
            )
            write_manifest(step_dir, manifest)
            holding = StepHolding(
                origin,
                step,
                units,
                {e.key.filename: PieceInfo(e.size, e.sha256) for e in entries},
                generation,
                epoch,
            )
            key = (origin, step, epoch, generation)
            self._verified.update((key, e.key.filename) for e in entries)
            self._install(holding)
            log.debug(
                "store %s: holds replica of %s step %d (generation %d)",
                self.node_id,
                origin,
                step,
                generation,
            )
            return holding

    # ----- anchors and the floor

    @property
    def floor(self) -> tuple[int, int] | None:
        """(generation, step) of the newest safe step this node has learnt in its current
        epoch, or None."""
        with self._lock:
            return None if self._floor is None else self._floor[1:]

    def set_floor(self, step: int, generation: int) -> bool:
        """Learn a newer safe step (of the current epoch: the safe step is published in the
        job's etcd state): anchors below it may go now. A floor only rises (in commit order,
        (epoch, generation, step)); an older one is ignored. True if it rose."""
        with self._lock:
            new = (self._epoch, generation, step)
            if self._floor is not None and new <= self._floor:
                return False
            self._floor = new
            for origin in sorted({o for o, _ in self._committed}):
                self._prune(origin)
            log.debug("store %s: floor is step %d of generation %d", self.node_id, step, generation)
            return True

    def anchors(self, origin: str, generation: int | None = None) -> list[int]:
        """Committed anchor steps of `origin` held here (of `generation` of the current epoch
        only, if given), newest first."""
        with self._lock:
            return sorted(
                (
                    s
                    for (o, s), h in self._committed.items()
                    if o == origin
                    and self.retention.is_anchor(s)
                    and (generation is None or h.commit == (self._epoch, generation))
                ),
                reverse=True,
            )

    # ----- reading

    def holdings(self) -> NodeHoldings:
        """The committed steps this node holds (own and replicas), as pure data."""
        with self._lock:
            return NodeHoldings(self.node_id, dict(self._committed))

    def reported_steps(self) -> list[Order]:
        """The own steps with pieces reported and not committed (yet), oldest first."""
        with self._lock:
            return sorted(self._reports.orders())

    def committed_steps(self, origin: str | None = None) -> list[int]:
        origin = origin or self.node_id
        with self._lock:
            return sorted(s for (o, s), _ in self._committed.items() if o == origin)

    def committed(self, origin: str, step: int) -> StepHolding | None:
        """The commit of `origin`'s step held here, or None."""
        with self._lock:
            return self._committed.get((origin, step))

    def piece_info(self, origin: str, step: int, name: str) -> PieceInfo:
        """Size and sha256 of a committed piece; `PieceNotFoundError` if not held."""
        return self._locate(origin, step, name)[1]

    def _locate(self, origin: str, step: int, name: str) -> tuple[_Key, PieceInfo]:
        PieceKey.parse(name)
        with self._lock:
            holding = self._committed.get((origin, step))
            info = holding.pieces.get(name) if holding is not None else None
            if holding is None or info is None:
                raise PieceNotFoundError(f"piece {name} of {origin} step {step} is not held here")
            return (origin, step, holding.epoch, holding.generation), info

    def find_piece(self, step: int, name: str, sha256: str) -> Path | None:
        """A committed local copy (any origin) of this exact piece, or None."""
        with self._lock:
            for (origin, s), h in sorted(self._committed.items()):
                info = h.pieces.get(name)
                if s == step and info is not None and info.sha256 == sha256:
                    return self._dir(origin, s, h.epoch, h.generation) / name
        return None

    @contextlib.contextmanager
    def pinned(self, origin: str, step: int) -> Iterator[None]:
        """Keep `origin`'s commit of `step` on disk while the block runs, even if pruning or a
        newer commit wants it gone."""
        with self._lock:
            held = self._committed.get((origin, step))
            key = (origin, step, *(held.commit if held is not None else (0, 0)))
            self._pins.pin(key)
        try:
            yield
        finally:
            self._unpin(key)

    def _unpin(self, key: _Key) -> None:
        with self._lock:
            if self._pins.unpin(key):
                self._delete(key)

    @contextlib.contextmanager
    def open_piece(
        self, origin: str, step: int, name: str
    ) -> Iterator[tuple[IO[bytes], PieceInfo]]:
        """The open file of a committed piece and its (size, sha256), pinned while open."""
        with self._lock:
            key, info = self._locate(origin, step, name)
            self._pins.pin(key)
        try:
            try:
                f = (self._dir(*key) / name).open("rb")
            except FileNotFoundError:
                raise PieceNotFoundError(f"piece {name} of {origin} step {step} is gone") from None
            with f:
                yield f, info
        finally:
            self._unpin(key)

    def verify_piece(self, origin: str, step: int, name: str) -> PieceInfo:
        """Hash the piece against its recorded sha256, once per piece; `CheckpointError` if bad."""
        key, info = self._locate(origin, step, name)
        self._verify(key, name, info)
        return info

    def _verify(self, key: _Key, name: str, info: PieceInfo) -> None:
        with self._lock:
            if (key, name) in self._verified:
                return
        path = self._dir(*key) / name
        try:
            ok = path.stat().st_size == info.size and sha256_file(path) == info.sha256
        except FileNotFoundError:
            ok = False
        if not ok:
            self._corrupt(key, name)
        with self._lock:
            self._verified.add((key, name))

    def served(self, origin: str, step: int, name: str, sent: PieceInfo, sha256_read: str) -> None:
        """The bytes of committed piece `sent` (as `open_piece` gave it), read in full to send
        them to a peer, hash to `sha256_read`: the piece is verified if that is its sha256;
        if not, the copy here is corrupt and its commit leaves the holdings (as on a local
        use, `CheckpointError`). Nothing if the piece was dropped or committed again
        meanwhile (another commit's piece is not judged by the bytes of this one)."""
        try:
            key, info = self._locate(origin, step, name)
        except PieceNotFoundError:
            return
        if info != sent:
            return
        if info.sha256 != sha256_read:
            self._corrupt(key, name)
        with self._lock:
            self._verified.add((key, name))

    def _corrupt(self, key: _Key, name: str) -> NoReturn:
        """A piece of commit `key` fails its checksum here. Its commit leaves the holdings at
        once: the next resume must take that state from a replica, a twin or an older step,
        not fail on the same piece generation after generation."""
        with self._lock:
            held = self._committed.get((key[0], key[1]))
            if held is not None and held.commit == key[2:]:
                del self._committed[(key[0], key[1])]
                self._retire(key)
        log.warning(
            "store %s: piece %s of %s step %d fails its checksum; that commit is dropped",
            self.node_id,
            name,
            key[0],
            key[1],
        )
        raise CheckpointError(f"piece {name} of {key[0]} step {key[1]} fails its checksum")

    def materialize(
        self, target_dir: Path, pieces: Iterable[tuple[str, int, str]]
    ) -> list[PieceEntry]:
        """Hard-link (or copy) local pieces `(origin, step, name)` into `target_dir`.

        Each piece is verified (once) before it is linked. Returns their entries.
        """
        target_dir.mkdir(parents=True, exist_ok=True)
        out = []
        for origin, step, name in pieces:
            with self._lock:
                key, info = self._locate(origin, step, name)
                self._pins.pin(key)
            try:
                self._verify(key, name, info)
                link_or_copy(self._dir(*key) / name, target_dir / name)
            finally:
                self._unpin(key)
            out.append(PieceEntry(PieceKey.parse(name), info.size, info.sha256))
        return out

    # ----- internals

    def _load(self) -> None:
        """Pick up the committed steps a previous run of this node left (of this job)."""
        found = scan(self.layout, self.job)
        self._foreign |= found.foreign
        for origin, holdings in found.commits.items():
            for holding in holdings:
                held = self._committed.get((origin, holding.step))
                if held is None or held.commit < holding.commit:
                    self._install(holding, prune=False)
                else:
                    self._delete((origin, holding.step, holding.epoch, holding.generation))
            self._prune(origin)
        if found.other_jobs:
            # Once, at start: another job's state (a reused state dir) is left as it is.
            (first, its_job), count = found.other_jobs[0], len(found.other_jobs)
            log.warning(
                "store %s: %d step director%s of another job left untouched and ignored "
                "(this job is %s; %s is of %s)",
                self.node_id,
                count,
                "y" if count == 1 else "ies",
                self.job,
                first,
                its_job,
            )

    def _install(self, holding: StepHolding, *, prune: bool = True) -> None:
        """Make `holding` the commit of its (origin, step); the one it replaces goes."""
        old = self._committed.get((holding.origin, holding.step))
        self._committed[(holding.origin, holding.step)] = holding
        if old is not None and old.commit != holding.commit:
            self._retire((old.origin, old.step, old.epoch, old.generation))
        if prune:
            self._prune(holding.origin)

    def _retire(self, key: _Key) -> None:
        if self._pins.retire(key):
            self._delete(key)
        else:
            log.info("store %s: %s step %d in use; deleting it later", self.node_id, *key[:2])

    def _prune(self, origin: str) -> None:
        """Drop the commits `retention` does not keep, and stale uncommitted directories."""
        held = [h for (o, _), h in self._committed.items() if o == origin]
        kept, over_cap = self.retention.kept(held, self._floor)
        for h in over_cap:
            log.warning(
                "store %s: more than %d anchors of %s above the safe step %s: anchor step "
                "%d dropped (replication or a node lags; the guarantee holds again once "
                "a newer safe step is published)",
                self.node_id,
                self.retention.cap,
                origin,
                "(none yet)" if self._floor is None else self._floor[2],
                h.step,
            )
        keep = {h.order for h in kept}
        for h in held:
            if h.order not in keep:
                del self._committed[(origin, h.step)]
                self._retire((origin, h.step, h.epoch, h.generation))
        if not kept:
            return
        oldest = kept[0].order
        live = {h.order for h in kept} | {(k[2], k[3], k[1]) for k in self._pins.doomed()}
        for epoch, gen, step, d in list(self.layout.step_dirs(origin)):
            order = (epoch, gen, step)
            if order < oldest and order not in live and d not in self._foreign:
                shutil.rmtree(d, ignore_errors=True)
                if origin == self.node_id:
                    self._reports.forget(order)
        for epoch, gen, d in list(self.layout.empty_dirs(origin)):
            if (epoch, gen) < oldest[:2]:
                with contextlib.suppress(OSError):
                    d.rmdir()  # only once empty

    def _delete(self, key: _Key) -> None:
        step_dir = self._dir(*key)
        self._pins.deleted(key)
        self._verified = {v for v in self._verified if v[0] != key}
        # Manifest first: a crash mid-delete must leave an incomplete dir, not a wrong one.
        with contextlib.suppress(FileNotFoundError):
            (step_dir / MANIFEST_NAME).unlink()
            fsync_dir(step_dir)
        shutil.rmtree(step_dir, ignore_errors=True)
