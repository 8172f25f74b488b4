"""Snapshots of a worker's state: which ranks write them (`is_snapshot_writer`) and the
background writer (`SnapshotWriter`): in step order, at most one snapshot in flight, a disk
error reported as "snapshot_failed" instead of ending training.

No torch at import: the supervisor side (the agent) imports this too.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from elasticpp.plan import Plan

log = logging.getLogger("elasticpp.train.worker")


class PieceSource(Protocol):
    """One piece of a snapshot that can write itself (`hostcopy.HostPiece`)."""

    def write(self, step_dir: Path) -> Any: ...  # -> checkpoint.manifest.PieceEntry


Capture = Callable[[], Sequence[PieceSource]]


class SnapshotWriter:
    """Writes snapshots on a background thread, in step order, at most one in flight.

    A snapshot is captured (`capture()`: the state copied into the rank's reused host
    buffers, see `hostcopy.HostBuffers`) only when the previous one has been written, so
    nothing else reads those buffers then: memory is one copy of the rank's state, whatever
    the disk does. When the disk is slower than training, `submit` waits for the write in
    flight before capturing (backpressure, counted in `waited`), and a failure recomputes at
    most the steps since the snapshot in flight. The writer never skips a snapshot it was
    handed: every rank writing a snapshot of every step it was asked for is what lets a node
    (and the job) commit the same step everywhere. Skipping is the worker's decision, taken
    by every rank alike (`snapshot_when_busy: skip`, see `Trainer.train_step`)."""

    def __init__(
        self, root: Path, emit: Callable[[dict[str, Any]], None], extra: dict[str, Any]
    ) -> None:
        self.root = root
        self._emit = emit
        self._extra = extra
        self._cond = threading.Condition()
        self._waiting: tuple[int, Sequence[PieceSource]] | None = None
        self._busy = False
        self._failure: BaseException | None = None
        self.last_step: int | None = None  # the newest step handed over
        self.failed = 0  # snapshots lost to disk errors
        self.waited = 0  # submits that waited for the write in flight (the disk is behind)
        self._idle_at = time.monotonic()  # when the last write ended (or the writer started)
        self._thread = threading.Thread(target=self._run, name="snapshot-writer", daemon=True)
        self._thread.start()

    def idle(self) -> bool:
        """Nothing in flight: a `submit` now would not wait."""
        with self._cond:
            return self._waiting is None and not self._busy

    def idle_since(self) -> float | None:
        """When (time.monotonic()) the last write ended; None while one is waiting or being
        written."""
        with self._cond:
            if self._waiting is not None or self._busy:
                return None
            return self._idle_at

    def wait_for_room(self) -> None:
        """Wait until no snapshot is in flight (waiting or being written): the host buffers
        are free to take the next one."""
        with self._cond:
            if self._waiting is not None or self._busy:
                self.waited += 1
            while self._waiting is not None or self._busy:
                self._cond.wait()

    def submit(self, step: int, capture: Capture) -> None:
        """Capture the state after `step` steps once nothing is in flight, and write it on the
        writer thread; returns as soon as it is captured."""
        self.wait_for_room()
        self.check()
        states = capture()
        self.last_step = step
        with self._cond:
            self._waiting = (step, states)
            self._cond.notify_all()

    def write_now(self, step: int, capture: Capture) -> None:
        """Capture and write on this thread (the final state, and the state at a stop)."""
        self.flush()
        self.last_step = step
        self._write(step, capture())
        with self._cond:
            self._idle_at = time.monotonic()

    def flush(self) -> None:
        """Wait until nothing is waiting or being written."""
        with self._cond:
            while self._waiting is not None or self._busy:
                self._cond.wait()
        self.check()

    def check(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"snapshot write failed: {self._failure}") from self._failure

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None:
                    self._cond.wait()
                item, self._waiting, self._busy = self._waiting, None, True
            try:
                if self._failure is None:
                    self._write(*item)
            except BaseException as exc:  # reported to the training thread by check()
                self._failure = exc
            finally:
                with self._cond:
                    self._busy = False
                    self._idle_at = time.monotonic()
                    self._cond.notify_all()

    def _write(self, step: int, states: Sequence[PieceSource]) -> None:
        """Write one snapshot. A disk error (ENOSPC, EIO) loses this snapshot, not the
        training: the partial directory is removed, the failure is reported, and the step is
        simply never committed. Any other exception is a bug and ends the worker."""
        from elasticpp.checkpoint.durable import fsync_dir
        from elasticpp.checkpoint.manifest import step_dirname

        step_dir = self.root / step_dirname(step)
        try:
            entries = [s.write(step_dir) for s in states]
            # Each piece was renamed into place; one fsync makes all those names durable
            # before the event says they are there.
            fsync_dir(step_dir)
        except OSError as exc:
            shutil.rmtree(step_dir, ignore_errors=True)
            self.failed += 1
            self._emit(
                {
                    "event": "snapshot_failed",
                    "step": step,
                    "message": f"{type(exc).__name__}: {exc}",
                    **self._extra,
                }
            )
            return
        self._emit(
            {
                "event": "snapshot",
                "step": step,
                "dir": str(step_dir),
                "pieces": [
                    {"name": e.key.filename, "size": e.size, "sha256": e.sha256} for e in entries
                ],
                **self._extra,
            }
        )


def is_snapshot_writer(plan: Plan, rank: int) -> bool:
    """Only the lowest dp index of each (pp, tp) on a node writes, so twins do not both write."""
    me = plan.slot(rank)
    twins = [
        s.coord.dp
        for s in plan.placement
        if s.node_id == me.node_id and s.coord.pp == me.coord.pp and s.coord.tp == me.coord.tp
    ]
    return me.coord.dp == min(twins)
