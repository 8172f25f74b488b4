"""The layer-granular state format: piece names, manifests, checksums, atomic writes.

This module knows files and bytes, not tensors (see `elasticpp.checkpoint.tensors` for
those), so the state store can move and verify pieces without importing torch.

Units and pieces
    A *unit* is the smallest piece of model state that moves between layouts: one entry of
    a model's ordered unit list (`elasticpp.train.model.contract`), named in the character set of
    `elasticpp.names` — for the built-in families `embed` (first stage), `block.NNNN` (one
    transformer block) and `head` (last stage). A *piece* is one unit's state held by one
    tensor-parallel rank: parameters, AdamW moments, and the optimizer step, in one
    safetensors file named `<unit>.tp<rank>-<size>.safetensors`. A unit saved under tp=2
    has two pieces; any layout can rebuild its own slices from a complete set
    (`tensors.reshard`). `PieceKey.parse` is the one parser of piece names: whatever a peer
    or an etcd value claims, a name it accepts is a plain file name in the step directory.

Step directories
    `<root>/step-<step:010d>/` holds the pieces of one committed step and a
    `manifest.json`, written last (`durable.durable_write`), listing every piece with its
    size and sha256. A directory without a manifest is incomplete and never read.

Manifest versions
    4 (written now): also `epoch`, the job epoch that committed the step (a new epoch
    begins whenever the job's etcd state starts afresh; commits order by (epoch,
    generation, step)), and `job`, the job's identity (its name and the fingerprint of what
    its state depends on): a store never takes another job's step for its own.
    3 (still read): `generation`, the plan generation that committed the step.
    2 (still read): `units` lists the model's units in order, so a reader knows what a
    full checkpoint holds for any model; `model`, when the writer knew it, is the model's
    spec (what `elasticpp export` needs to rebuild a Hugging Face directory).
    1 (still read): `num_layers` of the built-in naming, read as the units `embed`,
    `block.0000` ... `head`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticpp.checkpoint.durable import durable_write
from elasticpp.errors import CheckpointError, ConfigError
from elasticpp.names import NAME_PATTERN, parse_name
from elasticpp.plan.specs import ModelSpec, default_units

# 4: the job epoch and the job's identity; 3: a manifest names the generation that committed
# its step (a step recomputed after a rollback is a new commit, never a rewrite of the old
# one); 2: units; 1: num_layers.
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
MANIFEST_NAME = "manifest.json"

_TP_DIGITS = "([0-9]{1,6})"  # ASCII, bounded: int() of a peer's 5,000 digits raised
_PIECE_RE = re.compile(f"({NAME_PATTERN})\\.tp{_TP_DIGITS}-{_TP_DIGITS}\\.safetensors")
_STEP_RE = re.compile(r"^step-([0-9]{10})")


@dataclass(frozen=True, order=True)
class PieceKey:
    unit: str
    tp_rank: int
    tp_size: int

    def __post_init__(self) -> None:
        parse_name(self.unit, what="piece: unit")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(
                f"piece {self.unit}: tp rank {self.tp_rank} not in [0, {self.tp_size})"
            )

    @property
    def filename(self) -> str:
        return f"{self.unit}.tp{self.tp_rank}-{self.tp_size}.safetensors"

    @classmethod
    def parse(cls, name: str) -> PieceKey:
        """The key of a piece file name; refuses anything else (and so any path)."""
        match = _PIECE_RE.fullmatch(name)
        if not match:
            raise ConfigError(f"not a piece name: {name!r:.80}")
        return cls(match.group(1), int(match.group(2)), int(match.group(3)))


def step_dirname(step: int) -> str:
    if step < 0:
        raise ConfigError(f"step must be >= 0, got {step}")
    return f"step-{step:010d}"


def parse_step_dirname(name: str) -> int | None:
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class JobIdentity:
    """Which job a step belongs to: the job's name and the fingerprint of what its state
    depends on (model, its files, seed, batch, optimizer, data). A step of another identity
    is another job's, whatever its units."""

    name: str
    fingerprint: str

    def __post_init__(self) -> None:
        for field_name in ("name", "fingerprint"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value or len(value) > 128:
                raise ConfigError(f"job identity: {field_name} must be 1-128 characters")

    def __str__(self) -> str:
        return f"{self.name} ({self.fingerprint[:12]})"

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, data: Any) -> JobIdentity:
        name = data.get("name") if isinstance(data, dict) else None
        fingerprint = data.get("fingerprint") if isinstance(data, dict) else None
        if not isinstance(name, str) or not isinstance(fingerprint, str):
            raise ConfigError(f"job identity: expected name and fingerprint, got {data!r}")
        return cls(name, fingerprint)


