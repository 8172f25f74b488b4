"""`elasticpp data prepare`: tokenise text files into a token file for `elasticpp train`.

    elasticpp data prepare --tokenizer tokenizer.json --out corpus.bin [--eos-token TOKEN] \\
        [--dtype uint16|uint32] [--force] FILE...

Each input file is one document, read as UTF-8 and encoded whole with a Hugging Face
`tokenizers` JSON file, without the tokenizer's own special tokens (its post-processor, e.g.
BERT's [CLS]/[SEP]) and with its truncation and padding turned off, so the ids are exactly
`tokenizer.encode(text, add_special_tokens=False).ids`. With `--eos-token`, that token's id
follows every document (the last one too); by default nothing separates documents. Documents
are written in the order given.

The output is flat little-endian uint16 when every id fits (vocabulary size <= 65536), else
uint32 (or `--dtype`), written to a temporary file beside `--out` and renamed into place, so
an interrupted run leaves no partial corpus. Beside it, `<out>.json` records what was written
(`format_version`, dtype, token and document counts, vocabulary size, the EOS token and the
tokenizer file's sha256). Memory holds one batch of documents (about 16 MiB of text, or one
larger file) at a time; split a huge single file into documents first.

`tokenizers` is the optional extra `elasticpp[data]`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from elasticpp.errors import ConfigError

SIDECAR_FORMAT_VERSION = 1
DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_BATCH_BYTES = 16 << 20  # text tokenised per call: bounds memory, keeps the tokenizer busy
_INSTALL_HINT = "install the optional extra: pip install 'elasticpp[data]'"


def add_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    prep = sub.add_parser(
        "prepare",
        help="tokenise text files into a flat token file (.bin) for elasticpp train",
        description="Tokenise UTF-8 text files (one document each) into a flat little-endian "
        "token file and a JSON sidecar describing it.",
    )
    prep.add_argument("files", nargs="+", type=Path, metavar="FILE", help="UTF-8 text files")
    prep.add_argument(
        "--tokenizer", type=Path, required=True, help="a Hugging Face tokenizers JSON file"
    )
    prep.add_argument("--out", type=Path, required=True, help="the token file to write (.bin)")
    prep.add_argument(
        "--eos-token",
        default=None,
        help="a token of the tokenizer to append after every document (default: none)",
    )
    prep.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="id type (default: uint16 if the vocabulary fits, else uint32)",
    )
    prep.add_argument("--force", action="store_true", help="replace an existing --out")


def run(args: argparse.Namespace) -> int:
    if args.data_command == "prepare":
        return prepare(args)
    raise ConfigError(f"unknown data command {args.data_command!r}")  # argparse prevents it


def sidecar_path(out: Path) -> Path:
    return out.with_name(out.name + ".json")


def _check_paths(files: Sequence[Path], tokenizer: Path, out: Path, force: bool) -> None:
    """Everything about the paths, before anything is read or written."""
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"no such input file(s): {', '.join(missing)}")
    if not tokenizer.is_file():
        raise ConfigError(f"--tokenizer {tokenizer}: no such file")
    if out.suffix != ".bin":
        raise ConfigError(
            f"--out {out}: must end in .bin (elasticpp train reads a .bin file as tokens)"
        )
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: no such directory {out.parent}")
    if not force:
        existing = [str(p) for p in (out, sidecar_path(out)) if p.exists()]
        if existing:
            raise ConfigError(f"{', '.join(existing)} already exist(s); pass --force to replace")


def _load_tokenizer(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ConfigError(f"the 'tokenizers' package is not installed; {_INSTALL_HINT}") from exc
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception for a bad file
        raise ConfigError(
            f"--tokenizer {path}: not a readable tokenizers JSON file: {exc}"
        ) from exc
    # A tokenizer saved for a model's inputs may truncate or pad; a corpus needs every id.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def choose_dtype(vocab_size: int, requested: str | None) -> str:
    """uint16 when every id fits (vocab_size <= 65536), else uint32; `requested` if it fits."""
    fits16 = vocab_size <= 1 << 16
    if requested is None:
        return "uint16" if fits16 else "uint32"
    if requested == "uint16" and not fits16:
        raise ConfigError(
            f"--dtype uint16 holds ids below 65536, but the vocabulary has {vocab_size} tokens"
        )
    return requested


def _batches(files: Sequence[Path]) -> Iterator[list[Path]]:
    batch: list[Path] = []
    size = 0
    for path in files:
        batch.append(path)
        size += path.stat().st_size
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror}") from exc


def _write_tokens(
    tokenizer: Any,
    files: Sequence[Path],
    eos_id: int | None,
    dtype: np.dtype[Any],
    sink: BinaryIO,
    progress: Any,
) -> int:
    """Tokenise `files` in order into `sink`; returns the number of ids written."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets
    limit = np.iinfo(dtype).max
    written = 0
    for batch in _batches(files):
        texts = [_read_text(p) for p in batch]
        encodings = encode(texts, add_special_tokens=False)
        for path, encoding in zip(batch, encodings, strict=True):
            ids = np.asarray(encoding.ids, dtype=np.int64)
            if eos_id is not None:
                ids = np.append(ids, eos_id)
            if len(ids) and int(ids.max()) > limit:
                raise ConfigError(f"{path}: token id {int(ids.max())} does not fit {dtype.name}")
            sink.write(ids.astype(dtype).tobytes())
            written += len(ids)
            progress.update(path.stat().st_size)
    return written


