"""Training data: windows of a corpus, addressed by global sample index.

Layout independence starts here: global sample `i` (sample `j` of step `k` is `i = k * B + j`)
is a pure function of `(seed, i)` and the corpus, whoever computes it. `open_corpus` picks one
of two formats from the `TrainConfig`:

**Token files** (`TokenCorpus`): a `.npy` file (a 1-D array of uint16, uint32, int32 or int64)
is always token ids; a `.bin` file (flat little-endian uint16 or uint32, as `elasticpp data
prepare` writes it) is token ids: its sidecar decides the dtype, or `data_dtype` does when it
has none (with neither it is refused, never read as bytes); a list of such files, or a
directory holding them, is one stream of shards (`elasticpp.train.data.tokenfiles`: order,
sidecar agreement). Files are memory-mapped, never read whole. With `N` tokens in the
stream and sequence length `S` there are `W = (N - 1) // S` windows; window `w` is
`tokens[w*S : w*S + S + 1]` of the stream (inputs are its first `S` ids, targets its last
`S`; it may straddle two shards); the last `N - 1 - W*S` tokens are never read.

- `data_shuffle` false: sample `i` is window `i mod W` (the file in order, wrapping at the end).
- `data_shuffle` true (the default): epoch `e = i // W`, position `q = i mod W`; sample `i` is
  window `perm_e[q]`, where `perm_e = numpy.random.Generator(PCG64(stable_int("epoch", seed,
  e))).permutation(W)`. Each window is used exactly once per epoch. PCG64 and the
  permutation are computed the same on every machine for one numpy version (the pinned one);
  numpy does not promise the stream across its releases, so an upgrade may reorder samples.

A stream with fewer than `S + 1` tokens (no window) is refused, and so is a token id outside
`[0, vocab_size)`: a sample of each shard is checked when it is opened (its first and last
1 Mi ids and 8 strided chunks of 64 Ki), and every window when it is read; a sidecar whose
vocabulary is larger than the model's is refused outright.

**Raw bytes** (`Corpus`), the 256-token byte vocabulary (the model's `vocab_size` must be at
least 256): any other file, or a directory without `.bin`/`.npy` files (its files in sorted
relative paths, concatenated). The window of `seq_len + 1` bytes starts at
`stable_int("sample", seed, i) % span`, where `span = len(corpus) - seq_len`. A corpus
larger than `corpus_max_bytes` is refused, never truncated.
The exception is the built-in demo corpus (`data` unset): the Python standard library's `.py`
files, identical on every machine with the same Python, capped at `corpus_max_bytes`.

torch is imported inside the methods that build tensors, so `check_data` (numpy only) can
refuse bad data in `elasticpp train` before any worker starts without paying torch's import.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from elasticpp.errors import ConfigError
from elasticpp.train.config import TrainConfig
from elasticpp.train.data.tokenfiles import (
    Shard,
    TokenArray,
    TokenStream,
    check_agreement,
    open_shard,
    shards_under,
)

if TYPE_CHECKING:
    import torch

# Directories of third-party code that may sit under the stdlib directory.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
BYTE_VOCAB = 256
# The sample of a token file checked at open: its ends and a few chunks between them.
_CHECK_END_TOKENS = 1 << 20
_CHECK_CHUNKS = 8
_CHECK_CHUNK_TOKENS = 1 << 16


def stable_int(*parts: object) -> int:
    """A 63-bit integer from a stable hash of `parts` (same on every machine and run)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


# -- raw bytes -------------------------------------------------------------------------------


