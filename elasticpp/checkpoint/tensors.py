"""Pieces as tensors: encode, write, read (verified), reshard, and load for any tp size.

A piece file is one safetensors file holding one unit's state on one tensor-parallel
rank. Tensor names are `param/<name>`, `exp_avg/<name>` and `exp_avg_sq/<name>`. The
safetensors metadata holds one key, `elasticpp`, a JSON string:

    {"format_version": 1, "unit": "block.0003", "tp_rank": 0, "tp_size": 2,
     "step": 17, "shard_dims": {"param/attn.q.weight": 0, "param/ln1.weight": null, ...}}

`step` is the optimizer step the state belongs to (the number of applied updates).
`shard_dims[name]` is the dimension along which the tensor is split across the tp ranks
(slices are contiguous chunks in tp-rank order), or null for a tensor every tp rank holds
whole (replicated). That is all a reader needs to rebuild any other tp size's slices.

Invariants kept here: nothing is ever unpickled (safetensors only); a piece written with
`write_piece` (or `write_streamed`, from host buffers and byte for byte the same file)
appears atomically (`durable.durable_file`) and is returned with its size and sha256;
`read_piece` refuses a file whose checksum, name or metadata does not match.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from elasticpp.checkpoint.durable import durable_file, durable_write
from elasticpp.checkpoint.manifest import (
    MANIFEST_NAME,
    PieceEntry,
    PieceKey,
    read_manifest,
    sha256_bytes,
)
from elasticpp.errors import CheckpointError, ConfigError

PIECE_FORMAT_VERSION = 1
META_KEY = "elasticpp"
KINDS = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class PieceMeta:
    """What a piece says about itself besides its tensors."""

    unit: str
    tp_rank: int
    tp_size: int
    step: int
    shard_dims: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def key(self) -> PieceKey:
        return PieceKey(self.unit, self.tp_rank, self.tp_size)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format_version": PIECE_FORMAT_VERSION,
                "unit": self.unit,
                "tp_rank": self.tp_rank,
                "tp_size": self.tp_size,
                "step": self.step,
                "shard_dims": dict(self.shard_dims),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str, *, source: str) -> PieceMeta:
        try:
            data: Any = json.loads(text)
            if data["format_version"] != PIECE_FORMAT_VERSION:
                raise CheckpointError(
                    f"{source}: piece format_version {data['format_version']!r} is not "
                    f"{PIECE_FORMAT_VERSION}"
                )
            dims: dict[str, int | None] = {}
            for name, dim in dict(data["shard_dims"]).items():
                if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
                    raise CheckpointError(f"{source}: shard dim of {name} is {dim!r}")
                dims[str(name)] = dim
            meta = cls(
                unit=str(data["unit"]),
                tp_rank=int(data["tp_rank"]),
                tp_size=int(data["tp_size"]),
                step=int(data["step"]),
                shard_dims=dims,
            )
            PieceKey(meta.unit, meta.tp_rank, meta.tp_size)  # validates unit and tp rank
            return meta
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, ConfigError) as exc:
            raise CheckpointError(f"{source}: malformed piece metadata: {exc!r}") from exc


@dataclass(frozen=True)
class Piece:
    """A decoded piece: its tensors by full name (`param/<name>`, ...) and its metadata."""

    tensors: dict[str, torch.Tensor]
    meta: PieceMeta


def encode_piece(tensors: Mapping[str, torch.Tensor], meta: PieceMeta) -> bytes:
    """The safetensors bytes of a piece; every tensor must have an entry in shard_dims."""
    missing = sorted(set(tensors) - set(meta.shard_dims))
    if missing:
        raise CheckpointError(f"piece {meta.key.filename}: no shard dim for {missing}")
    plain = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return st_save(plain, metadata={META_KEY: meta.to_json()})


def decode_piece(data: bytes, *, source: str) -> Piece:
    """Parse piece bytes (no checksum check; see `read_piece`)."""
    try:
        tensors = st_load(data)
        header_meta = _metadata_of(data)
    except (SafetensorError, ValueError, OSError) as exc:
        raise CheckpointError(f"{source}: not a readable safetensors piece: {exc}") from exc
    text = header_meta.get(META_KEY)
    if text is None:
        raise CheckpointError(f"{source}: no {META_KEY} metadata")
    meta = PieceMeta.from_json(text, source=source)
    unknown = sorted(set(tensors) - set(meta.shard_dims))
    if unknown:
        raise CheckpointError(f"{source}: tensors without shard dim: {unknown}")
    return Piece(tensors=dict(tensors), meta=meta)


def _metadata_of(data: bytes) -> dict[str, str]:
    # The safetensors header is 8 bytes of little-endian length, then JSON.
    if len(data) < 8:
        raise ValueError("file shorter than a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError("header length past the end of the file")
    header: Any = json.loads(data[8 : 8 + size])
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    if not isinstance(meta, dict):
        raise ValueError("__metadata__ is not a mapping")
    return {str(k): str(v) for k, v in meta.items()}


def write_piece(
    step_dir: Path, key: PieceKey, tensors: Mapping[str, torch.Tensor], meta: PieceMeta
) -> PieceEntry:
    """Write one piece atomically into `step_dir` (created if needed); its size and sha256."""
    if meta.key != key:
        raise CheckpointError(f"piece {key.filename}: metadata says {meta.key.filename}")
    data = encode_piece(tensors, meta)
    step_dir.mkdir(parents=True, exist_ok=True)
    durable_write(step_dir / key.filename, data)
    return PieceEntry(key=key, size=len(data), sha256=sha256_bytes(data))


def piece_header(tensors: Mapping[str, torch.Tensor], meta: PieceMeta) -> tuple[bytes, list[str]]:
    """The safetensors prefix (length + header) of a piece of fp32 tensors, and the tensor
    names in the order their data follows it."""
    names = sorted(tensors)  # one dtype: safetensors orders by name (UTF-8 bytes)
    header: dict[str, Any] = {"__metadata__": {META_KEY: meta.to_json()}}
    offset = 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": "F32",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, names


def write_streamed(
    step_dir: Path, key: PieceKey, tensors: Mapping[str, torch.Tensor], meta: PieceMeta
) -> PieceEntry:
    """Write one piece from host tensors as `write_piece` would, without building its bytes:
    `durable_file`, the directory left to the caller to fsync once for all its pieces."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors.values()):
        return write_piece(step_dir, key, tensors, meta)
    if meta.key != key:
        return write_piece(step_dir, key, tensors, meta)  # which refuses it, naming both
    missing = sorted(set(tensors) - set(meta.shard_dims))
    if missing:
        return write_piece(step_dir, key, tensors, meta)  # which refuses it, naming them
    prefix, names = piece_header(tensors, meta)
    step_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(prefix)
    size = len(prefix)
    with durable_file(step_dir / key.filename, sync_dir=False) as f:
        f.write(prefix)
        for name in names:
            t = tensors[name]
            if t.numel() == 0:
                continue
            view = t.contiguous().numpy().data.cast("B")
            digest.update(view)
            f.write(view)
            size += len(view)
    return PieceEntry(key=key, size=size, sha256=digest.hexdigest())


