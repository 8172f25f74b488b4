"""A checkpoint root as a job reads it: which of its steps are usable, what it holds, and
which it may delete. The root's layout and how steps are written into it are
`elasticpp.store.persist`.

What a job reads from a checkpoint root (`checkpoint_holdings`) and prunes from it
(`prune_checkpoints`) is its own: another job's complete checkpoints in the same root are
ignored and never deleted (manifests of an older release name no job and count as any
job's). Loading (`find_latest_checkpoint`) verifies every piece's sha256 and refuses, with the
reason, a step that is incomplete or corrupt, falling back to the previous complete one.
Nothing here writes a piece or a manifest; pruning deletes a step's manifest first, so a
crash mid-delete leaves an incomplete step, never a wrong one.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from elasticpp.checkpoint.manifest import (
    MANIFEST_NAME,
    JobIdentity,
    Manifest,
    parse_step_dirname,
    read_manifest,
    verify_step_dir,
)
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.store.holdings import DISK_SOURCE, NodeHoldings, StepHolding

log = logging.getLogger(__name__)


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


def _is_ours(manifest: Manifest, job: JobIdentity | None) -> bool:
    return job is None or manifest.job is None or manifest.job == job


def checkpoint_holdings(root: Path, job: JobIdentity | None = None) -> NodeHoldings:
    """What the checkpoint root holds, for the resolver (`disk=`): finalised steps only, and
    with `job` given, only that job's (another job's are skipped, logged once per call).

    Cheap (manifests only, no hashing): every piece is verified when it is copied out.
    """
    steps: dict[tuple[str, int], StepHolding] = {}
    foreign: list[str] = []
    for step, d in _step_dirs(root):
        if not (d / MANIFEST_NAME).is_file():
            continue
        try:
            manifest = read_manifest(d)
        except CheckpointError as exc:
            log.warning("checkpoint refused: %s", exc)
            continue
        if not _is_ours(manifest, job):
            foreign.append(f"{d.name} ({manifest.job})")
        elif manifest.step == step and manifest.is_full_model():
            steps[(DISK_SOURCE, step)] = StepHolding.from_manifest(DISK_SOURCE, manifest)
    if foreign:
        log.warning(
            "checkpoints of another job in %s ignored (this job is %s): %s",
            root,
            job,
            ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else ""),
        )
    return NodeHoldings(DISK_SOURCE, steps)


def _foreign(d: Path, job: JobIdentity | None) -> bool:
    """Whether `d` holds a finalised checkpoint of a job other than `job` (or unreadable)."""
    if job is None:
        return False
    try:
        return not _is_ours(read_manifest(d), job)
    except CheckpointError:
        return True  # not ours to judge: left alone


def prune_checkpoints(root: Path, keep: int, job: JobIdentity | None = None) -> list[int]:
    """Delete all but the newest `keep` finalised checkpoints (of `job`, if given: another
    job's are never deleted), and unfinished step directories older than the oldest kept.
    Returns the deleted steps."""
    if keep < 1:
        raise ConfigError(f"persist keep must be >= 1, got {keep}")
    dirs = [
        (s, d)
        for s, d in _step_dirs(root)
        if not ((d / MANIFEST_NAME).is_file() and _foreign(d, job))
    ]
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
    "checkpoint_holdings",
    "find_latest_checkpoint",
    "load_latest_checkpoint",
    "prune_checkpoints",
]
