"""Carry out a `ResumePlan` on one node: put every local rank's pieces in its resume dir.

For each rank of this node, `rank_dirs[rank]` becomes a step directory in the checkpoint
format (pieces + `manifest.json`) holding exactly what the rank needs at the resume step:
local pieces are hard-linked from the store (verified once), remote ones are fetched over
gRPC (verified by the client) or copied from the persistent checkpoint (verified while
copying) into the store's staging area once per node, then linked into every rank that
needs them. Transfers from different sources run in parallel.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from elasticpp.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    PieceEntry,
    PieceKey,
    step_dirname,
    write_manifest,
)
from elasticpp.errors import ConfigError, StateUnavailableError
from elasticpp.store.client import StateClient
from elasticpp.store.layout import link_or_copy
from elasticpp.store.local import LocalStore
from elasticpp.store.persist import copy_verified
from elasticpp.store.resolver import DISK_SOURCE, Fetch, FetchKind, ResumePlan

log = logging.getLogger(__name__)


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
    address = peers.get(source)
    if address is None:
        raise StateUnavailableError(f"resume: no address for source node {source}")
    with client_factory(address) as client:
        for f in fetches:
            client.fetch_piece(
                resume.step,
                f.piece_name,
                f.origin_node,
                _staged_path(staging, f),
                f.sha256,
                resume.generation,
                expected_size=f.size,
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
