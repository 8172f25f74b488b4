"""One node's keep of committed steps: its own and the replicas it holds of peers.

Layout under `root` (every step directory has the checkpoint format of
`elasticpp.checkpoint.manifest`: piece files + `manifest.json` written last):

    own/step-<k>/                      written by this node's workers (`own_dir` is their
                                       snapshot_dir); the manifest is written by `commit`
    replicas/<origin>/step-<k>/        copies of a peer's committed steps
    staging/                           transfers in flight and resume directories' sources

Invariants this module keeps:
- A step is listed (by `holdings`, served, linked) only once committed, i.e. once its
  manifest exists; a directory without a manifest is never read.
- The newest `keep_steps` committed steps of every origin are never deleted. Older committed
  steps are deleted after a newer commit; uncommitted directories older than the oldest kept
  step are deleted with them (a worker that died mid-write leaves one). A step that a running
  transfer reads (a pin, see `pinned`/`open_piece`) is hidden from `holdings` at once but
  deleted only when its last pin is released. Deletion removes the manifest first, so a
  crash mid-delete leaves an incomplete directory, never a wrong one.
- On the hot path (a worker reports a step, the agent commits it) files are only stat'ed:
  the worker computed the sha256 while writing. A piece's bytes are hashed at most once by
  the store, on its first local use (`verify_piece`, `materialize`); every remote transfer is
  verified end to end by the receiver.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from elasticpp.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    PieceEntry,
    PieceKey,
    fsync_dir,
    parse_step_dirname,
    read_manifest,
    sha256_file,
    step_dirname,
    write_manifest,
)
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.store.holdings import NodeHoldings, PieceInfo, StepHolding, check_node_id

log = logging.getLogger(__name__)

OWN_DIRNAME = "own"
REPLICAS_DIRNAME = "replicas"
STAGING_DIRNAME = "staging"


class PieceNotFoundError(CheckpointError):
    """The store holds no committed piece of that (origin, step, name)."""


def link_or_copy(src: Path, dst: Path) -> None:
    """Make `dst` hold the bytes of `src`: a hard link where possible, else a copy.

    The new name appears atomically (link/copy to a temporary name, then rename), so a
    reader never sees half a file.
    """
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.tmp")
    try:
        try:
            os.link(src, tmp)
        except OSError:
            # Another filesystem, or links not allowed: copy, and make it durable.
            with src.open("rb") as fin, tmp.open("wb") as fout:
                shutil.copyfileobj(fin, fout, 4 << 20)
                fout.flush()
                os.fsync(fout.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _entry_info(entry: PieceEntry | Mapping[str, Any]) -> tuple[str, PieceInfo]:
    if isinstance(entry, PieceEntry):
        return entry.key.filename, PieceInfo(entry.size, entry.sha256)
    try:
        name = str(entry["name"])
        size, sha = int(entry["size"]), str(entry["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"piece report: expected name, size and sha256, got {entry!r}") from exc
    PieceKey.parse(name)
    if size < 0 or len(sha) != 64:
        raise ConfigError(f"piece report {name}: bad size {size} or sha256 {sha!r}")
    return name, PieceInfo(size, sha.lower())


class LocalStore:
    """The committed steps one node keeps. Thread-safe: the gRPC server reads while the
    agent records and commits."""

    def __init__(self, root: Path, node_id: str, keep_steps: int = 2) -> None:
        if isinstance(keep_steps, bool) or not isinstance(keep_steps, int) or keep_steps < 1:
            raise ConfigError(f"store: keep_steps must be an integer >= 1, got {keep_steps!r}")
        self.root = Path(root)
        self.node_id = check_node_id(node_id)
        self.keep_steps = keep_steps
        self.own_dir = self.root / OWN_DIRNAME
        self.replicas_dir = self.root / REPLICAS_DIRNAME
        self.staging_dir = self.root / STAGING_DIRNAME
        for d in (self.own_dir, self.replicas_dir, self.staging_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._reported: dict[int, dict[str, PieceInfo]] = {}
        self._committed: dict[tuple[str, int], StepHolding] = {}
        self._verified: set[tuple[str, int, str]] = set()
        self._pins: Counter[tuple[str, int]] = Counter()
        self._doomed: set[tuple[str, int]] = set()
        self._load()

    # ----- paths

    def step_dir(self, origin: str, step: int) -> Path:
        """The directory of `origin`'s step `step` in this store (it may not exist)."""
        check_node_id(origin, field_name="origin_node")
        base = self.own_dir if origin == self.node_id else self.replicas_dir / origin
        return base / step_dirname(step)

    def path_of(self, origin: str, step: int, name: str) -> Path:
        """The path of a piece; refuses any name that is not a piece name (and so any path)."""
        return self.step_dir(origin, step) / PieceKey.parse(name).filename

    def replica_step_dir(self, origin: str, step: int) -> Path:
        """Created on demand: where fetched pieces of a peer's step go before `commit_replica`."""
        if origin == self.node_id:
            raise ConfigError(f"origin_node {origin!r} is this node: not a replica")
        d = self.step_dir(origin, step)
        d.mkdir(parents=True, exist_ok=True)
        return d

    # ----- own steps: report, commit

    def record_pieces(self, step: int, entries: Iterable[PieceEntry | Mapping[str, Any]]) -> None:
        """Record pieces a worker wrote into `own_dir/step-<step>/` and reported.

        Only sizes are checked here (a stat); the sha256 the worker computed while writing is
        trusted until the piece's first use, which verifies it. Two reports of the same piece
        (data-parallel twins on one node write the same file) must agree, or the file decides.
        """
        step_dir = self.own_dir / step_dirname(step)
        with self._lock:
            if (self.node_id, step) in self._committed:
                raise CheckpointError(f"step {step} is already committed; late report refused")
            reported = self._reported.setdefault(step, {})
            for entry in entries:
                name, info = _entry_info(entry)
                path = step_dir / name
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    raise CheckpointError(
                        f"step {step}: reported piece {name} is missing"
                    ) from None
                if size != info.size:
                    raise CheckpointError(
                        f"step {step}: piece {name} has {size} bytes, the report says {info.size}"
                    )
                prior = reported.get(name)
                if prior is not None and prior != info:
                    actual = sha256_file(path)
                    if actual not in (prior.sha256, info.sha256):
                        raise CheckpointError(f"step {step}: piece {name} matches no report")
                    info = PieceInfo(size, actual)
                    self._verified.add((self.node_id, step, name))
                reported[name] = info

    def reported(self, step: int) -> dict[str, PieceInfo]:
        """Pieces recorded for an uncommitted own step."""
        with self._lock:
            return dict(self._reported.get(step, {}))

    def commit(self, step: int, units: tuple[str, ...]) -> StepHolding:
        """Mark own step `step` committed (writes its manifest) and drop old steps.

        Idempotent: committing a committed step returns what was committed.
        """
        with self._lock:
            existing = self._committed.get((self.node_id, step))
            if existing is not None:
                return existing
            pieces = self._reported.pop(step, {})
            step_dir = self.own_dir / step_dirname(step)
            step_dir.mkdir(parents=True, exist_ok=True)
            manifest = Manifest(
                step,
                units,
                tuple(
                    PieceEntry(PieceKey.parse(n), i.size, i.sha256)
                    for n, i in sorted(pieces.items())
                ),
            )
            # The manifest is the commit point: written last, atomically.
            write_manifest(step_dir, manifest)
            holding = StepHolding(self.node_id, step, units, dict(pieces))
            self._committed[(self.node_id, step)] = holding
            self._prune(self.node_id)
            log.info("store %s: committed step %d (%d pieces)", self.node_id, step, len(pieces))
            return holding

    # ----- replicas

    def commit_replica(
        self, origin: str, step: int, units: tuple[str, ...], entries: Iterable[PieceEntry]
    ) -> StepHolding:
        """Commit a peer's step whose pieces are in `replica_step_dir(origin, step)`.

        The pieces must have been verified by the transfer that wrote them (the client
        checks the sha256 before its rename); here only presence and sizes are checked.
        """
        step_dir = self.replica_step_dir(origin, step)
        entries = tuple(entries)
        for e in entries:
            path = step_dir / e.key.filename
            if not path.is_file() or path.stat().st_size != e.size:
                raise CheckpointError(
                    f"replica {origin} step {step}: piece {e.key.filename} missing or wrong size"
                )
        with self._lock:
            existing = self._committed.get((origin, step))
            if existing is not None:
                return existing
            write_manifest(step_dir, Manifest(step, units, entries))
            holding = StepHolding(
                origin,
                step,
                units,
                {e.key.filename: PieceInfo(e.size, e.sha256) for e in entries},
            )
            self._committed[(origin, step)] = holding
            self._verified.update((origin, step, e.key.filename) for e in entries)
            self._prune(origin)
            log.info("store %s: holds replica of %s step %d", self.node_id, origin, step)
            return holding

    # ----- reading

    def holdings(self) -> NodeHoldings:
        """The committed steps this node holds (own and replicas), as pure data."""
        with self._lock:
            return NodeHoldings(
                self.node_id,
                {k: h for k, h in self._committed.items() if k not in self._doomed},
            )

    def committed_steps(self, origin: str | None = None) -> list[int]:
        origin = origin or self.node_id
        with self._lock:
            return sorted(s for (o, s), _ in self._committed.items() if o == origin)

    def piece_info(self, origin: str, step: int, name: str) -> PieceInfo:
        """Size and sha256 of a committed piece; `PieceNotFoundError` if not held."""
        PieceKey.parse(name)
        with self._lock:
            holding = self._committed.get((origin, step))
            info = holding.pieces.get(name) if holding is not None else None
        if info is None:
            raise PieceNotFoundError(f"piece {name} of {origin} step {step} is not held here")
        return info

    def find_piece(self, step: int, name: str, sha256: str) -> Path | None:
        """A committed local copy (any origin) of this exact piece, or None."""
        with self._lock:
            for (origin, s), h in sorted(self._committed.items()):
                info = h.pieces.get(name)
                usable = (origin, s) not in self._doomed
                if s == step and info is not None and info.sha256 == sha256 and usable:
                    return self.path_of(origin, s, name)
        return None

    @contextlib.contextmanager
    def pinned(self, origin: str, step: int) -> Iterator[None]:
        """Keep `origin`'s step on disk while the block runs, even if pruning wants it gone."""
        key = (origin, step)
        with self._lock:
            self._pins[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[key] -= 1
                if self._pins[key] <= 0:
                    del self._pins[key]
                    if key in self._doomed:
                        self._delete(key)

    @contextlib.contextmanager
    def open_piece(
        self, origin: str, step: int, name: str
    ) -> Iterator[tuple[IO[bytes], PieceInfo]]:
        """The open file of a committed piece and its (size, sha256), pinned while open."""
        path = self.path_of(origin, step, name)
        with self.pinned(origin, step):
            info = self.piece_info(origin, step, name)
            try:
                f = path.open("rb")
            except FileNotFoundError:
                raise PieceNotFoundError(f"piece {name} of {origin} step {step} is gone") from None
            with f:
                yield f, info

    def verify_piece(self, origin: str, step: int, name: str) -> PieceInfo:
        """Hash the piece against its recorded sha256, once per piece; `CheckpointError` if bad."""
        info = self.piece_info(origin, step, name)
        key = (origin, step, name)
        with self._lock:
            if key in self._verified:
                return info
        path = self.path_of(origin, step, name)
        try:
            ok = path.stat().st_size == info.size and sha256_file(path) == info.sha256
        except FileNotFoundError:
            ok = False
        if not ok:
            raise CheckpointError(f"piece {name} of {origin} step {step} fails its checksum")
        with self._lock:
            self._verified.add(key)
        return info

    def materialize(
        self, target_dir: Path, pieces: Iterable[tuple[str, int, str]]
    ) -> list[PieceEntry]:
        """Hard-link (or copy) local pieces `(origin, step, name)` into `target_dir`.

        Each piece is verified (once) before it is linked. Returns their entries.
        """
        target_dir.mkdir(parents=True, exist_ok=True)
        out = []
        for origin, step, name in pieces:
            with self.pinned(origin, step):
                info = self.verify_piece(origin, step, name)
                link_or_copy(self.path_of(origin, step, name), target_dir / name)
            out.append(PieceEntry(PieceKey.parse(name), info.size, info.sha256))
        return out

    # ----- internals

    def _load(self) -> None:
        """Pick up the committed steps a previous run of this node left."""
        bases = [(self.node_id, self.own_dir)]
        for d in sorted(self.replicas_dir.iterdir()):
            try:
                bases.append((check_node_id(d.name), d))
            except ConfigError:
                log.warning("store %s: ignoring unexpected directory %s", self.node_id, d)
        for origin, base in bases:
            for d in sorted(base.iterdir()):
                step = parse_step_dirname(d.name)
                if step is None or not (d / MANIFEST_NAME).is_file():
                    continue
                try:
                    manifest = read_manifest(d)
                except CheckpointError as exc:
                    log.warning("store %s: ignoring %s: %s", self.node_id, d, exc)
                    continue
                self._committed[(origin, step)] = StepHolding.from_manifest(origin, manifest)
            self._prune(origin)

    def _prune(self, origin: str) -> None:
        """Drop committed steps beyond the newest `keep_steps`, and stale uncommitted dirs."""
        steps = sorted(
            s for (o, s) in self._committed if o == origin and (o, s) not in self._doomed
        )
        kept = steps[-self.keep_steps :]
        for step in steps[: -self.keep_steps]:
            key = (origin, step)
            if self._pins[key] > 0:
                self._doomed.add(key)
                log.info("store %s: %s step %d in use; deleting it later", self.node_id, *key)
            else:
                self._delete(key)
        if not kept:
            return
        base = self.own_dir if origin == self.node_id else self.replicas_dir / origin
        for d in base.iterdir():
            stale = parse_step_dirname(d.name)
            if stale is not None and stale < kept[0] and (origin, stale) not in self._committed:
                shutil.rmtree(d, ignore_errors=True)
                if origin == self.node_id:
                    self._reported.pop(stale, None)

    def _delete(self, key: tuple[str, int]) -> None:
        origin, step = key
        step_dir = self.step_dir(origin, step)
        self._committed.pop(key, None)
        self._doomed.discard(key)
        self._verified = {v for v in self._verified if (v[0], v[1]) != key}
        # Manifest first: a crash mid-delete must leave an incomplete dir, not a wrong one.
        with contextlib.suppress(FileNotFoundError):
            (step_dir / MANIFEST_NAME).unlink()
            fsync_dir(step_dir)
        shutil.rmtree(step_dir, ignore_errors=True)