def _files_under(root: Path, suffix: str | None) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if suffix is None or name.endswith(suffix):
                found.append(Path(dirpath) / name)
    # Sorted by relative POSIX path: the walk order of a file system is not stable.
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def load_corpus(data: str | None, max_bytes: int) -> bytes:
    """The raw bytes of `data` (a file or a directory); None = the built-in stdlib corpus.

    The built-in corpus is capped at `max_bytes`; given data larger than that is refused."""
    if data is None:
        return _read_capped(_files_under(Path(sysconfig.get_paths()["stdlib"]), ".py"), max_bytes)
    root = Path(data)
    if root.is_file():
        paths = [root]
    elif root.is_dir():
        paths = _files_under(root, None)
    else:
        raise ConfigError(f"train: data {data!r} is neither a file nor a directory")
    chunks: list[bytes] = []
    total = 0
    for i, path in enumerate(paths):
        # Sized before it is read: a corpus over the cap is refused without reading it all.
        if total + _file_size(path) > max_bytes:
            size = total + sum(_file_size(p) for p in paths[i:])
            raise _over_cap(data, size, max_bytes)
        try:
            blob = path.read_bytes()
        except OSError:
            continue  # an unreadable file in a directory is skipped, on every machine alike
        total += len(blob)
        if total > max_bytes:  # it grew since it was sized
            raise _over_cap(data, total, max_bytes)
        chunks.append(blob)
    return b"".join(chunks)


def _over_cap(data: str, size: int, max_bytes: int) -> ConfigError:
    return ConfigError(
        f"train: data {data!r} is {size} bytes of raw-byte corpus, more than corpus_max_bytes "
        f"{max_bytes}; raise corpus_max_bytes, or tokenise it into a token file "
        "(elasticpp data prepare) and train on that"
    )


