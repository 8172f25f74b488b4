"""Persistent checkpoints: the last line of defence, for the loss of the whole cluster.

Layout under a checkpoint root that several nodes may share (a network filesystem):

    <root>/step-<k>/<piece files>                 copied by each node (durable_file)
    <root>/step-<k>/.parts/<node_id>.json         what each node contributed (sha256 included)
    <root>/step-<k>/manifest.json                 written LAST, by `finalize_checkpoint`

Protocol: every node that holds units of step k calls `persist_pieces` (its own pieces),
then `finalize_checkpoint`. Finalising writes the manifest only when the parts together
cover every unit of the model with a complete tensor-parallel slice set, so whichever node
writes last completes the checkpoint; earlier calls return None. Finalising is idempotent
and safe to race: every writer renames a complete manifest into place.

Invariants:
- A piece file already in a step directory is kept only if its sha256 is the piece's (a
  data-parallel twin wrote the same bytes); any other file there (torn, corrupted, or of a
  step recomputed after a rollback) is replaced, atomically. So a part record names the
  sha256 of the bytes its node left in place.
- A complete checkpoint (its manifest exists) is never rewritten: `persist_pieces` of that
  step writes nothing.
- `finalize_checkpoint` writes no manifest while part records disagree about a piece (two
  sha256s or sizes for one name) or a listed piece's file is missing or of another size.
  It compares sizes, not hashes (cheap); the loader hashes every piece.

A manifest names the job whose state it is (`JobIdentity`) and the epoch and generation that
committed the step. Reading, loading and pruning a checkpoint root is `store.checkpoints`.

`Persister` runs that sequence (persist, finalise, prune) for a node off the training path:
one worker thread, steps in the order submitted, at most `max_pending` steps waiting (the
oldest waiting is dropped: a newer checkpoint supersedes it); failures are logged and
counted, never fatal to the thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from elasticpp.checkpoint.durable import durable_file, durable_write, fsync_dir
from elasticpp.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    JobIdentity,
    Manifest,
    PieceEntry,
    PieceKey,
    read_manifest,
    sha256_file,
    step_dirname,
)
from elasticpp.errors import CheckpointError, ConfigError, ElasticppError
from elasticpp.plan.specs import ModelSpec
from elasticpp.store.checkpoints import prune_checkpoints
from elasticpp.store.local import LocalStore

log = logging.getLogger(__name__)

PARTS_DIRNAME = ".parts"
COPY_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class PersistPolicy:
    """`every_steps`: persist each step divisible by it (0: never); `keep`: complete
    checkpoints kept on disk."""

    every_steps: int = 0
    keep: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.every_steps, bool) or self.every_steps < 0:
            raise ConfigError(f"persist every_steps must be >= 0, got {self.every_steps!r}")
        if isinstance(self.keep, bool) or self.keep < 1:
            raise ConfigError(f"persist keep must be >= 1, got {self.keep!r}")

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step > 0 and step % self.every_steps == 0


def copy_verified(src: Path, dst: Path, sha256: str, size: int) -> None:
    """Copy `src` to `dst` durably (`durable_file`), checking its sha256 on the way: one
    read of the source, and nothing at `dst` unless it matches."""
    digest = hashlib.sha256()
    written = 0
    with src.open("rb") as fin, durable_file(dst, sync_dir=False) as fout:
        while block := fin.read(COPY_CHUNK_BYTES):
            fout.write(block)
            digest.update(block)
            written += len(block)
        if written != size or digest.hexdigest() != sha256:
            raise CheckpointError(f"piece {src.name} ({src}) fails its checksum; not copied")


def _holds_piece(path: Path, size: int, sha256: str) -> bool:
    """Whether `path` is a file with exactly these bytes. A size that differs needs no hash."""
    try:
        if path.stat().st_size != size:
            return False
    except FileNotFoundError:
        return False
    return sha256_file(path) == sha256


def persist_pieces(
    store: LocalStore,
    root: Path,
    step: int,
    *,
    origin: str | None = None,
    names: Iterable[str] | None = None,
) -> list[PieceEntry]:
    """Copy `origin`'s (default: this node's) committed step into the checkpoint `root`.

    `names` restricts the pieces (default: all of the step). Returns what this node
    contributed; records it in `.parts/<node_id>.json` for `finalize_checkpoint`. Returns []
    and writes nothing when the step's checkpoint is already complete.
    """
    origin = origin or store.node_id
    holding = store.holdings().steps.get((origin, step))
    if holding is None:
        raise CheckpointError(f"persist: {origin} step {step} is not committed on this node")
    wanted = sorted(holding.pieces) if names is None else sorted(set(names))
    step_dir = Path(root) / step_dirname(step)
    manifest_path = step_dir / MANIFEST_NAME
    if manifest_path.is_file():
        log.info("persist: step %d is complete in %s already; not rewritten", step, root)
        return []
    (step_dir / PARTS_DIRNAME).mkdir(parents=True, exist_ok=True)
    entries: list[PieceEntry] = []
    copied = 0
    with store.pinned(origin, step):
        for name in wanted:
            info = holding.pieces.get(name)
            if info is None:
                raise CheckpointError(f"persist: {origin} step {step} has no piece {name}")
            dst = step_dir / name
            # Same bytes from a twin: keep them. Same size is not enough: a file corrupted in
            # place, or of a step recomputed after a rollback, has the size and other bytes.
            if not _holds_piece(dst, info.size, info.sha256):
                # Checked again before each write: another node may have finalised meanwhile.
                if manifest_path.is_file():
                    log.info(
                        "persist: step %d was completed in %s meanwhile; %s stops writing",
                        step,
                        root,
                        store.node_id,
                    )
                    return []
                copy_verified(store.path_of(origin, step, name), dst, info.sha256, info.size)
                copied += 1
            entries.append(PieceEntry(PieceKey.parse(name), info.size, info.sha256))
    fsync_dir(step_dir)
    part = {
        "format_version": FORMAT_VERSION,
        "node_id": store.node_id,
        "step": step,
        "units": list(holding.units),
        "pieces": [{"name": e.key.filename, "size": e.size, "sha256": e.sha256} for e in entries],
    }
    part_path = step_dir / PARTS_DIRNAME / f"{store.node_id}.json"
    durable_write(part_path, json.dumps(part, sort_keys=True).encode())
    log.info(
        "persist: %s contributed %d pieces of step %d to %s (%d copied, %d already there)",
        store.node_id,
        len(entries),
        step,
        root,
        copied,
        len(entries) - copied,
    )
    return entries


def _read_part(part_path: Path, step: int) -> list[PieceEntry]:
    part = json.loads(part_path.read_text(encoding="utf-8"))
    if part["format_version"] != FORMAT_VERSION or int(part["step"]) != step:
        raise ValueError("format_version or step does not match")
    return [
        PieceEntry(PieceKey.parse(p["name"]), int(p["size"]), str(p["sha256"]))
        for p in part["pieces"]
    ]


def finalize_checkpoint(
    root: Path,
    step: int,
    units: tuple[str, ...],
    model: ModelSpec | None = None,
    *,
    job: JobIdentity | None = None,
    epoch: int = 0,
    generation: int = 0,
) -> Manifest | None:
    """Write the manifest of `root/step-<step>` if the parts cover the whole model; it names
    `job` and the `epoch` and `generation` that committed the step.

    Returns the manifest (also when one was already written), or None (logged, saying why)
    while units are missing, while part records disagree about a piece, or while a piece
    file is missing or of a size other than its part record's.
    """
    step_dir = Path(root) / step_dirname(step)
    if (step_dir / MANIFEST_NAME).is_file():
        return read_manifest(step_dir)
    by_name: dict[str, PieceEntry] = {}
    disagree: set[str] = set()
    parts_dir = step_dir / PARTS_DIRNAME
    for part_path in sorted(parts_dir.glob("*.json")) if parts_dir.is_dir() else []:
        try:
            part_entries = _read_part(part_path, step)
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            log.warning("persist: ignoring part record %s: %s", part_path, exc)
            continue
        for e in part_entries:
            if by_name.setdefault(e.key.filename, e) != e:
                disagree.add(e.key.filename)
    if disagree:
        # Twins that computed different bytes, or a stale record from before a rollback: the
        # file holds one node's bytes, so a manifest would lie for the other's record.
        names = sorted(disagree)
        log.warning(
            "persist: step %d not final: part records disagree on %d piece(s) (%s)",
            step,
            len(names),
            ", ".join(names[:6]),
        )
        return None
    bad_files = []
    for name, e in sorted(by_name.items()):
        try:
            size: int | None = (step_dir / name).stat().st_size
        except FileNotFoundError:
            size = None
        if size != e.size:
            bad_files.append(name)
    if bad_files:
        log.warning(
            "persist: step %d not final: %d piece file(s) missing or not of the recorded size (%s)",
            step,
            len(bad_files),
            ", ".join(bad_files[:6]),
        )
        return None
    manifest = Manifest(
        step,
        units,
        tuple(e for _, e in sorted(by_name.items())),
        model=model,
        generation=generation,
        epoch=epoch,
        job=job,
    )
    missing = manifest.missing_units()
    if missing:
        log.info(
            "persist: step %d not final yet: %d unit(s) missing (%s)",
            step,
            len(missing),
            ", ".join(missing[:6]),
        )
        return None
    durable_write(step_dir / MANIFEST_NAME, manifest.to_json().encode())
    log.info("persist: checkpoint step %d complete in %s", step, root)
    return manifest


OUTCOMES_KEPT = 8  # the newest steps whose persist outcome a Persister remembers


class Persister:
    """Persists this node's committed steps into `root`, one at a time, off the training path.

    One worker thread runs, for each submitted step in order, `persist_pieces`,
    `finalize_checkpoint` and (when that completed the checkpoint) `prune_checkpoints(root,
    keep)`. At most `max_pending` steps wait behind the running one: submitting more drops
    the oldest waiting step (logged, counted in `dropped`), since a newer checkpoint
    supersedes it. A failing step (`ElasticppError`, `OSError` such as ENOSPC) is logged and
    counted in `failures`; `last_error` keeps the most recent one; the thread carries on.
    """

    def __init__(self, store: LocalStore, root: Path, keep: int = 2, max_pending: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"persist keep must be an integer >= 1, got {keep!r}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ConfigError(f"persist max_pending must be an integer >= 1, got {max_pending!r}")
        self.store = store
        self.root = Path(root)
        self.keep = keep
        self.max_pending = max_pending
        self.dropped = 0
        self.failures = 0
        self.last_error: str | None = None
        self._cond = threading.Condition()
        self._pending: deque[tuple[int, ModelSpec]] = deque()
        self._running: int | None = None
        # The newest steps' outcomes: None persisted, else why not (bounded: OUTCOMES_KEPT).
        self._outcomes: dict[int, str | None] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="persist", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> tuple[int, ...]:
        """The steps waiting (not the running one), oldest first."""
        with self._cond:
            return tuple(step for step, _ in self._pending)

    def outcome(self, step: int) -> str:
        """Where `step` stands: `persisted`, `pending` (waiting or being written), `failed:
        <why>` (also when a newer step superseded it unwritten) or `unknown` (never submitted
        here, or too old to remember)."""
        with self._cond:
            if step in self._outcomes:
                why = self._outcomes[step]
                return "persisted" if why is None else f"failed: {why}"
            if step == self._running or any(s == step for s, _ in self._pending):
                return "pending"
            return "unknown"

    def _settle(self, step: int, why: str | None) -> None:
        """Record `step`'s outcome (under the lock), forgetting the oldest beyond OUTCOMES_KEPT."""
        self._outcomes[step] = why
        for old in sorted(self._outcomes)[:-OUTCOMES_KEPT]:
            del self._outcomes[old]

    def submit(self, step: int, model: ModelSpec) -> bool:
        """Queue `step` for persistence; False (nothing queued) once closed."""
        with self._cond:
            if self._closed:
                return False
            self._pending.append((step, model))
            while len(self._pending) > self.max_pending:
                old, _ = self._pending.popleft()
                self.dropped += 1
                self._settle(old, f"superseded by step {step} before it was written")
                log.info(
                    "persist: checkpoint of step %d dropped unwritten: step %d supersedes it "
                    "(%d step(s) waiting at most)",
                    old,
                    step,
                    self.max_pending,
                )
            self._cond.notify_all()
            return True

    def close(self, timeout_s: float) -> None:
        """Refuse new steps, let the worker finish the running and waiting ones, and wait up
        to `timeout_s` seconds for its thread to end (a daemon thread: it never holds up the
        process's exit if a write hangs)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "persist: still writing after %.1f s at close; left to finish in the background",
                timeout_s,
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                step, model = self._pending.popleft()
                self._running = step
            why = self._persist_one(step, model)
            with self._cond:
                self._running = None
                self._settle(step, why)

    def _persist_one(self, step: int, model: ModelSpec) -> str | None:
        """Persist `step`: None once done, else why it failed."""
        try:
            persist_pieces(self.store, self.root, step)
            held = self.store.committed(self.store.node_id, step)
            job = self.store.job
            done = finalize_checkpoint(
                self.root,
                step,
                model.units,
                model,
                job=job,
                epoch=held.epoch if held is not None else 0,
                generation=held.generation if held is not None else 0,
            )
            if done is not None:
                prune_checkpoints(self.root, self.keep, job)
            return None
        except (ElasticppError, OSError) as exc:
            log.warning("persist: checkpoint of step %d failed: %s", step, exc)
            self._count_failure(step, exc)
            return str(exc)
        except Exception as exc:  # a bug must not end the thread: later steps would hang
            log.exception("persist: checkpoint of step %d failed unexpectedly", step)
            self._count_failure(step, exc)
            return f"{type(exc).__name__}: {exc}"

    def _count_failure(self, step: int, exc: Exception) -> None:
        with self._cond:
            self.failures += 1
            self.last_error = f"step {step}: {exc}"


__all__ = [
    "PersistPolicy",
    "Persister",
    "copy_verified",
    "finalize_checkpoint",
    "persist_pieces",
]
