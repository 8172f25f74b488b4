"""A worker's snapshots: captured into reused host buffers, written off the training thread as
the very bytes `write_piece` writes, and never more than one in flight."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elasticpp.checkpoint.manifest import PieceEntry, PieceKey, read_manifest
from elasticpp.checkpoint.tensors import PieceMeta, read_piece, write_streamed
from elasticpp.errors import CheckpointError
from elasticpp.plan import ModelSpec
from elasticpp.train.engine.trainer import Trainer
from elasticpp.train.model.contract import init_unit
from elasticpp.train.model.families import build_model
from elasticpp.train.worker.hostcopy import HostBuffers
from elasticpp.train.worker.snapshots import SnapshotWriter
from elasticpp.waiting import wait_until

MODEL = ModelSpec("t", num_layers=2, hidden_size=32, num_heads=4, vocab_size=256, seq_len=16)


def trainer_state(tp_rank: int, tp_size: int, opt_step: int, seed: int = 0) -> Any:
    """The attributes of an `engine.Trainer` that its snapshot reads, for a tp slice of every
    unit of MODEL, with moments that differ from the parameters."""
    model = build_model(MODEL)
    units = [model.unit(n) for n in MODEL.units]
    params, m1, m2, dims = {}, {}, {}, {}
    gen = torch.Generator().manual_seed(seed)
    for unit in units:
        values = init_unit(unit, seed, tp_rank, tp_size)
        params[unit.name] = {n: t.clone().requires_grad_(True) for n, t in values.items()}
        m1[unit.name] = {n: torch.randn(t.shape, generator=gen) for n, t in values.items()}
        m2[unit.name] = {n: torch.rand(t.shape, generator=gen) for n, t in values.items()}
        dims[unit.name] = {p.name: p.shard_dim for p in unit.params}
    return SimpleNamespace(
        coord=SimpleNamespace(tp=tp_rank),
        groups=SimpleNamespace(tp_size=tp_size),
        stage=SimpleNamespace(unit_names=tuple(u.name for u in units)),
        params=params,
        exp_avg=m1,
        exp_avg_sq=m2,
        shard_dims=dims,
        opt_step=opt_step,
    )


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2)])
def test_pieces_written_from_host_buffers_are_the_bytes_the_training_thread_wrote_before(
    tmp_path: Path, tp_rank: int, tp_size: int
) -> None:
    state = trainer_state(tp_rank, tp_size, opt_step=7)
    # What the worker wrote until now: the engine's own snapshot, each piece by write_piece.
    before = [s.write(tmp_path / "before") for s in Trainer.snapshot(state)]
    after = [p.write(tmp_path / "after") for p in HostBuffers(torch.device("cpu")).capture(state)]
    assert after == before  # names, sizes, sha256: what the "snapshot" event reports
    assert len(after) == len(MODEL.units)
    for entry in before:
        name = entry.key.filename
        assert (tmp_path / "after" / name).read_bytes() == (tmp_path / "before" / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "after").iterdir()) == sorted(
        e.key.filename for e in before
    )  # no temporary file left behind


def test_host_buffers_are_allocated_once_and_every_later_snapshot_reuses_them(
    tmp_path: Path,
) -> None:
    host = HostBuffers(torch.device("cpu"))
    first_state = trainer_state(0, 1, opt_step=1, seed=0)
    first = host.capture(first_state)
    allocated = host.allocated
    ptrs = [t.data_ptr() for p in first for t in p.tensors.values()]
    second_state = trainer_state(0, 1, opt_step=2, seed=1)
    second = host.capture(second_state)
    assert host.allocated == allocated  # nothing new
    assert [t.data_ptr() for p in second for t in p.tensors.values()] == ptrs
    # The buffers hold the newest state, not a reference to the live tensors.
    entry = second[0].write(tmp_path)
    piece = read_piece(tmp_path / entry.key.filename, entry.sha256)
    assert piece.meta.step == 2
    unit = second[0].key.unit
    for name, live in second_state.params[unit].items():
        assert torch.equal(piece.tensors[f"param/{name}"], live.detach())
        with torch.no_grad():
            live.add_(1.0)  # the next step's in-place update does not reach the copy
        assert not torch.equal(second[0].tensors[f"param/{name}"], live.detach())


class _Recording(HostBuffers):
    """HostBuffers that note the thread of each buffer they allocate."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.threads: list[str] = []

    def _buffer(self, key: tuple[str, str], like: torch.Tensor) -> torch.Tensor:
        before = self.allocated
        buf = super()._buffer(key, like)
        if self.allocated > before:
            self.threads.append(threading.current_thread().name)
        return buf


