"""A snapshot's host side: one set of reused host buffers shaped like a rank's state, the copy
into them, and the pieces written straight from them.

Invariants:
- `HostBuffers.capture` copies a trainer's units (parameters, AdamW moments, step) into
  buffers allocated once and reused by every later snapshot (while shapes stay the same);
  the caller (`SnapshotWriter`) captures only when no write still reads them, so a rank
  holds at most one snapshot's copy of its state, however slow the disk.
- On CUDA the buffers are pinned and the copy runs on a side stream, queued after the step's
  update; the next step's forward and backward run beside it (they only read the state),
  and only its optimizer update waits for the copy on the device (`Trainer.update_after`:
  the update writes the parameters and moments in place). The writer waits for the copy on
  the host before reading a buffer. The training thread never blocks on the device-to-host
  copy. On CPU the copy is a plain `copy_` on the calling thread: no allocation, no
  serialisation, no hashing.
- Pinning 2-3 GB of host memory takes a second or more: `reserve` allocates the buffers on a
  thread of their own while training runs, and the first capture waits only for what is
  left of it.
- A piece is written from the buffers by `checkpoint.tensors.write_streamed` (the checkpoint
  format's own writer): byte for byte the file `write_piece` writes for the same tensors
  and metadata (safetensors: 8-byte header length, JSON header
  with `__metadata__` first and tensors by name, padded with spaces to 8 bytes, then the
  data in header order), with the same name, size and sha256. It is serialised and hashed
  as it is written, from the buffers' memory, with no copy of the state in Python bytes;
  hashing and file writes release the GIL. Pieces holding anything but fp32 tensors (which
  snapshots never do) go through `write_piece` itself.
- Each piece appears atomically (`checkpoint.durable`); the caller fsyncs the step
  directory once after its last piece, before reporting the snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elasticpp.checkpoint.manifest import PieceEntry, PieceKey
from elasticpp.checkpoint.tensors import KINDS, PieceMeta, write_streamed


@dataclass(frozen=True)
class HostPiece:
    """One unit of a captured snapshot: views of the reused host buffers."""

    key: PieceKey
    tensors: dict[str, torch.Tensor]
    meta: PieceMeta
    ready: Callable[[], None]  # blocks until the copy into the buffers is complete

    def write(self, step_dir: Path) -> PieceEntry:
        self.ready()
        return write_streamed(step_dir, self.key, self.tensors, self.meta)


class HostBuffers:
    """The host buffers of one rank's snapshots, allocated at the first capture, reused."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._stream = None
        if self._cuda:
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.allocated = 0  # buffers allocated so far (stays flat while shapes do)
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None

    def reserve(self, trainer: Any) -> None:
        """Allocate every buffer a capture of `trainer` needs, on a thread of its own; the
        next capture waits for it. A failure here (out of pinned memory, say) is raised by
        that capture."""

        def run() -> None:
            try:
                for (unit, full), t in _state(trainer):
                    self._buffer((unit, full), t)
            except BaseException as exc:
                self._reserve_error = exc

        self._reserving = threading.Thread(target=run, name="snapshot-buffers", daemon=True)
        self._reserving.start()

    def _reserved(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
            if self._reserve_error is not None:
                raise RuntimeError(
                    f"snapshot buffers: {self._reserve_error}"
                ) from self._reserve_error

    def _buffer(self, key: tuple[str, str], like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=self._cuda)
            self._buffers[key] = buf
            self.allocated += 1
        return buf

    def capture(self, trainer: Any) -> list[HostPiece]:
        """Copy `trainer`'s units (an `engine.Trainer`: the state `Trainer.snapshot` copies)
        into the buffers. Call it only when no write reads the buffers any more."""
        self._reserved()
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged: list[tuple[PieceKey, dict[str, torch.Tensor], PieceMeta]] = []
        tp_rank, tp_size = trainer.coord.tp, trainer.groups.tp_size
        by_unit: dict[str, tuple[dict[str, torch.Tensor], dict[str, int | None]]] = {
            unit: ({}, {}) for unit in trainer.stage.unit_names
        }
        for (unit, full), t in _state(trainer):  # the same walk `reserve` allocated for
            buf = self._buffer((unit, full), t)
            pairs.append((buf, t.detach()))
            tensors, dims = by_unit[unit]
            tensors[full] = buf
            dims[full] = trainer.shard_dims[unit][full.split("/", 1)[1]]
        for unit, (tensors, dims) in by_unit.items():
            key = PieceKey(unit, tp_rank, tp_size)
            staged.append((key, tensors, PieceMeta(unit, tp_rank, tp_size, trainer.opt_step, dims)))
        ready = self._copy(pairs, trainer)
        return [HostPiece(key, tensors, meta, ready) for key, tensors, meta in staged]

    def _copy(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], trainer: Any
    ) -> Callable[[], None]:
        if self._stream is None:
            for buf, src in pairs:
                buf.copy_(src)
            return _nothing
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # after the update this snapshot is of
        with torch.cuda.stream(self._stream):
            for buf, src in pairs:
                buf.copy_(src, non_blocking=True)
                src.record_stream(self._stream)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self._stream)
        trainer.update_after(done)  # the next in-place update waits for the copy
        return done.synchronize


def _state(trainer: Any) -> list[tuple[tuple[str, str], torch.Tensor]]:
    """Every tensor a capture copies, keyed as its buffer is (unit, "kind/name")."""
    sources = (trainer.params, trainer.exp_avg, trainer.exp_avg_sq)
    return [
        ((unit, f"{kind}/{name}"), t)
        for unit in trainer.stage.unit_names
        for kind, source in zip(KINDS, sources, strict=True)
        for name, t in source[unit].items()
    ]


def _nothing() -> None:
    pass