def _read_capped(paths: list[Path], max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    for path in paths:
        if total >= max_bytes:
            break
        try:
            blob = path.read_bytes()
        except OSError:
            continue  # an unreadable file is skipped, on every machine alike
        chunks.append(blob[: max_bytes - total])
        total += len(chunks[-1])
    return b"".join(chunks)


def _check_byte_length(length: int, seq_len: int) -> None:
    if length < seq_len + 2:
        raise ConfigError(
            f"train: data has {length} bytes, needs more than seq_len + 1 = {seq_len + 1}"
        )


class Corpus:
    """Raw-byte windows of one corpus for one seed; the interface every corpus offers.

    `batch` is what the engine calls; a subclass changes which window a sample reads by
    overriding `window`."""

    def __init__(self, blob: bytes, seq_len: int, seed: int) -> None:
        import torch

        _check_byte_length(len(blob), seq_len)
        self._data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        self.seq_len = seq_len
        self.seed = seed
        self._span = len(blob) - (seq_len + 1) + 1

    def window(self, sample: int) -> torch.Tensor:
        """The `seq_len + 1` token ids of global sample `sample`, as int64."""
        import torch

        start = stable_int("sample", self.seed, sample) % self._span
        return self._data[start : start + self.seq_len + 1].to(torch.int64)

    def batch(self, first_sample: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets `[count, seq_len]` of global samples `first_sample + i`."""
        import torch

        rows = torch.stack([self.window(first_sample + i) for i in range(count)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


# -- token files -----------------------------------------------------------------------------


def open_tokens(path: str, data_dtype: str | None) -> TokenArray:
    """A memory map of the token ids in one file (.npy, or .bin read as its sidecar says)."""
    return open_shard(path, data_dtype).tokens


def window_count(num_tokens: int, seq_len: int, name: str) -> int:
    """W, the windows of `seq_len + 1` tokens (overlapping by one); refuses W = 0."""
    windows = max(0, (num_tokens - 1) // seq_len)
    if windows < 1:
        raise ConfigError(
            f"train: data {name!r} has {num_tokens} tokens; one window of seq_len + 1 = "
            f"{seq_len + 1} tokens needs at least that many"
        )
    return windows


def epoch_permutation(seed: int, epoch: int, windows: int) -> npt.NDArray[np.int64]:
    """The order of the windows in epoch `epoch`: each of `range(windows)` exactly once."""
    rng = np.random.Generator(np.random.PCG64(stable_int("epoch", seed, epoch)))
    return rng.permutation(windows).astype(np.int64, copy=False)


def _bad_id(chunk: TokenArray, vocab_size: int) -> int | None:
    """The index in `chunk` of its first id outside [0, vocab_size), or None."""
    if not len(chunk):
        return None
    low, high = chunk.min(), chunk.max()
    if low >= 0 and high < vocab_size:
        return None
    return int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])


def _out_of_vocab(path: str, token: int, position: int, vocab_size: int) -> ConfigError:
    return ConfigError(
        f"train: data {path!r}: token id {token} at position {position} is outside the "
        f"model's vocabulary (vocab_size {vocab_size})"
    )


def check_token_sample(tokens: TokenArray, vocab_size: int, path: str) -> None:
    """Refuse ids outside the vocabulary in the file's ends and a few strided chunks."""
    n = len(tokens)
    starts = {0, max(0, n - _CHECK_END_TOKENS)}
    lengths = dict.fromkeys(starts, _CHECK_END_TOKENS)
    for k in range(1, _CHECK_CHUNKS + 1):
        start = k * n // (_CHECK_CHUNKS + 1)
        lengths.setdefault(start, _CHECK_CHUNK_TOKENS)
    for start in sorted(lengths):
        chunk = tokens[start : start + lengths[start]]
        bad = _bad_id(chunk, vocab_size)
        if bad is not None:
            raise _out_of_vocab(path, int(chunk[bad]), start + bad, vocab_size)


class TokenCorpus(Corpus):
    """Windows of a token stream for one seed (addressing: the module docstring).

    Shares `Corpus`'s interface (`batch`, `window`) so the engine takes either; it keeps the
    shards' memory maps instead of a byte buffer. `tokens` is one array or a `TokenStream` of
    shards; the windows are over the stream, so a window may straddle two shards."""

    def __init__(
        self,
        tokens: TokenArray | TokenStream,
        seq_len: int,
        seed: int,
        *,
        vocab_size: int,
        shuffle: bool = True,
        name: str = "<tokens>",
    ) -> None:
        if not isinstance(tokens, TokenStream):
            tokens = TokenStream([Shard(name, tokens, str(tokens.dtype), None)])
        self.windows = window_count(len(tokens), seq_len, name)
        for shard in tokens.shards:
            check_token_sample(shard.tokens, vocab_size, shard.name)
        self._tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size
        self.shuffle = shuffle
        self.name = name
        # Ranks read consecutive samples, so one epoch's order serves many calls; two are kept
        # for a micro-batch that straddles an epoch boundary.
        self._perms: OrderedDict[int, npt.NDArray[np.int64]] = OrderedDict()

    def window_index(self, sample: int) -> int:
        """The window global sample `sample` reads."""
        epoch, position = divmod(sample, self.windows)
        if not self.shuffle:
            return position
        perm = self._perms.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.seed, epoch, self.windows)
            self._perms[epoch] = perm
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        return int(perm[position])

    def window(self, sample: int) -> torch.Tensor:
        import torch

        start = self.window_index(sample) * self.seq_len
        row = np.array(self._tokens[start : start + self.seq_len + 1], dtype=np.int64)
        bad = _bad_id(row, self.vocab_size)
        if bad is not None:
            shard, position = self._tokens.locate(start + bad)
            raise _out_of_vocab(shard, int(row[bad]), position, self.vocab_size)
        return torch.from_numpy(row)


# -- choosing the format ---------------------------------------------------------------------


def _check_byte_vocab(vocab_size: int) -> None:
    if vocab_size < BYTE_VOCAB:
        raise ConfigError(
            f"train: raw-byte data needs a model vocab_size of at least {BYTE_VOCAB} (one id per "
            f"byte value), got {vocab_size}; train on a token file for a smaller vocabulary"
        )


def token_shards(job: TrainConfig) -> list[str] | None:
    """The token files `job.data` names, in stream order; None when it is raw bytes.

    Refuses what names token data wrongly, and token-only settings on raw bytes."""
    data = job.data
    if isinstance(data, tuple):
        return sorted(data)  # ordered by name, as a directory's shards are
    if data is None:
        return None  # the built-in corpus (TrainConfig refuses token settings with it)
    path = Path(data)
    if path.is_dir():
        found = shards_under(path)
        if found is not None:
            return [str(p) for p in found]
        what = f"a directory of raw-byte files ({data!r} holds no .bin or .npy shard)"
    elif path.suffix.lower() in (".npy", ".bin"):
        # A .bin is token ids even without its sidecar: open_shard refuses it then, rather
        # than reading a lost sidecar's ids as bytes.
        return [data]
    elif not path.exists():
        raise ConfigError(f"train: data {data!r}: no such file or directory")
    else:
        what = f"raw bytes ({data!r} is not a .bin or .npy file)"
    if job.data_dtype is not None:
        raise ConfigError(
            f"train: data_dtype {job.data_dtype!r} applies to a token file, but data is {what}"
        )
    if not job.data_shuffle:
        # Raw bytes are sampled at hashed offsets, which has no epoch order to keep.
        raise ConfigError(
            f"train: data_shuffle false applies to token files only, but data is {what}; "
            "raw-byte data is sampled at hashed offsets"
        )
    return None


def open_token_stream(paths: list[str], job: TrainConfig, vocab_size: int) -> TokenStream:
    """The shards of `paths` as one stream, refused unless they are one dataset that fits
    the model's vocabulary (as far as the sidecars tell; the ids are checked as read)."""
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise ConfigError(f"train: data names token shard {dup!r} twice")
    shards = [open_shard(p, job.data_dtype) for p in paths]
    check_agreement(shards)
    for shard in shards:
        sc = shard.sidecar
        if sc is not None and sc.vocab_size > vocab_size:
            raise ConfigError(
                f"train: data {shard.name!r} was tokenised with a vocabulary of {sc.vocab_size} "
                f"tokens (its sidecar says so), more than the model's vocab_size {vocab_size}"
            )
    return TokenStream(shards)


def _raw_path(job: TrainConfig) -> str | None:
    if isinstance(job.data, tuple):  # token_shards never calls a list of shards raw bytes
        raise ConfigError(f"train: data {job.data!r}: a list of files is token shards")
    return job.data


def _data_name(job: TrainConfig) -> str:
    data = job.data
    if isinstance(data, tuple):
        return f"{data[0]} (+{len(data) - 1} shards)" if len(data) > 1 else data[0]
    return str(data)


def open_corpus(job: TrainConfig, seq_len: int, vocab_size: int) -> Corpus:
    """The corpus of `job.data` in the format `job` names (see the module docstring)."""
    paths = token_shards(job)
    if paths is not None:
        return TokenCorpus(
            open_token_stream(paths, job, vocab_size),
            seq_len,
            job.seed,
            vocab_size=vocab_size,
            shuffle=job.data_shuffle,
            name=_data_name(job),
        )
    _check_byte_vocab(vocab_size)
    return Corpus(load_corpus(_raw_path(job), job.corpus_max_bytes), seq_len, job.seed)


def check_data(job: TrainConfig, seq_len: int, vocab_size: int) -> None:
    """Refuse what `open_corpus` would refuse at open, with numpy only (no torch import).

    The built-in corpus is not read: it always holds enough bytes."""
    paths = token_shards(job)
    if paths is not None:
        stream = open_token_stream(paths, job, vocab_size)
        window_count(len(stream), seq_len, _data_name(job))
        for shard in stream.shards:
            check_token_sample(shard.tokens, vocab_size, shard.name)
        return
    _check_byte_vocab(vocab_size)
    raw = _raw_path(job)
    if raw is not None:
        _check_byte_length(len(load_corpus(raw, job.corpus_max_bytes)), seq_len)