def read_piece(path: Path, expected_sha256: str | None) -> Piece:
    """Read and verify a piece file: its name, its checksum (when known), its metadata."""
    key = PieceKey.parse(path.name)  # refuses anything that is not a piece name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    if expected_sha256 is not None and sha256_bytes(data) != expected_sha256:
        raise CheckpointError(f"{path}: fails its checksum")
    piece = decode_piece(data, source=str(path))
    if piece.meta.key != key:
        raise CheckpointError(f"{path}: metadata says {piece.meta.key.filename}")
    return piece


def reshard(pieces: Sequence[Piece], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """The slices tp rank `tp_rank` of `tp_size` needs, from a complete set of one unit's pieces.

    Sharded tensors are concatenated along their shard dim (in source tp-rank order) and
    re-chunked; replicated tensors are taken from the first piece.
    """
    if not pieces:
        raise CheckpointError("reshard: no pieces")
    ordered = sorted(pieces, key=lambda p: p.meta.tp_rank)
    unit, size = ordered[0].meta.unit, ordered[0].meta.tp_size
    if [p.meta.tp_rank for p in ordered] != list(range(size)) or any(
        p.meta.unit != unit or p.meta.tp_size != size for p in ordered
    ):
        raise CheckpointError(f"reshard {unit}: not a complete set of tp={size} pieces")
    if not 0 <= tp_rank < tp_size:
        raise CheckpointError(f"reshard {unit}: tp rank {tp_rank} not in [0, {tp_size})")
    steps = {p.meta.step for p in ordered}
    if len(steps) != 1:
        raise CheckpointError(f"reshard {unit}: pieces of different steps {sorted(steps)}")
    out: dict[str, torch.Tensor] = {}
    first = ordered[0]
    for name in sorted(first.tensors):
        dim = first.meta.shard_dims.get(name)
        if any(name not in p.tensors or p.meta.shard_dims.get(name) != dim for p in ordered):
            raise CheckpointError(f"reshard {unit}: tensor {name} differs between pieces")
        if dim is None:
            out[name] = first.tensors[name]
            continue
        whole = (
            first.tensors[name]
            if size == 1
            else torch.cat([p.tensors[name] for p in ordered], dim=dim)
        )
        if whole.shape[dim] % tp_size:
            raise CheckpointError(
                f"reshard {unit}: {name} has {whole.shape[dim]} along dim {dim}, "
                f"not divisible by tp={tp_size}"
            )
        out[name] = whole.chunk(tp_size, dim=dim)[tp_rank].clone()
    return out


@dataclass(frozen=True)
class LoadedUnit:
    """One unit's state resharded for a target tp rank."""

    unit: str
    step: int
    tensors: dict[str, torch.Tensor]
    shard_dims: dict[str, int | None]


def scan_pieces(directory: Path) -> dict[str, dict[int, dict[int, Path]]]:
    """Piece files in a directory: unit -> tp size -> tp rank -> path (other files ignored)."""
    found: dict[str, dict[int, dict[int, Path]]] = {}
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    for path in sorted(directory.iterdir()):
        try:
            key = PieceKey.parse(path.name)
        except ConfigError:
            continue  # not a piece file (a manifest, a temporary file, ...)
        found.setdefault(key.unit, {}).setdefault(key.tp_size, {})[key.tp_rank] = path
    return found


def load_units(
    directory: Path, units: Iterable[str], tp_rank: int, tp_size: int
) -> dict[str, LoadedUnit]:
    """For each unit, a complete set of slices in `directory` (any tp size), resharded.

    A set with the target tp size is preferred (no reshard), then the smallest size.
    Checksums are verified against the directory's manifest when it has one.
    """
    expected: dict[str, str] = {}
    if (directory / MANIFEST_NAME).is_file():
        manifest = read_manifest(directory)
        expected = {e.key.filename: e.sha256 for e in manifest.pieces}
    found = scan_pieces(directory)
    loaded: dict[str, LoadedUnit] = {}
    for unit in units:
        sizes = found.get(unit, {})
        complete = [s for s, ranks in sizes.items() if set(ranks) == set(range(s))]
        if not complete:
            raise CheckpointError(f"{directory}: no complete set of pieces for unit {unit}")
        size = tp_size if tp_size in complete else min(complete)
        if expected and any(p.name not in expected for p in sizes[size].values()):
            raise CheckpointError(f"{directory}: a piece of {unit} is not in the manifest")
        if size == tp_size:
            path = sizes[size][tp_rank]
            piece = read_piece(path, expected.get(path.name) if expected else None)
            tensors = dict(piece.tensors)
            step = piece.meta.step
            dims = dict(piece.meta.shard_dims)
        else:
            pieces = [
                read_piece(p, expected.get(p.name) if expected else None)
                for _, p in sorted(sizes[size].items())
            ]
            tensors = reshard(pieces, tp_rank, tp_size)
            step = pieces[0].meta.step
            dims = dict(pieces[0].meta.shard_dims)
        loaded[unit] = LoadedUnit(unit=unit, step=step, tensors=tensors, shard_dims=dims)
    return loaded


def piece_path(step_dir: Path, name: str) -> Path:
    """The path of piece `name` inside `step_dir`; refuses any name that is not a piece name
    (so `../x`, absolute paths and sub-directories never escape the step directory)."""
    return step_dir / PieceKey.parse(name).filename
