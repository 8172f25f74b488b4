"""`elasticpp data prepare`: tokenise text files into a token file for `elasticpp train`.

    elasticpp data prepare --tokenizer tokenizer.json --out corpus.bin \\
        [--eos-token TOKEN | --eod-id ID | --no-eod] [--dtype uint16|uint32] [--force] FILE...

Each input file is one document, read as UTF-8 and encoded whole with a Hugging Face
`tokenizers` JSON file, without the tokenizer's own special tokens (its post-processor, e.g.
BERT's [CLS]/[SEP]) and with its truncation and padding turned off, so the ids are exactly
`tokenizer.encode(text, add_special_tokens=False).ids`. An end-of-document id follows every
document (the last one too), so a window that spans two documents shows the model where one
ends: the tokenizer's own end-of-text token by default (the `eos_token` of a
`tokenizer_config.json` beside the tokenizer file, else its one special token named like
`<|endoftext|>`, `<|end_of_text|>`, `</s>` or `<eos>`), `--eos-token TOKEN` or `--eod-id ID`
to choose another, `--no-eod` for none. A tokenizer with several such special tokens is
refused rather than guessed at; one with none writes no separator and warns on stderr. The
sidecar records the choice. Documents are written in the order given.

The output is flat little-endian uint16 when every id fits (vocabulary size <= 65536), else
uint32 (or `--dtype`), written to a temporary file beside `--out` and renamed into place, so
an interrupted run leaves no partial corpus. Beside it, the sidecar `<out>.json` records what
was written (`format_version`, dtype, token and document counts, vocabulary size, the
end-of-document id and token, the tokenizer file's sha256); `elasticpp train` reads the dtype
from it. Memory holds one batch of documents (about 16 MiB of text, or one larger file) at a
time; split a huge single file into documents first.

`tokenizers` is the optional extra `elasticpp[data]`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from elasticpp.checkpoint.durable import durable_file, durable_write
from elasticpp.cli import flagtypes
from elasticpp.cli.output import add_output_flag, emit, message_table
from elasticpp.errors import ConfigError
from elasticpp.train.data.tokenfiles import BIN_DTYPES as DTYPES
from elasticpp.train.data.tokenfiles import SIDECAR_FORMAT_VERSION, sidecar_path

# Names tokenizers give their end-of-text token: GPT-2, GPT-NeoX and Qwen; Llama 3; Llama 2,
# Mistral and T5; Gemma. A chat turn's end (<|im_end|>, <|eot_id|>) is not a document's.
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
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
    prep.add_argument(
        "files", nargs="+", type=flagtypes.path, metavar="FILE", help="UTF-8 text files"
    )
    prep.add_argument(
        "--tokenizer",
        type=flagtypes.path,
        required=True,
        help="a Hugging Face tokenizers JSON file",
    )
    prep.add_argument(
        "--out", type=flagtypes.path, required=True, help="the token file to write (.bin)"
    )
    eod = prep.add_mutually_exclusive_group()
    eod.add_argument(
        "--eos-token",
        type=flagtypes.nonempty,
        default=None,
        help="the token to append after every document (default: the tokenizer's end of text)",
    )
    eod.add_argument(
        "--eod-id",
        type=flagtypes.nonnegative_int,
        default=None,
        help="the id to append after every document",
    )
    eod.add_argument(
        "--no-eod", action="store_true", help="write documents back to back, with no separator"
    )
    prep.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="id type (default: uint16 if the vocabulary fits, else uint32)",
    )
    prep.add_argument("--force", action="store_true", help="replace an existing --out")
    add_output_flag(prep)


def run(args: argparse.Namespace) -> int:
    if args.data_command == "prepare":
        return prepare(args)
    raise ConfigError(f"unknown data command {args.data_command!r}")  # argparse prevents it


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


def choose_eod(args: argparse.Namespace, tokenizer: Any, vocab_size: int) -> tuple[int, str] | None:
    """The end-of-document id and its token: from the flags, else the tokenizer's own; None
    when the tokenizer has none that can be told (the caller says so on stderr)."""
    if args.no_eod:
        return None
    if args.eod_id is not None:
        if not 0 <= args.eod_id < vocab_size:
            raise ConfigError(
                f"--eod-id {args.eod_id}: not an id of the tokenizer (vocabulary {vocab_size})"
            )
        token = tokenizer.id_to_token(args.eod_id)
        return args.eod_id, str(token) if token is not None else ""
    if args.eos_token is not None:
        name, source = args.eos_token, "--eos-token"
    else:
        found = _tokenizer_eod(args.tokenizer, tokenizer)
        if found is None:
            return None
        name, source = found
    eod_id = tokenizer.token_to_id(name)
    if eod_id is None:
        raise ConfigError(f"{source} {name!r}: not a token of {args.tokenizer}")
    return int(eod_id), name


def _tokenizer_eod(path: Path, tokenizer: Any) -> tuple[str, str] | None:
    """The tokenizer's end-of-text token and where it was found; None if it has none."""
    config = path.with_name("tokenizer_config.json")
    if config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{config}: not a readable JSON object: {exc}") from exc
        if isinstance(eos, dict):  # {"content": "</s>", ...}, as older transformers save it
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos, f"eos_token of {config}"
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    found = [name for name in EOD_NAMES if name in special]
    if len(found) > 1:
        raise ConfigError(
            f"--tokenizer {path}: several special tokens may end a text ({', '.join(found)}); "
            "choose one with --eos-token TOKEN or --eod-id ID"
        )
    return (found[0], f"special token of {path}") if found else None


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
    eod_id: int | None,
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
            if eod_id is not None:
                ids = np.append(ids, eod_id)
            if len(ids) and int(ids.max()) > limit:
                raise ConfigError(f"{path}: token id {int(ids.max())} does not fit {dtype.name}")
            sink.write(ids.astype(dtype).tobytes())
            written += len(ids)
            progress.update(path.stat().st_size)
    return written


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
    eod = choose_eod(args, tokenizer, vocab_size)
    eod_id, eod_token = eod if eod is not None else (None, None)
    if eod is None and not args.no_eod:
        print(
            f"elasticpp data prepare: warning: {args.tokenizer} has no end-of-text token "
            f"(no tokenizer_config.json eos_token, no special token of {', '.join(EOD_NAMES)}); "
            "documents are written back to back. Give --eos-token or --eod-id to separate "
            "them, or --no-eod to say that this is meant",
            file=sys.stderr,
        )
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
            count = _write_tokens(tokenizer, files, eod_id, DTYPES[dtype_name], f, progress)
        if count == 0:
            raise ConfigError("the input files hold no tokens; nothing written")

    # A crash, an error or Ctrl-C never leaves a half-written file under `out`.
    with durable_file(out) as f:
        write_bin(f)
    sidecar = {
        "format_version": SIDECAR_FORMAT_VERSION,
        "dtype": dtype_name,
        "byte_order": "little",
        "tokens": count,
        "documents": len(files),
        "vocab_size": vocab_size,
        "eod_token": eod_token,
        "eod_id": eod_id,
        "tokenizer_sha256": tokenizer_sha256,
    }
    text = json.dumps(sidecar, indent=2, sort_keys=True) + "\n"
    durable_write(sidecar_path(out), text.encode())
    sep = "no separator" if eod_id is None else f"{eod_token!r} (id {eod_id}) after each"
    message = (
        f"wrote {count} tokens ({len(files)} documents, {sep}, vocabulary {vocab_size}) to "
        f"{out} as {dtype_name}; train on it with: --data {out} (its sidecar gives the dtype)"
    )
    result = {"out": str(out), "sidecar": str(sidecar_path(out)), **sidecar, "message": message}
    emit(result, args.output, message_table)
    return 0