@dataclass(frozen=True)
class PieceEntry:
    key: PieceKey
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What one step directory holds. `units` (the model's, in order) tells a full checkpoint."""

    step: int
    units: tuple[str, ...]
    pieces: tuple[PieceEntry, ...]
    format_version: int = FORMAT_VERSION
    model: ModelSpec | None = None
    generation: int = 0  # the plan generation that committed the step; 0: none recorded
    epoch: int = 0  # the job epoch that committed the step; 0: none recorded
    job: JobIdentity | None = None  # the job whose step it is; None: not recorded

    def entry(self, key: PieceKey) -> PieceEntry | None:
        for e in self.pieces:
            if e.key == key:
                return e
        return None

    def units_complete(self) -> set[str]:
        """Units for which some tp size has every slice present."""
        by_unit: dict[tuple[str, int], set[int]] = {}
        for e in self.pieces:
            by_unit.setdefault((e.key.unit, e.key.tp_size), set()).add(e.key.tp_rank)
        return {u for (u, size), ranks in by_unit.items() if len(ranks) == size}

    def missing_units(self) -> list[str]:
        """The model's units without a complete set of slices, in model order."""
        complete = self.units_complete()
        return [u for u in self.units if u not in complete]

    def is_full_model(self) -> bool:
        return not self.missing_units()

    def to_json(self) -> str:
        return json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "step": self.step,
                "units": list(self.units),
                "generation": self.generation,
                "epoch": self.epoch,
                **({} if self.job is None else {"job": self.job.to_dict()}),
                **({} if self.model is None else {"model": self.model.to_dict()}),
                "pieces": [
                    {"name": e.key.filename, "size": e.size, "sha256": e.sha256}
                    for e in sorted(self.pieces, key=lambda e: e.key)
                ],
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest") -> Manifest:
        try:
            data: Any = json.loads(text)
            version = data["format_version"]
            if version not in READABLE_VERSIONS:
                raise CheckpointError(
                    f"{source}: format_version {version!r} is not one of "
                    f"{', '.join(map(str, READABLE_VERSIONS))} (written by a newer elasticpp?)"
                )
            pieces = tuple(
                PieceEntry(PieceKey.parse(p["name"]), int(p["size"]), str(p["sha256"]))
                for p in data["pieces"]
            )
            model = None
            if version == 1:
                units = default_units(int(data["num_layers"]))
            else:
                units = tuple(parse_name(u, what="unit") for u in data["units"])
                if data.get("model") is not None:
                    model = ModelSpec.from_dict(dict(data["model"]), source=f"{source} model")
            generation = int(data.get("generation", 0)) if version >= 3 else 0
            epoch = int(data.get("epoch", 0)) if version >= 4 else 0
            if generation < 0 or epoch < 0:
                raise ValueError(f"generation {generation} or epoch {epoch} is negative")
            job = JobIdentity.from_dict(data["job"]) if data.get("job") is not None else None
            return cls(int(data["step"]), units, pieces, version, model, generation, epoch, job)
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            raise CheckpointError(f"{source}: malformed manifest: {exc}") from exc


def write_manifest(step_dir: Path, manifest: Manifest) -> None:
    durable_write(step_dir / MANIFEST_NAME, manifest.to_json().encode())


def read_manifest(step_dir: Path) -> Manifest:
    path = step_dir / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(f"{step_dir}: incomplete (no {MANIFEST_NAME})")
    return Manifest.from_json(path.read_text(encoding="utf-8"), source=str(path))


def find_step_dir(path: Path, *, what: str = "checkpoint") -> Path:
    """A step directory with a manifest, or the newest such directory under a root."""
    path = Path(path)
    if (path / MANIFEST_NAME).is_file():
        return path
    if not path.is_dir():
        raise ConfigError(f"{what} {path}: not a directory")
    steps = sorted(
        (s, p)
        for p in path.iterdir()
        if (s := parse_step_dirname(p.name)) is not None and (p / MANIFEST_NAME).is_file()
    )
    if not steps:
        raise ConfigError(f"{what} {path}: no step directory with a manifest")
    return steps[-1][1]


def verify_step_dir(step_dir: Path) -> Manifest:
    """The manifest of a step directory whose every listed piece is present and intact."""
    manifest = read_manifest(step_dir)
    for e in manifest.pieces:
        path = step_dir / e.key.filename
        if not path.is_file():
            raise CheckpointError(f"{step_dir}: piece {e.key.filename} is missing")
        if path.stat().st_size != e.size or sha256_file(path) != e.sha256:
            raise CheckpointError(f"{step_dir}: piece {e.key.filename} fails its checksum")
    return manifest
