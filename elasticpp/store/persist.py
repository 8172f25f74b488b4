"""Persistent checkpoints: the last line of defence, for the loss of the whole cluster.

Layout under a checkpoint root that several nodes may share (a network filesystem):

    <root>/step-<k>/<piece files>                 copied by each node (tmp + fsync + rename)
    <root>/step-<k>/.parts/<node_id>.json         what each node contributed (sha256 included)
    <root>/step-<k>/manifest.json                 written LAST, by `finalize_checkpoint`

Protocol: every node that holds units of step k calls `persist_pieces` (its own pieces; a
piece a data-parallel twin already wrote is not written twice), then `finalize_checkpoint`.
Finalising writes the manifest only when the parts together cover every unit of the model
with a complete tensor-parallel slice set, so whichever node writes last completes the
checkpoint; earlier calls return None. Finalising is idempotent and safe to race: every
writer renames a complete manifest into place.

Loading (`find_latest_checkpoint`) verifies every piece's sha256 and refuses, with the
reason, a step that is incomplete or corrupt, falling back to the previous complete one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from elasticpp.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    PieceEntry,
    PieceKey,
    fsync_dir,
    parse_step_dirname,
    read_manifest,
    step_dirname,
    verify_step_dir,
)
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.plan.specs import ModelSpec
from elasticpp.store.holdings import DISK_SOURCE, NodeHoldings, StepHolding
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


def _durable_write(path: Path, data: bytes) -> None:
    # A unique temporary name: writers on other hosts may share the directory (and pids).
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def copy_verified(src: Path, dst: Path, sha256: str, size: int) -> None:
    """Copy `src` to `dst` durably (tmp + fsync + rename), checking its sha256 on the way:
    one read of the source."""
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.tmp")
    digest = hashlib.sha256()
    written = 0
    try:
        with src.open("rb") as fin, tmp.open("wb") as fout:
            while block := fin.read(COPY_CHUNK_BYTES):
                fout.write(block)
                digest.update(block)
                written += len(block)
            fout.flush()
            os.fsync(fout.fileno())
        if written != size or digest.hexdigest() != sha256:
            raise CheckpointError(f"piece {src.name} ({src}) fails its checksum; not copied")
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


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
    contributed; records it in `.parts/<node_id>.json` for `finalize_checkpoint`.
    """
    origin = origin or store.node_id
    holding = store.holdings().steps.get((origin, step))
    if holding is None:
        raise CheckpointError(f"persist: {origin} step {step} is not committed on this node")
    wanted = sorted(holding.pieces) if names is None else sorted(set(names))
    step_dir = Path(root) / step_dirname(step)
    (step_dir / PARTS_DIRNAME).mkdir(parents=True, exist_ok=True)
    entries: list[PieceEntry] = []
    with store.pinned(origin, step):
        for name in wanted:
            info = holding.pieces.get(name)
            if info is None:
                raise CheckpointError(f"persist: {origin} step {step} has no piece {name}")
            dst = step_dir / name
            # A twin wrote the same piece already (rename is atomic: present means whole).
            if not (dst.is_file() and dst.stat().st_size == info.size):
                copy_verified(store.path_of(origin, step, name), dst, info.sha256, info.size)
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
    _durable_write(part_path, json.dumps(part, sort_keys=True).encode())
    log.info(
        "persist: %s wrote %d pieces of step %d to %s", store.node_id, len(entries), step, root
    )
    return entries


def finalize_checkpoint(
    root: Path, step: int, units: tuple[str, ...], model: ModelSpec | None = None
) -> Manifest | None:
    """Write the manifest of `root/step-<step>` if the parts cover the whole model.

    Returns the manifest (also when one was already written), or None while units are
    missing (logged, naming them).
    """
    step_dir = Path(root) / step_dirname(step)
    if (step_dir / MANIFEST_NAME).is_file():
        return read_manifest(step_dir)
    by_name: dict[str, PieceEntry] = {}
    parts_dir = step_dir / PARTS_DIRNAME
    for part_path in sorted(parts_dir.glob("*.json")) if parts_dir.is_dir() else []:
        try:
            part = json.loads(part_path.read_text(encoding="utf-8"))
            if part["format_version"] != FORMAT_VERSION or int(part["step"]) != step:
                raise ValueError("format_version or step does not match")
            for p in part["pieces"]:
                e = PieceEntry(PieceKey.parse(p["name"]), int(p["size"]), str(p["sha256"]))
                by_name.setdefault(e.key.filename, e)
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            log.warning("persist: ignoring part record %s: %s", part_path, exc)
    present = tuple(
        e
        for name, e in sorted(by_name.items())
        if (step_dir / name).is_file() and (step_dir / name).stat().st_size == e.size
    )
    manifest = Manifest(step, units, present, model=model)
    missing = manifest.missing_units()
    if missing:
        log.info(
            "persist: step %d not final yet: %d unit(s) missing (%s)",
            step,
            len(missing),
            ", ".join(missing[:6]),
        )
        return None
    _durable_write(step_dir / MANIFEST_NAME, manifest.to_json().encode())
    log.info("persist: checkpoint step %d complete in %s", step, root)
    return manifest