def _atomic_write(path: Path, write: Any) -> None:
    """Write through `write(file)` to a temporary file beside `path`, then rename it."""
    # "x" with a fresh name: never another file, and the usual permissions (umask applies).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        # tmp + fsync + rename: a crash must never leave a half-written file under `path`.
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def prepare(args: argparse.Namespace) -> int:
    files: list[Path] = list(args.files)
    out: Path = args.out
    _check_paths(files, args.tokenizer, out, args.force)
    tokenizer = _load_tokenizer(args.tokenizer)
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ConfigError(f"the 'tqdm' package is not installed; {_INSTALL_HINT}") from exc
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    dtype_name = choose_dtype(vocab_size, args.dtype)
    eos_id: int | None = None
    if args.eos_token is not None:
        eos_id = tokenizer.token_to_id(args.eos_token)
        if eos_id is None:
            raise ConfigError(f"--eos-token {args.eos_token!r}: not a token of {args.tokenizer}")
    tokenizer_sha256 = hashlib.sha256(args.tokenizer.read_bytes()).hexdigest()

    total_bytes = sum(p.stat().st_size for p in files)
    count = 0

    def write_bin(f: BinaryIO) -> None:
        nonlocal count
        # A bar only on a terminal: logs of a batch job should not fill with redraws.
        with tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            desc="tokenising",
            file=sys.stderr,
            disable=None,
        ) as progress:
            count = _write_tokens(tokenizer, files, eos_id, DTYPES[dtype_name], f, progress)
        if count == 0:
            raise ConfigError("the input files hold no tokens; nothing written")

    _atomic_write(out, write_bin)
    sidecar = {
        "format_version": SIDECAR_FORMAT_VERSION,
        "dtype": dtype_name,
        "byte_order": "little",
        "tokens": count,
        "documents": len(files),
        "vocab_size": vocab_size,
        "eos_token": args.eos_token,
        "eos_id": eos_id,
        "tokenizer_sha256": tokenizer_sha256,
    }
    text = json.dumps(sidecar, indent=2, sort_keys=True) + "\n"
    _atomic_write(sidecar_path(out), lambda f: f.write(text.encode()))
    print(
        f"wrote {count} tokens ({len(files)} documents, vocabulary {vocab_size}) to {out} as "
        f"{dtype_name}; train on it with: --data {out} (its sidecar gives the dtype)",
        flush=True,
    )
    return 0
