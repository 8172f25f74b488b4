"""Token files and their sidecars: which files a dataset is, in which order, read as what.

A dataset of token ids is one or more *shards* read as one stream: the shards of a list, or
the `.bin`/`.npy` files under a directory, in sorted path order (relative POSIX paths under a
directory). Global position `n` of the stream is position `n - start_k` of shard `k`, where
`start_k` is the total length of the shards before it, so how the ids are split into files
changes nothing that reads the stream.

A `.bin` shard is flat little-endian ids. `elasticpp data prepare` writes a JSON sidecar beside
it (`<file>.json`); when there is one, it decides the dtype: a `data_dtype` that contradicts
it is refused naming both, as is a file whose size is not the sidecar's token count. A `.bin`
shard without a sidecar is read as `data_dtype`; with neither it is refused (never read as
raw bytes: a lost sidecar must not train on garbage). A `.npy` shard
carries its own dtype. Every shard of a dataset must hold the same dtype, and every sidecar
must agree on the vocabulary size, the tokenizer and the end-of-document id: shards of two
tokenizers are one garbage dataset, not one corpus.

Pure numpy (no torch), so the CLI can refuse bad data before any worker starts.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from elasticpp.errors import ConfigError
from elasticpp.train.config import TOKEN_SUFFIXES

# 2 added `eod_id`/`eod_token`; 1 (still read) called them `eos_id`/`eos_token`.
SIDECAR_FORMAT_VERSION = 2
_SIDECAR_VERSIONS = (1, 2)
BIN_DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# (kind, itemsize) of the .npy dtypes accepted as token ids; any byte order.
NPY_KINDS = {("u", 2): "uint16", ("u", 4): "uint32", ("i", 4): "int32", ("i", 8): "int64"}

TokenArray = npt.NDArray[Any]  # a read-only memory map of uint16/uint32/int32/int64 ids


def sidecar_path(path: Path) -> Path:
    """Where `elasticpp data prepare` records what it wrote to `path`."""
    return path.with_name(path.name + ".json")


@dataclass(frozen=True)
class Sidecar:
    """What a sidecar says about its token file (the fields a reader relies on)."""

    path: str
    dtype: str
    tokens: int
    vocab_size: int
    eod_id: int | None
    tokenizer_sha256: str | None


def read_sidecar(token_file: Path) -> Sidecar | None:
    """The sidecar of `token_file`, None when it has none; refuses one it cannot trust."""
    path = sidecar_path(token_file)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"train: sidecar {str(path)!r} is not readable JSON: {exc}") from exc

    def bad(what: str) -> ConfigError:
        return ConfigError(f"train: sidecar {str(path)!r}: {what}")

    if not isinstance(data, dict):
        raise bad("expected a JSON object")
    if data.get("format_version") not in _SIDECAR_VERSIONS:
        raise bad(
            f"format_version {data.get('format_version')!r} is not one of "
            f"{', '.join(map(str, _SIDECAR_VERSIONS))}"
        )
    if data.get("dtype") not in BIN_DTYPES:
        raise bad(f"dtype {data.get('dtype')!r} is not one of {', '.join(BIN_DTYPES)}")
    if data.get("byte_order", "little") != "little":
        raise bad(f"byte_order {data.get('byte_order')!r} is not 'little'")
    for key in ("tokens", "vocab_size"):
        v = data.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad(f"{key} must be an integer >= 0, got {v!r}")
    eod = data.get("eod_id" if data["format_version"] >= 2 else "eos_id")
    if eod is not None and (isinstance(eod, bool) or not isinstance(eod, int) or eod < 0):
        raise bad(f"eod_id must be an integer >= 0 or null, got {eod!r}")
    sha = data.get("tokenizer_sha256")
    return Sidecar(
        path=str(path),
        dtype=data["dtype"],
        tokens=data["tokens"],
        vocab_size=data["vocab_size"],
        eod_id=eod,
        tokenizer_sha256=sha if isinstance(sha, str) else None,
    )


@dataclass(frozen=True)
class Shard:
    """One opened token file: its ids (memory-mapped), their dtype name, and its sidecar."""

    name: str
    tokens: TokenArray
    dtype: str
    sidecar: Sidecar | None


def open_shard(path: str, data_dtype: str | None) -> Shard:
    """A memory map of the token ids in `path` (.npy, or .bin read as its sidecar says)."""
    p = Path(path)
    if not p.is_file():
        what = "a directory" if p.is_dir() else "no such file"
        raise ConfigError(f"train: data {path!r}: {what}; a token file must be a .npy or .bin file")
    if p.suffix.lower() == ".npy":
        try:
            tokens = np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"train: data {path!r}: not a readable .npy array: {exc}") from exc
        if not isinstance(tokens, np.ndarray):
            raise ConfigError(f"train: data {path!r}: not a .npy array")
        kind = NPY_KINDS.get((tokens.dtype.kind, tokens.dtype.itemsize))
        if kind is None or tokens.ndim != 1:
            raise ConfigError(
                f"train: data {path!r}: a .npy token file must be a 1-D array of "
                f"{', '.join(NPY_KINDS.values())}; got {tokens.ndim}-D {tokens.dtype}"
            )
        if data_dtype is not None and data_dtype != kind:
            raise ConfigError(
                f"train: data {path!r} holds {kind} ids but data_dtype is {data_dtype!r}; "
                "a .npy file carries its own dtype (leave data_dtype unset)"
            )
        return Shard(path, tokens, kind, None)
    sidecar = read_sidecar(p)
    if sidecar is not None:
        if data_dtype is not None and data_dtype != sidecar.dtype:
            # The ids' width is a fact of the file; reading it as another width gives ids that
            # may all be in the vocabulary and still be garbage.
            raise ConfigError(
                f"train: data {path!r} holds {sidecar.dtype} ids (its sidecar "
                f"{sidecar.path!r} says so) but data_dtype is {data_dtype!r}; leave data_dtype "
                "unset or make it match"
            )
        dtype_name = sidecar.dtype
    elif data_dtype in BIN_DTYPES:
        dtype_name = data_dtype
    elif data_dtype is None:
        # Nothing says how wide its ids are: guessing (or reading bytes) trains on garbage.
        raise ConfigError(
            f"train: data {path!r} has no sidecar ({sidecar_path(p).name}) and no data_dtype "
            "was given, so the width of its token ids is unknown; write it with `elasticpp "
            "data prepare`, which puts the sidecar beside it, or give the dtype with "
            f"--data-dtype ({' or '.join(BIN_DTYPES)}; data_dtype in a job spec)"
        )
    else:
        raise ConfigError(
            f"train: data {path!r} has no sidecar ({sidecar_path(p).name}, which elasticpp data "
            f"prepare writes); data_dtype must be one of {', '.join(BIN_DTYPES)} to read it as "
            f"token ids, got {data_dtype!r}"
        )
    dtype = BIN_DTYPES[dtype_name]
    size = p.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(
            f"train: data {path!r} is {size} bytes, not a whole number of {dtype_name} tokens "
            f"({dtype.itemsize} bytes each); is data_dtype right?"
        )
    if sidecar is not None and size != sidecar.tokens * dtype.itemsize:
        raise ConfigError(
            f"train: data {path!r} holds {size // dtype.itemsize} {dtype_name} tokens but its "
            f"sidecar says {sidecar.tokens}; the file or its sidecar is not the one written"
        )
    if size == 0:  # numpy cannot map an empty file
        empty: TokenArray = np.zeros(0, dtype=dtype)
        return Shard(path, empty, dtype_name, sidecar)
    mapped: TokenArray = np.memmap(p, dtype=dtype, mode="r")
    return Shard(path, mapped, dtype_name, sidecar)


def shards_under(root: Path) -> list[Path] | None:
    """The token shards under directory `root` in order, or None if it holds none (raw bytes).

    Hidden files (a `.name`, as a temporary file of `data prepare`) are not part of it; any
    other file that is neither a shard nor the sidecar of one is refused: a directory is one
    dataset, of token shards or of raw bytes, never both."""
    shards: list[Path] = []
    others: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            (shards if path.suffix.lower() in TOKEN_SUFFIXES else others).append(path)
    if not shards:
        return None
    sidecars = {sidecar_path(p) for p in shards if p.suffix.lower() == ".bin"}
    stray = sorted(str(p.relative_to(root)) for p in others if p not in sidecars)
    if stray:
        raise ConfigError(
            f"train: data {str(root)!r} holds token shards (.bin, .npy) and other files "
            f"({', '.join(stray[:3])}{', ...' if len(stray) > 3 else ''}); a directory is "
            "one dataset: move the other files out"
        )
    # Sorted by relative POSIX path: the walk order of a file system is not stable.
    return sorted(shards, key=lambda p: p.relative_to(root).as_posix())


def check_agreement(shards: Sequence[Shard]) -> None:
    """Refuse shards that cannot be one dataset, naming the first pair that differs."""
    first = shards[0]
    for shard in shards[1:]:
        if shard.dtype != first.dtype:
            raise _disagree("dtype", first.name, first.dtype, shard.name, shard.dtype)
    with_sidecar = [s for s in shards if s.sidecar is not None]
    for field in ("vocab_size", "tokenizer_sha256", "eod_id"):
        for a, b in itertools.pairwise(with_sidecar):
            va, vb = getattr(a.sidecar, field), getattr(b.sidecar, field)
            if va != vb:
                raise _disagree(field, a.name, va, b.name, vb)


def _disagree(field: str, a: str, va: object, b: str, vb: object) -> ConfigError:
    return ConfigError(
        f"train: token shards {a!r} ({field} {va!r}) and {b!r} ({field} {vb!r}) differ; the "
        f"shards of one dataset must agree on {field}"
    )


class TokenStream:
    """Shards read as one stream of ids, addressed by global position (module docstring).

    Offers what a reader of one memory map uses: `len` and contiguous slices."""

    def __init__(self, shards: Sequence[Shard]) -> None:
        if not shards:
            raise ConfigError("train: a token dataset needs at least one shard")
        self.shards = list(shards)
        lengths = [len(s.tokens) for s in self.shards]
        self._starts = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, key: slice) -> TokenArray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("a token stream is read in contiguous slices only")
        # The shard holding `start` is the last one starting at or before it.
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces: list[TokenArray] = []
        pos = start
        while pos < stop:
            local = pos - int(self._starts[k])
            take = min(stop, int(self._starts[k + 1])) - pos
            if take > 0:
                pieces.append(self.shards[k].tokens[local : local + take])
                pos += take
            k += 1
        if not pieces:
            empty: TokenArray = self.shards[0].tokens[:0]
            return empty
        if len(pieces) == 1:
            return pieces[0]
        joined: TokenArray = np.concatenate(pieces)
        return joined

    def locate(self, position: int) -> tuple[str, int]:
        """The shard holding global `position`, and the position within it."""
        k = int(np.searchsorted(self._starts, position, side="right")) - 1
        k = min(k, len(self.shards) - 1)
        return self.shards[k].name, position - int(self._starts[k])