@dataclass(frozen=True)
class CheckpointChoice:
    step: int
    path: Path
    manifest: Manifest
    refused: tuple[str, ...]  # why newer step directories were not used


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not Path(root).is_dir():
        return []
    out = []
    for d in Path(root).iterdir():
        step = parse_step_dirname(d.name)
        if step is not None and d.is_dir():
            out.append((step, d))
    return sorted(out, reverse=True)


def find_latest_checkpoint(root: Path) -> CheckpointChoice:
    """The newest complete, intact checkpoint under `root` (every piece's sha256 checked).

    Incomplete or corrupt steps are refused with a warning naming them; raises
    `CheckpointError` listing the reasons when none is usable.
    """
    refused: list[str] = []
    for step, d in _step_dirs(root):
        try:
            manifest = verify_step_dir(d)
            if manifest.step != step:
                raise CheckpointError(f"{d}: manifest is of step {manifest.step}")
            if not manifest.is_full_model():
                missing = manifest.missing_units()
                raise CheckpointError(f"{d}: incomplete, units missing: {', '.join(missing)}")
        except CheckpointError as exc:
            log.warning("checkpoint refused: %s", exc)
            refused.append(str(exc))
            continue
        return CheckpointChoice(step, d, manifest, tuple(refused))
    raise CheckpointError(
        f"no usable checkpoint under {root}"
        + (": " + "; ".join(refused) if refused else " (no step directories)")
    )


def load_latest_checkpoint(root: Path) -> tuple[int, Path]:
    """(step, directory) of the newest complete and intact checkpoint; see
    `find_latest_checkpoint`."""
    choice = find_latest_checkpoint(root)
    return choice.step, choice.path


def checkpoint_holdings(root: Path) -> NodeHoldings:
    """What the checkpoint root holds, for the resolver (`disk=`): finalised steps only.

    Cheap (manifests only, no hashing): every piece is verified when it is copied out.
    """
    steps: dict[tuple[str, int], StepHolding] = {}
    for step, d in _step_dirs(root):
        if not (d / MANIFEST_NAME).is_file():
            continue
        try:
            manifest = read_manifest(d)
        except CheckpointError as exc:
            log.warning("checkpoint refused: %s", exc)
            continue
        if manifest.step == step and manifest.is_full_model():
            steps[(DISK_SOURCE, step)] = StepHolding.from_manifest(DISK_SOURCE, manifest)
    return NodeHoldings(DISK_SOURCE, steps)


def prune_checkpoints(root: Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` finalised checkpoints, and unfinished step
    directories older than the oldest kept. Returns the deleted steps."""
    if keep < 1:
        raise ConfigError(f"persist keep must be >= 1, got {keep}")
    dirs = _step_dirs(root)
    final = [(s, d) for s, d in dirs if (d / MANIFEST_NAME).is_file()]
    if len(final) <= keep:
        return []
    oldest_kept = final[keep - 1][0]
    deleted = []
    for step, d in dirs:
        if step < oldest_kept:
            # Manifest first: a crash mid-delete leaves an incomplete step, never a wrong one.
            (d / MANIFEST_NAME).unlink(missing_ok=True)
            shutil.rmtree(d, ignore_errors=True)
            deleted.append(step)
    return deleted


__all__ = [
    "CheckpointChoice",
    "PersistPolicy",
    "checkpoint_holdings",
    "copy_verified",
    "finalize_checkpoint",
    "find_latest_checkpoint",
    "load_latest_checkpoint",
    "persist_pieces",
    "prune_checkpoints",
]
