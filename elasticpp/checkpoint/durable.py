"""The one way a checkpoint file, or any file a reader must never see half of, is written:
to a unique temporary name beside it, flushed and fsynced, renamed into place, then (by
default) its directory fsynced so the new name survives a crash. On any error the
temporary file is removed and the file at `path`, if one was there, is untouched.

The temporary name is unique (not the pid: writers on other hosts may share a persist
directory, and pids repeat across containers) and starts with a dot, so scans of a step
directory (`*.safetensors`, `manifest.json`) never see it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

COPY_CHUNK_BYTES = 4 << 20


def temporary_name(path: Path) -> Path:
    """A fresh hidden name beside `path`."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")


@contextmanager
def durable_file(path: Path, *, sync: bool = True, sync_dir: bool = True) -> Iterator[BinaryIO]:
    """A new binary file that appears at `path` when the block ends without an error, whole
    (`sync`: fsynced first); `sync_dir`: the directory too (a caller that writes many files
    into one directory may fsync it once after the last, `fsync_dir`). An error inside the
    block, raised by the caller to refuse what it wrote (a checksum that does not match),
    leaves nothing behind."""
    tmp = temporary_name(path)
    try:
        with tmp.open("xb") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if sync_dir:
        fsync_dir(path.parent)


def durable_write(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """`data` at `path`, durably (`durable_file`)."""
    with durable_file(path, sync_dir=sync_dir) as f:
        f.write(data)


def link_or_copy(src: Path, dst: Path) -> None:
    """Make `dst` hold the bytes of `src`: a hard link where possible, else a durable copy.
    The name appears atomically either way (made under a temporary name, then renamed)."""
    tmp = temporary_name(dst)
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem, or links not allowed: copy
        with src.open("rb") as fin, durable_file(dst, sync_dir=False) as fout:
            shutil.copyfileobj(fin, fout, COPY_CHUNK_BYTES)
        return
    try:
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make the names in directory `path` durable (after renames into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
