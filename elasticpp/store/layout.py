"""Where one node's store keeps its files, under `root` (every step directory has the
checkpoint format of `elasticpp.checkpoint.manifest`: piece files + `manifest.json` written
last):

    own/epoch-<E>/gen-<G>/step-<k>/    written by this node's workers of plan generation G of
                                       job epoch E (`snapshot_dir(E, G)`); the manifest is
                                       written by `commit`
    replicas/<origin>/epoch-<E>/gen-<G>/step-<k>/  copies of a peer's committed steps
    staging/                           transfers in flight and resume directories' sources

Epoch 0 (no job epoch: tools, benchmarks, stores of an older release) has no `epoch-` level,
generation 0 (steps written outside any plan generation) no `gen-` level: an older release's
`own/gen-<G>/step-<k>/` is epoch 0, generation G. A disk scan (`step_dirs`) yields every
(epoch, generation, step) found, so a restart rebuilds the commit order. Paths only: what is
committed, and when files go, is `elasticpp.store.local`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from elasticpp.checkpoint.manifest import (
    MANIFEST_NAME,
    JobIdentity,
    parse_step_dirname,
    read_manifest,
    step_dirname,
)
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.store.holdings import StepHolding, check_node_id

log = logging.getLogger("elasticpp.store.local")

OWN_DIRNAME = "own"
REPLICAS_DIRNAME = "replicas"
STAGING_DIRNAME = "staging"
_GEN_RE = re.compile(r"^gen-([0-9]{8})$")
_EPOCH_RE = re.compile(r"^epoch-([0-9]{20})$")


def gen_dirname(generation: int) -> str:
    return f"gen-{generation:08d}"


def parse_gen_dirname(name: str) -> int | None:
    m = _GEN_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def epoch_dirname(epoch: int) -> str:
    # 20 digits: an epoch is about a time in nanoseconds (19 digits); names sort numerically.
    return f"epoch-{epoch:020d}"


def parse_epoch_dirname(name: str) -> int | None:
    m = _EPOCH_RE.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StoreLayout:
    """The directories of one node's store; `own/`, `replicas/` and `staging/` exist."""

    root: Path
    node_id: str
    own_dir: Path = field(init=False)
    replicas_dir: Path = field(init=False)
    staging_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        for name, dirname in (
            ("own_dir", OWN_DIRNAME),
            ("replicas_dir", REPLICAS_DIRNAME),
            ("staging_dir", STAGING_DIRNAME),
        ):
            d = self.root / dirname
            d.mkdir(parents=True, exist_ok=True)
            object.__setattr__(self, name, d)

    def base(self, origin: str) -> Path:
        check_node_id(origin, field_name="origin_node")
        return self.own_dir if origin == self.node_id else self.replicas_dir / origin

    def commit_dir(self, origin: str, epoch: int, generation: int) -> Path:
        """The directory of `origin`'s steps of one (epoch, generation)."""
        base = self.base(origin)
        if epoch:
            base = base / epoch_dirname(epoch)
        if generation:
            base = base / gen_dirname(generation)
        return base

    def step_dir(self, origin: str, step: int, epoch: int, generation: int) -> Path:
        return self.commit_dir(origin, epoch, generation) / step_dirname(step)

    def snapshot_dir(self, epoch: int, generation: int) -> Path:
        return self.commit_dir(self.node_id, epoch, generation)

    def origins(self) -> list[str]:
        """This node and every origin it has a replica directory of (odd names skipped)."""
        origins = [self.node_id]
        for d in sorted(self.replicas_dir.iterdir()):
            try:
                origins.append(check_node_id(d.name))
            except ConfigError:
                log.warning("store %s: ignoring unexpected directory %s", self.node_id, d)
        return origins

    def step_dirs(self, origin: str) -> Iterator[tuple[int, int, int, Path]]:
        """(epoch, generation, step, directory) of every step directory of `origin` on disk."""
        base = self.base(origin)
        if not base.is_dir():
            return
        yield from _gen_step_dirs(base, 0)
        for d in sorted(base.iterdir()):
            epoch = parse_epoch_dirname(d.name)
            if epoch is not None and d.is_dir():
                yield from _gen_step_dirs(d, epoch)

    def empty_dirs(self, origin: str) -> Iterator[tuple[int, int, Path]]:
        """(epoch, generation, directory) of the `epoch-`/`gen-` directories of `origin`,
        deepest first (for removing the empty ones)."""
        base = self.base(origin)
        if not base.is_dir():
            return
        for d in sorted(base.iterdir()):
            epoch = parse_epoch_dirname(d.name)
            gen = parse_gen_dirname(d.name)
            if epoch is not None and d.is_dir():
                for g in sorted(d.iterdir()):
                    g_gen = parse_gen_dirname(g.name)
                    if g_gen is not None:
                        yield epoch, g_gen, g
                yield epoch, 0, d
            elif gen is not None:
                yield 0, gen, d


def _gen_step_dirs(base: Path, epoch: int) -> Iterator[tuple[int, int, int, Path]]:
    for d in sorted(base.iterdir()):
        step = parse_step_dirname(d.name)
        if step is not None:
            yield epoch, 0, step, d
            continue
        gen = parse_gen_dirname(d.name)
        if gen is None or not d.is_dir():
            continue
        for sd in sorted(d.iterdir()):
            step = parse_step_dirname(sd.name)
            if step is not None:
                yield epoch, gen, step, sd


@dataclass
class Scan:
    """What a store's directories hold (`scan`): per origin, the committed steps of this job
    in directory order; the step directories that are not (another job's, unreadable, or
    with a manifest that contradicts its directory), never to be read or deleted; and the
    other job's ones, with the job their manifest names (said once in the log)."""

    commits: dict[str, list[StepHolding]] = field(default_factory=dict)
    foreign: set[Path] = field(default_factory=set)
    other_jobs: list[tuple[Path, JobIdentity]] = field(default_factory=list)


def scan(layout: StoreLayout, job: JobIdentity | None) -> Scan:
    """Read the manifest of every step directory under `layout` (a directory without one is
    not committed and is left out): what a previous run of the node left."""
    out = Scan()
    for origin in layout.origins():
        held = out.commits.setdefault(origin, [])
        for epoch, gen, step, d in list(layout.step_dirs(origin)):
            if not (d / MANIFEST_NAME).is_file():
                continue
            try:
                manifest = read_manifest(d)
            except CheckpointError as exc:
                log.warning("store %s: ignoring %s: %s", layout.node_id, d, exc)
                out.foreign.add(d)  # unreadable: not ours to delete either
                continue
            if job is not None and manifest.job not in (None, job):
                out.foreign.add(d)
                out.other_jobs.append((d, manifest.job))
                continue
            if manifest.generation not in (0, gen) or manifest.epoch not in (0, epoch):
                log.warning(
                    "store %s: ignoring %s: its manifest names generation %d of epoch %d",
                    layout.node_id,
                    d,
                    manifest.generation,
                    manifest.epoch,
                )
                out.foreign.add(d)
                continue
            holding = StepHolding.from_manifest(origin, manifest)
            held.append(StepHolding(origin, step, holding.units, holding.pieces, gen, epoch))
    return out
