"""Worker output where people look: split per assignment, teed to the agent's stdout.

A worker writes its stdout and stderr to a file of its own from its start (it is spawned
warm, before anyone knows which rank it will be). When the agent assigns it generation G,
rank R, `WorkerLogs.follow` starts at the file's current end: every byte the worker writes
from then on is copied to `gen-<G>/rank-<R>.log` under the log directory and, line by line,
to the agent's stdout prefixed `[gen G rank R] ` (torchrun's tee: `kubectl logs` and
journald show it). One thread copies what the followed files gained, every `poll_s`.

When a worker fails, `failure_tail` copies what is left and returns the last lines of its
assignment's log (its traceback), for the failure event and the agent's log; `keep` copies
that log into `failures/`, where the job's first failures (the root cause of a crash loop)
and the newest ones are kept whatever the rotation of the per-generation directories.
Bounded: the newest GENERATIONS_KEPT generation directories, FIRST_FAILURES_KEPT +
NEWEST_FAILURES_KEPT failure logs.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

log = logging.getLogger("elasticpp.agent")

GENERATIONS_KEPT = 16
FIRST_FAILURES_KEPT = 4
NEWEST_FAILURES_KEPT = 16
TAIL_LINES = 20
TAIL_BYTES = 4096
# Bytes copied per file per pass: a worker printing without pause cannot hold the thread.
CHUNK_BYTES = 1 << 20

_GEN_DIR = re.compile(r"gen-([0-9]{1,12})")
_FAILURE = re.compile(r"([0-9]{6})-gen-[0-9]{1,12}-rank-[0-9]{1,9}\.log")


def assignment_log(root: Path, generation: int, rank: int) -> Path:
    return root / f"gen-{generation:06d}" / f"rank-{rank:04d}.log"


@dataclass
class _Followed:
    source: Path
    generation: int
    rank: int
    target: Path
    offset: int
    partial: bytes = b""
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def prefix(self) -> bytes:
        return f"[gen {self.generation} rank {self.rank}] ".encode()


class WorkerLogs:
    """The node's worker logs (see the module docstring). `out` is where the tee goes (the
    agent's stdout's byte stream), None for no tee."""

    def __init__(
        self,
        root: Path,
        *,
        out: Callable[[], IO[bytes] | None] | None = None,
        poll_s: float = 0.2,
    ) -> None:
        self.root = root
        self._out = out if out is not None else _stdout
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._followed: dict[Path, _Followed] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the copying thread (`follow` does, the first time)."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="worker-logs", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Copy what is left of every followed file, then stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for f in self._all():
            self._copy(f, final=True)

    def follow(self, source: Path, generation: int, rank: int) -> Path:
        """From now on, what the worker writing `source` writes belongs to `generation`,
        `rank`; returns that assignment's log."""
        target = assignment_log(self.root, generation, rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            offset = source.stat().st_size
        except OSError:
            offset = 0
        with self._lock:
            old = self._followed.pop(source, None)
        if old is not None:
            self._copy(old, final=True)
        with self._lock:
            self._followed[source] = _Followed(source, generation, rank, target, offset)
        self._rotate(generation)
        self.start()
        return target

    def forget(self, source: Path) -> None:
        """The worker is gone: copy what is left and stop following it."""
        with self._lock:
            f = self._followed.pop(source, None)
        if f is not None:
            self._copy(f, final=True)

    def failure_tail(self, source: Path) -> str:
        """The last lines of the assignment log of the worker writing `source` (everything
        it wrote copied first), or "" when it is not followed."""
        with self._lock:
            f = self._followed.get(source)
        if f is None:
            return ""
        self._copy(f, final=True)
        return tail_of(f.target)

    def keep(self, source: Path) -> Path | None:
        """Keep the assignment log of `source` in `failures/` (the root cause outlives the
        rotation); returns the kept copy."""
        with self._lock:
            f = self._followed.get(source)
        if f is None:
            return None
        kept_dir = self.root / "failures"
        try:
            kept_dir.mkdir(parents=True, exist_ok=True)
            number = _newest_failure(kept_dir) + 1
            kept = kept_dir / f"{number:06d}-gen-{f.generation}-rank-{f.rank}.log"
            shutil.copyfile(f.target, kept)
            _prune_failures(kept_dir)
        except OSError as exc:
            log.warning("cannot keep %s: %s", f.target, exc)
            return None
        return kept

    # ---------------------------------------------------------------- copying

    def _all(self) -> list[_Followed]:
        with self._lock:
            return list(self._followed.values())

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            for f in self._all():
                self._copy(f)

    def _copy(self, f: _Followed, *, final: bool = False) -> None:
        with f.lock:
            while True:
                try:
                    with f.source.open("rb") as src:
                        src.seek(f.offset)
                        data = src.read(CHUNK_BYTES)
                except OSError:
                    return
                if data:
                    f.offset += len(data)
                    self._write(f, data)
                if len(data) < CHUNK_BYTES:
                    break
            if final and f.partial:
                self._tee(f.prefix + f.partial + b"\n")
                f.partial = b""

    def _write(self, f: _Followed, data: bytes) -> None:
        try:
            with f.target.open("ab") as dst:
                dst.write(data)
        except OSError as exc:
            log.warning("worker log %s: %s", f.target, exc)
        lines = (f.partial + data).split(b"\n")
        f.partial = lines.pop()
        if lines:
            prefix = f.prefix
            self._tee(b"".join(prefix + line + b"\n" for line in lines))

    def _tee(self, data: bytes) -> None:
        out = self._out()
        if out is None:
            return
        try:
            out.write(data)
            out.flush()
        except (OSError, ValueError):
            pass  # stdout closed: the files still have it

    def _rotate(self, generation: int) -> None:
        """Keep the newest GENERATIONS_KEPT generation directories (and `generation`'s)."""
        dirs = []
        for d in self.root.iterdir() if self.root.is_dir() else ():
            m = _GEN_DIR.fullmatch(d.name)
            if m is not None and d.is_dir():
                dirs.append((int(m.group(1)), d))
        dirs.sort()
        followed = {f.generation for f in self._all()}
        for g, d in dirs[:-GENERATIONS_KEPT]:
            if g != generation and g not in followed:
                shutil.rmtree(d, ignore_errors=True)


def _stdout() -> IO[bytes] | None:
    buffer = getattr(sys.stdout, "buffer", None)
    return buffer if buffer is not None else None


def tail_of(path: Path, lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> str:
    """The last `lines` lines of `path`, at most `max_bytes` (from the end), as text."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace").rstrip("\n")
    return "\n".join(text.split("\n")[-lines:])


def _newest_failure(kept_dir: Path) -> int:
    numbers = [
        int(m.group(1)) for p in kept_dir.iterdir() if (m := _FAILURE.fullmatch(p.name)) is not None
    ]
    return max(numbers, default=0)


def _prune_failures(kept_dir: Path) -> None:
    """The job's first FIRST_FAILURES_KEPT failure logs and the newest NEWEST_FAILURES_KEPT."""
    kept = sorted(
        (int(m.group(1)), p) for p in kept_dir.iterdir() if (m := _FAILURE.fullmatch(p.name))
    )
    if len(kept) <= FIRST_FAILURES_KEPT + NEWEST_FAILURES_KEPT:
        return
    for _, p in kept[FIRST_FAILURES_KEPT:-NEWEST_FAILURES_KEPT]:
        p.unlink(missing_ok=True)
