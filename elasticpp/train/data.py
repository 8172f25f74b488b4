"""Training data: byte windows of a corpus, addressed by global sample index.

Layout independence starts here: global sample `i` (sample `j` of step `k` is
`i = k * B + j`) is the window of `seq_len + 1` bytes at an offset given by a stable hash
of `(seed, i)`, whoever computes it. The default corpus is the Python standard library's
`.py` files (sorted relative paths, concatenated, capped), identical on every machine with
the same Python; `--data` names a file or a directory of files instead.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import torch

from elasticpp.errors import ConfigError

# Directories of third-party code that may sit under the stdlib directory.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stable_int(*parts: object) -> int:
    """A 63-bit integer from a stable hash of `parts` (same on every machine and run)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _files_under(root: Path, suffix: str | None) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if suffix is None or name.endswith(suffix):
                found.append(Path(dirpath) / name)
    # Sorted by relative POSIX path: the walk order of a file system is not stable.
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(data: str | None, max_bytes: int) -> bytes:
    """The corpus bytes (capped at `max_bytes`)."""
    if data is None:
        paths = _files_under(Path(sysconfig.get_paths()["stdlib"]), ".py")
    else:
        root = Path(data)
        if root.is_file():
            paths = [root]
        elif root.is_dir():
            paths = _files_under(root, None)
        else:
            raise ConfigError(f"train: data {data!r} is neither a file nor a directory")
    chunks: list[bytes] = []
    total = 0
    for path in paths:
        if total >= max_bytes:
            break
        try:
            blob = path.read_bytes()
        except OSError:
            continue  # an unreadable file in a directory is skipped, on every machine alike
        chunks.append(blob[: max_bytes - total])
        total += len(chunks[-1])
    return b"".join(chunks)


class Corpus:
    """Byte windows of one corpus for one seed."""

    def __init__(self, blob: bytes, seq_len: int, seed: int) -> None:
        if len(blob) < seq_len + 2:
            raise ConfigError(
                f"train: data has {len(blob)} bytes, needs more than seq_len + 1 = {seq_len + 1}"
            )
        self._data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        self.seq_len = seq_len
        self.seed = seed
        self._span = len(blob) - (seq_len + 1) + 1

    def window(self, sample: int) -> torch.Tensor:
        """The `seq_len + 1` bytes of global sample `sample`, as int64 token ids."""
        start = stable_int("sample", self.seed, sample) % self._span
        return self._data[start : start + self.seq_len + 1].to(torch.int64)

    def batch(self, first_sample: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets `[count, seq_len]` of global samples `first_sample + i`."""
        rows = torch.stack([self.window(first_sample + i) for i in range(count)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