def test_reserved_buffers_are_allocated_off_the_training_thread_and_the_capture_uses_them(
    tmp_path: Path,
) -> None:
    # Pinning a rank's state in host memory takes seconds on a GPU: reserve() does it on a
    # thread of its own while training starts, and the first capture allocates nothing.
    state = trainer_state(0, 1, opt_step=3)
    host = _Recording()
    host.reserve(state)
    pieces = host.capture(state)
    tensors = sum(len(p.tensors) for p in pieces)
    assert host.allocated == tensors
    assert host.threads == ["snapshot-buffers"] * tensors
    # ... and what it writes is still the engine's own snapshot, byte for byte.
    before = [s.write(tmp_path / "before") for s in Trainer.snapshot(state)]
    assert [p.write(tmp_path / "after") for p in pieces] == before


def test_a_failed_reservation_is_raised_by_the_next_capture() -> None:
    state = trainer_state(0, 1, opt_step=3)
    broken = SimpleNamespace(**{**vars(state), "stage": SimpleNamespace(unit_names=("nope",))})
    host = HostBuffers(torch.device("cpu"))
    host.reserve(broken)
    with pytest.raises(RuntimeError, match="snapshot buffers: 'nope'"):
        host.capture(state)


def test_a_streamed_piece_refuses_what_write_piece_refuses(tmp_path: Path) -> None:
    key = PieceKey("embed", 0, 1)
    tensors = {"param/w": torch.zeros(2, 2)}
    with pytest.raises(CheckpointError, match=r"no shard dim for \['param/w'\]"):
        write_streamed(tmp_path, key, tensors, PieceMeta("embed", 0, 1, 0, {}))
    with pytest.raises(CheckpointError, match="metadata says head"):
        write_streamed(tmp_path, key, tensors, PieceMeta("head", 0, 1, 0, {"param/w": None}))


class _GatedPiece:
    """A piece whose write waits for `gate`, as behind a slow disk; it records when."""

    def __init__(self, step: int, gate: threading.Event, log: list[str]) -> None:
        self.step, self.gate, self.log = step, gate, log

    def write(self, step_dir: Path) -> PieceEntry:
        step_dir.mkdir(parents=True, exist_ok=True)
        assert self.gate.wait(timeout=30)
        self.log.append(f"written {self.step}")
        return PieceEntry(PieceKey.parse("embed.tp0-1.safetensors"), 1, "0" * 64)


@pytest.mark.timeout(60)
def test_a_slow_writer_makes_the_trainer_wait_with_at_most_one_snapshot_in_flight(
    tmp_path: Path,
) -> None:
    log: list[str] = []
    emitted: list[int] = []
    gates = {step: threading.Event() for step in (1, 2, 3)}
    writer = SnapshotWriter(tmp_path, lambda ev: emitted.append(ev["step"]), {})

    def capture(step: int) -> Any:
        def copy() -> list[_GatedPiece]:
            log.append(f"captured {step}")
            return [_GatedPiece(step, gates[step], log)]

        return copy

    writer.submit(1, capture(1))  # nothing in flight: captured and handed over at once
    assert log == ["captured 1"]
    trainer = threading.Thread(target=lambda: [writer.submit(s, capture(s)) for s in (2, 3)])
    trainer.start()
    # Step 1 is still being written: the trainer waits before it copies step 2 into the
    # buffers that write still reads, instead of queueing a second copy.
    assert wait_until(lambda: writer.waited == 1, 10, interval_s=0.01)
    assert log == ["captured 1"]
    gates[1].set()
    assert wait_until(lambda: writer.waited == 2, 10, interval_s=0.01)
    assert log == ["captured 1", "written 1", "captured 2"]
    gates[2].set()
    gates[3].set()
    trainer.join(timeout=30)
    writer.flush()
    assert log == ["captured 1", "written 1", "captured 2", "written 2", "captured 3", "written 3"]
    assert emitted == [1, 2, 3]  # in order, none skipped
    assert writer.waited == 2


def test_the_step_directory_is_whole_when_its_snapshot_is_reported(tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    writer = SnapshotWriter(tmp_path, events.append, {"generation": 4, "rank": 0})
    host = HostBuffers(torch.device("cpu"))
    writer.write_now(3, lambda: host.capture(trainer_state(0, 1, opt_step=3)))
    (ev,) = events
    assert ev["event"] == "snapshot" and ev["step"] == 3 and ev["generation"] == 4
    step_dir = Path(ev["dir"])
    for p in ev["pieces"]:
        piece = read_piece(step_dir / p["name"], p["sha256"])  # verified against the event
        assert piece.meta.step == 3
        assert (step_dir / p["name"]).stat().st_size == p["size"]
    with pytest.raises(CheckpointError):
        read_manifest(step_dir)  # the worker writes no manifest: whoever collects does
